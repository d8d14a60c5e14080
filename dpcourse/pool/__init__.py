"""The worker pool: persistent torch.distributed ranks driven from a notebook kernel.

Three kinds of process run this package's code; each module runs in one of them, or in all
three (a test keeps the table whole, and each process's modules from importing another's;
the launcher imports ``rank``, which its forked children run):

=========  =====================================================================================
process    modules
=========  =====================================================================================
kernel     ``cluster`` (the public ``Cluster``), ``call`` (one call), ``link`` (reading the
           ranks), ``printer`` (their output, labelled), ``traffic`` (what calls left in
           flight), ``deadlock``, ``health`` (``cluster.status()``), ``magic`` (``%%ranks``),
           ``procs`` (handles on the launcher and on a generation)
launcher   ``launcher`` (forks or spawns the ranks, kills and reaps them)
rank       ``rank`` (the loop), ``group`` (the pool's process group), ``tracker`` (collectives
           and traffic), ``forwarder`` (fds 1 and 2 to the kernel), ``isolation`` (a script's
           imports)
all three  ``wire`` (every message, one class each, and how they are pickled), ``errors``,
           ``reaper`` (what the ranks' scripts leave running)
=========  =====================================================================================
"""
from .cluster import Cluster, current_cluster
from .errors import ClusterError, RankDied, RankError, RankReport, RankTimeout, SerializationError
from ..processes import free_port

__all__ = ["Cluster", "ClusterError", "RankDied", "RankError", "RankReport", "RankTimeout",
           "SerializationError", "current_cluster", "free_port"]
