"""The cluster path: LionCub's vote over ``torch.distributed`` with the swarm's codecs and bytes.

``ClusterAggregator``: ranks of a job (gloo on CPU, NCCL on GPUs) vote as a butterfly group would.
``HybridAggregator``: a volunteer's local ranks count exactly, then vote in a swarm as one peer.
Nothing in the package imports this; it builds on ``allreduce``, ``codecs``, ``optim`` and ``momentum``.
"""
from .aggregator import ClusterAggregator, ClusterStats
from .collectives import Collectives, TorchCollectives
from .hybrid import HybridAggregator

__all__ = ["ClusterAggregator", "ClusterStats", "Collectives", "TorchCollectives", "HybridAggregator"]
