"""Local checkpoints: a snapshot written atomically, so a crash never leaves a torn file."""
from __future__ import annotations

import os
from pathlib import Path

from ..optim import LionCub
from . import snapshot

FILENAME = "state.lcub"


def save(directory: str | Path, optimizer: LionCub, run_id: str | None = None) -> Path:
    """Write ``directory/state.lcub`` via a temporary file, fsync and rename; ``run_id`` goes in its header."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    blob, _ = snapshot.encode(optimizer, run=run_id)
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


def restore(directory: str | Path, optimizer: LionCub, run_id: str | None = None) -> int | None:
    """Load ``directory/state.lcub`` into the optimizer if it exists; returns its step (None if absent).

    A checkpoint that does not match the model, or that another run wrote (``run_id``), raises
    SnapshotError and changes nothing: a new run in an old run's folder resumed the old run's weights
    and step silently."""
    path = Path(directory) / FILENAME
    if not path.exists():
        return None
    blob = path.read_bytes()
    check_run(path, snapshot.read_header(blob)[0], run_id)
    return snapshot.load(optimizer, blob)


def check_run(path: Path, header: dict, run_id: str | None) -> None:
    """SnapshotError if the checkpoint at ``path`` names another run than ``run_id`` (older ones name none)."""
    written_by = header.get("run")
    if run_id is not None and written_by is not None and written_by != run_id:
        raise snapshot.SnapshotError(f"{path} holds the state of run {str(written_by)[:64]!r}, not {run_id!r}: "
                                     "choose another --checkpoint-dir (or move that file away)")
