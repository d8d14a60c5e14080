"""The one way the package changes another module's (or object's) attributes: ``patched``.

    with patched(torch, save=recording_save):        # restored when the block ends
        ...
    patches = contextlib.ExitStack()                 # for the life of a process or an install
    patches.enter_context(patched(dist, all_reduce=tracked, broadcast=tracked))
    patches.close()                                  # everything put back, last patch first

An attribute the owner only inherits (a method, a class attribute) or lacks is deleted on exit
rather than written back, so a patched instance or subclass is left as it was found; one kept
by a property or by the owner's own ``__setattr__`` (``torch.backends.cudnn.allow_tf32``) is
set back to its value.
``tests/test_architecture.py`` finds any other assignment to an imported module's attribute.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

_ABSENT = object()


def _own(owner: Any, name: str) -> Any:
    """What to put back as ``name`` on ``owner``: what it holds itself, or its value where a
    property or a module-like object's ``__setattr__`` keeps it; ``_ABSENT`` where it only
    inherits ``name`` (a method, a class attribute) or has none, so deleting restores it."""
    own = getattr(owner, "__dict__", None)
    if own is not None and name in own:
        return own[name]
    if isinstance(owner, type):
        inherited = any(name in vars(k) for k in owner.__mro__[1:])
        return getattr(owner, name) if not inherited and hasattr(owner, name) else _ABSENT
    on_class = next((vars(k)[name] for k in type(owner).__mro__ if name in vars(k)), _ABSENT)
    if on_class is not _ABSENT and not hasattr(type(on_class), "__set__"):   # shadowed, not set through
        return _ABSENT
    return getattr(owner, name, _ABSENT)


@contextlib.contextmanager
def patched(owner: Any, **values: Any) -> Iterator[Any]:
    """Set each of ``values`` as an attribute of ``owner`` for the block; on exit, put back
    what ``owner`` held before (or delete what it did not hold). Yields ``owner``."""
    saved = {name: _own(owner, name) for name in values}
    done = []
    try:
        for name, value in values.items():
            setattr(owner, name, value)
            done.append(name)
        yield owner
    finally:
        for name in reversed(done):
            if saved[name] is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, saved[name])
