"""Swarm membership: signed DHT records, admission, the run manifest, group upkeep, state transfer,
digests, checkpoints, momentum averaging."""
from .manifest import Manifest, ManifestError, publish_manifest
from .membership import Directory, GroupRecord, PeerRecord
from .errors import AdmissionRefused, SettingsMismatch, SwarmError
from .config import SwarmConfig
from .peer import Swarm
from .pipeline import StepStats

__all__ = ["Swarm", "SwarmConfig", "SwarmError", "AdmissionRefused", "SettingsMismatch", "StepStats", "Directory",
           "GroupRecord", "PeerRecord", "Manifest", "ManifestError", "publish_manifest"]
