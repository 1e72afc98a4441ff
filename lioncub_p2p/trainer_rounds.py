"""The vote-round timeouts a ``lioncub-train`` peer runs with, below both the CLI and the simulator
(whose process-fault scenarios must wait exactly as long as the trainers they kill)."""
from __future__ import annotations

from .allreduce import AllReduceConfig


def allreduce_config(upload_timeout: float, result_timeout: float, result_deltas: bool = True) -> AllReduceConfig:
    """Joins and recoveries wait at most 5 s (or the upload timeout, if shorter)."""
    short = min(5.0, upload_timeout)
    return AllReduceConfig(upload_timeout=upload_timeout, result_timeout=result_timeout, join_timeout=short,
                           recovery_timeout=short, result_deltas=result_deltas)
