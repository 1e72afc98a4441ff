"""Pieces shared by the command-line tools."""
from __future__ import annotations

import logging
import time
from pathlib import Path


def setup_logging(quiet: bool = False) -> None:
    """INFO to stderr; ``quiet`` only matters to progress bars (the tools print log lines instead)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def read_peers_file(path: str | None, wait: float = 60.0) -> list[str]:
    """Multiaddrs from a file another peer writes (one per line); waits for it to appear."""
    if not path:
        return []
    deadline = time.monotonic() + wait
    while not Path(path).exists() or not Path(path).read_text().strip():
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {path} did not appear within {wait:.0f} s: is the first coordinator running?")
        time.sleep(0.2)
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
