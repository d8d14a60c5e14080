"""The worker pool: persistent torch.distributed ranks driven from a notebook kernel.

Three kinds of process run this package's code, and its folders say which runs what (a test
keeps every module in its place, and each process's modules from importing another's; the
launcher imports ``ranks.rank``, which its forked children run):

=============  ==================================================================================
where          modules
=============  ==================================================================================
``kernel/``    the notebook's kernel: ``cluster`` (the public ``Cluster``), ``call`` (one call),
               ``link`` (reading the ranks), ``printer`` (their output, labelled; a start's
               progress), ``traffic`` (what calls left in flight), ``deadlock``, ``health``
               (``cluster.status()``), ``magic`` (``%%ranks``), ``procs`` (handles on the
               launcher and a generation)
``launcher``   the launcher process: forks or spawns the ranks, kills and reaps them
``ranks/``     each rank: ``rank`` (the loop), ``group`` (the pool's process group), ``forwarder``
               (fds 1 and 2 to the kernel), ``isolation`` (a script's imports, the learner's
               threads), ``fresh`` (a script's process state: folder, settings, random streams,
               logging, its end); a rank records its collectives, traffic and waits with
               ``dpcourse.tracking``'s tracker, whose records the messages carry
top level      every process: ``wire`` (every message, one class each, and how they are
               pickled), ``errors``, ``reaper`` (what the ranks' scripts leave running)
=============  ==================================================================================
"""
from .kernel.cluster import Cluster, current_cluster
from .errors import ClusterError, RankDied, RankError, RankReport, RankTimeout, SerializationError
from ..processes import free_port

__all__ = ["Cluster", "ClusterError", "RankDied", "RankError", "RankReport", "RankTimeout",
           "SerializationError", "current_cluster", "free_port"]
