"""Starting peer processes for tests: each in its own process group, all killed at the end."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Processes:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=self.workdir)
        self.procs[name] = proc
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        kill_group(self.procs[name], sig)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()

    def wait(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                self.procs[name].wait(remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish in time; log tail:\n{self.log(name)[-3000:]}")

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for name, proc in self.procs.items():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            self.kill(name, signal.SIGKILL)  # the group may hold orphaned DHT or daemon processes


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a process started with start_new_session: the peer, its DHT process and libp2p daemons."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_or_none(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit code, or None when it did not exit in time (so that the caller can show its log)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def wait_for(condition, timeout: float, what: str, poll: float = 0.2):
    """Poll ``condition`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_for_file(path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear in {timeout} s")


def last_step(metrics: Path) -> int:
    """The last step a trainer logged in its metrics JSONL (-1 before the first)."""
    if not metrics.exists():
        return -1
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])["step"] if lines else -1


def read_jsonl(path: Path) -> list[dict]:
    """Every complete line of a JSONL file a process may still be writing ([] before it exists)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
