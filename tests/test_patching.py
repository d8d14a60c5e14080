"""The one way to patch: ``dpcourse.patching.patched`` puts back exactly what was there."""
from __future__ import annotations

import contextlib
import types

import pytest

from dpcourse.patching import patched


def test_a_module_attribute_is_set_for_the_block_and_restored():
    module = types.ModuleType("m")
    module.f = original = lambda: 1
    with patched(module, f=lambda: 2, g=3) as got:
        assert got is module and module.f() == 2 and module.g == 3
    assert module.f is original and not hasattr(module, "g")


def test_an_inherited_method_patched_on_an_instance_or_subclass_is_deleted_not_copied_down():
    class Base:
        def hello(self):
            return "base"

    class Sub(Base):
        pass

    obj = Sub()
    with patched(obj, hello=lambda: "instance"), patched(Sub, hello=lambda self: "sub"):
        assert obj.hello() == "instance" and Sub().hello() == "sub"
    assert "hello" not in vars(obj) and "hello" not in vars(Sub) and obj.hello() == "base"


def test_a_staticmethod_comes_back_as_the_descriptor_it_was():
    class K:
        @staticmethod
        def f():
            return 1

    with patched(K, f=staticmethod(lambda: 2)):
        assert K().f() == 2
    assert isinstance(vars(K)["f"], staticmethod) and K().f() == 1


def test_an_error_inside_restores_and_propagates_and_stacked_patches_unwind_last_first():
    module = types.ModuleType("m")
    module.x = 0
    with pytest.raises(ValueError), patched(module, x=1):
        raise ValueError
    assert module.x == 0
    stack = contextlib.ExitStack()
    stack.enter_context(patched(module, x=1))
    stack.enter_context(patched(module, x=2))
    assert module.x == 2
    stack.close()
    assert module.x == 0


def test_a_failed_set_puts_back_the_ones_already_set():
    class NoNew:
        __slots__ = ("a",)

    obj = NoNew()
    obj.a = 1
    with pytest.raises(AttributeError), patched(obj, a=2, b=3):
        pass
    assert obj.a == 1


def test_a_property_and_an_attribute_kept_by_setattr_are_set_back_to_their_values():
    class Flags:
        def __init__(self):
            object.__setattr__(self, "_store", {"tf32": True})

        def __getattr__(self, name):
            return self._store[name]

        def __setattr__(self, name, value):
            self._store[name] = value

    class WithProperty:
        _x = 1
        x = property(lambda self: self._x, lambda self, v: setattr(self, "_x", v))

    flags, obj = Flags(), WithProperty()
    with patched(flags, tf32=False), patched(obj, x=5):
        assert flags.tf32 is False and obj.x == 5
    assert flags.tf32 is True and obj.x == 1
