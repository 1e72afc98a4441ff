"""Local checkpoints: a snapshot written atomically, so a crash never leaves a torn file."""
from __future__ import annotations

import os
from pathlib import Path

from ..optim import LionCub
from . import snapshot

FILENAME = "state.lcub"


def save(directory: str | Path, optimizer: LionCub) -> Path:
    """Write ``directory/state.lcub`` via a temporary file, fsync and rename."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    blob, _ = snapshot.encode(optimizer)
    target = directory / FILENAME
    tmp = directory / f".{FILENAME}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def restore(directory: str | Path, optimizer: LionCub) -> int | None:
    """Load ``directory/state.lcub`` into the optimizer if it exists; returns its step (None if absent).

    A checkpoint that does not match the model raises SnapshotError and changes nothing."""
    path = Path(directory) / FILENAME
    if not path.exists():
        return None
    return snapshot.load(optimizer, path.read_bytes())
