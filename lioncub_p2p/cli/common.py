"""Pieces shared by the command-line tools."""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path


class UsageError(ValueError):
    """A mistake in the command line or its files; the message is one line naming the problem and the fix."""


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # a flag that takes no value (store_true, store_false) says what it does: its default is noise
        nothing = default is None or default is False or default == [] or default == argparse.SUPPRESS \
            or action.nargs == 0
        if "%(default)" in text or nothing or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})"


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="log lines at this level and above to stderr (debug: every round's events)")


def setup_logging(level: str = "info") -> None:
    """Log lines at ``level`` and above to stderr."""
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def read_peers_file(path: str | None, wait: float = 60.0) -> list[str]:
    """Multiaddrs from a file another peer writes (one per line); waits for it to appear."""
    if not path:
        return []
    deadline = time.monotonic() + wait
    while True:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            text = ""
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--initial-peers-file {path} cannot be read ({type(e).__name__}: {e})") from None
        if text.strip():
            return [line.strip() for line in text.splitlines() if line.strip()]
        if time.monotonic() > deadline:
            raise UsageError(f"{path} did not appear within {wait:.0f} s: is the first coordinator running?")
        time.sleep(0.2)
