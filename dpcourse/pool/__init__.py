"""The worker pool: persistent torch.distributed ranks driven from a notebook kernel."""
from .cluster import Cluster, current_cluster
from .errors import ClusterError, RankDied, RankError, RankReport, RankTimeout, SerializationError
from .procs import free_port

__all__ = ["Cluster", "ClusterError", "RankDied", "RankError", "RankReport", "RankTimeout",
           "SerializationError", "current_cluster", "free_port"]
