"""Past one machine: Ray actors forming one JAX cluster, SLURM scripts (Ray Tune sweeps of
CLI runs are `jaxtrain tune`, cli/tune.py).

Ray is an optional extra (`pip install jaxtrain[ray]`), imported only when a cluster starts;
`import jaxtrain` never imports this package.
"""

from jaxtrain.distributed.cluster import Attempt, ClusterConfig, ClusterError, run_on_cluster
from jaxtrain.distributed.config import RayDistributedConfig
from jaxtrain.distributed.trainer import RayDistributedTrainer

__all__ = [
    "Attempt",
    "ClusterConfig",
    "ClusterError",
    "RayDistributedConfig",
    "RayDistributedTrainer",
    "run_on_cluster",
]
