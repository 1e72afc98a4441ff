"""Reports of long runs (lioncub-sim, lioncub-compare, lioncub-reliability): checked before the runs, never
overwritten."""
from __future__ import annotations

import os
import time
from pathlib import Path


def check_report_path(flag: str, path: Path) -> None:
    """Before a long run: the report's folder exists and a file can be written there, so the results are
    not lost to a traceback at the end (SystemExit with one line otherwise)."""
    probe = path.parent / f".lioncub-write-check.{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")  # as root, permissions do not tell
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"error: {flag} {path} cannot be written ({e.strerror or e}); choose another path") from None


def keep_previous_report(path: Path) -> Path | None:
    """An earlier report at ``path`` moves to ``<stem>.previous-<time><suffix>`` beside it before a new
    one is written (nothing a user had is lost); returns where it went, or None."""
    if not path.exists():
        return None
    aside = stamped(path.parent, f"{path.stem}.previous-", path.stat().st_mtime, path.suffix)
    path.rename(aside)
    return aside


def stamped(folder: Path, prefix: str, mtime: float, suffix: str = "") -> Path:
    """``folder/<prefix><mtime as local time><suffix>``, with -1, -2, ... after the time where that exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(mtime))
    path, k = folder / f"{prefix}{stamp}{suffix}", 1
    while path.exists():
        path, k = folder / f"{prefix}{stamp}-{k}{suffix}", k + 1
    return path
