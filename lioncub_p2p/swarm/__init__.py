"""Swarm membership: DHT records, group upkeep, state transfer, digests, checkpoints, momentum averaging."""
from .membership import Directory, GroupRecord, PeerRecord
from .peer import Swarm, SwarmConfig, SwarmError, StepStats

__all__ = ["Swarm", "SwarmConfig", "SwarmError", "StepStats", "Directory", "GroupRecord", "PeerRecord"]
