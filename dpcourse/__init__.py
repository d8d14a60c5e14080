"""dpcourse: an interactive course on data parallelism in PyTorch, on real ranks.

    import dpcourse as dpc
    cluster = dpc.Cluster(world_size=4)      # real torch.distributed ranks (gloo on CPU)
    cluster.run(fn)                          # fn runs on every rank; results by rank
    %load_ext dpcourse                       # then %%ranks runs a cell on every rank
"""
from .pool import Cluster, RankError, RankTimeout

__version__ = "0.1.0"
# The README's table, and only it: every other name is imported from its module
# (``dpcourse.pool.errors.RankDied``). ``load_ipython_extension`` is IPython's hook for
# ``%load_ext dpcourse``, called by IPython, not typed by a learner.
__all__ = ["Cluster", "RankError", "RankTimeout"]


def load_ipython_extension(ipython) -> None:
    """``%load_ext dpcourse`` (or ``%reload_ext dpcourse``, which a notebook's first cell uses so
    that running it again prints nothing): registers the %%ranks cell magic."""
    from .pool.kernel.magic import RanksMagics

    ipython.register_magics(RanksMagics)


def unload_ipython_extension(ipython) -> None:
    """``%reload_ext dpcourse`` unloads before loading again: %%ranks stays registered (the
    load that follows registers it anew), and the clusters keep running."""


# Subpackages load on first use (dpc.train, dpc.viz, ...): `import dpcourse` stays cheap, and
# the launcher and ranks, which import it, never load drawing code they do not use.
_SUBPACKAGES = ("collectives", "exercises", "memory", "models", "observe", "scratch", "scripts", "train", "viz")


def __getattr__(name):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBPACKAGES))
