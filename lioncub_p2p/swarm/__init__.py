"""Swarm membership: signed DHT records, admission, the run manifest, group upkeep, state transfer,
digests, checkpoints, momentum averaging."""
from .manifest import Manifest, ManifestError, publish_manifest
from .membership import Directory, GroupRecord, PeerRecord
from .peer import AdmissionRefused, SettingsMismatch, Swarm, SwarmConfig, SwarmError
from .pipeline import StepStats

__all__ = ["Swarm", "SwarmConfig", "SwarmError", "AdmissionRefused", "SettingsMismatch", "StepStats", "Directory",
           "GroupRecord", "PeerRecord", "Manifest", "ManifestError", "publish_manifest"]
