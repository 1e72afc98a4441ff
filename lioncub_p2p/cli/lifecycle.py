"""Leaving cleanly: SIGINT and SIGTERM stop a tool at a safe point, and no child process outlives it.

Python turns SIGINT into KeyboardInterrupt only if SIGINT was not ignored at start, and a shell
script's background job (``cmd &``) starts with SIGINT ignored; SIGTERM (``kill``, ``docker stop``,
systemd) kills a Python process outright. Both are handled here explicitly.

hivemind runs its DHT in a forked child that runs the libp2p daemon (``p2pd``) as a grandchild; a
parent that dies without ``dht.shutdown()`` leaves both running. ``ChildReaper`` ends, at exit, any
descendant the tool started that is still alive after the orderly shutdown.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# torch's shared-memory manager (started for hivemind's inter-process tensors) exits by itself once
# this process, its last client, is gone, and unlinks the segments it tracks: ending it early would
# leave them behind.
OUTLIVE = {"torch_shm_manag"}  # as /proc/PID/comm spells it (15 characters)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when a stop signal arrives while it waits (joining, waiting for peers)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopSignals:
    """SIGINT/SIGTERM handlers for the main thread. Outside ``deferred()`` a signal raises ``Interrupted``
    at once (nothing is at stake while waiting); inside it the first signal only sets ``requested``
    (the training loop stops between steps) and a second one raises. After ``leaving()`` signals are
    only recorded, so the shutdown itself runs to its end."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._deferred = 0
        self._leaving = False
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        again = self.received is not None
        self.received = signal.Signals(signum).name
        if self._leaving or (self._deferred and not again):
            return
        raise Interrupted(self.received)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A region (a training step) that a first stop signal must not cut in half."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1

    def leaving(self) -> None:
        self._leaving = True


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19])


def descendants(pid: int | None = None) -> dict[int, int]:
    """Every live descendant of ``pid`` (default: this process) -> its start time (to tell reused pids)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux: nothing to inspect
        return {}
    for entry in entries:
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] != "Z":
                children.setdefault(stat[0], []).append((int(entry), stat[2]))
    found: dict[int, int] = {}
    stack = [root]
    while stack:
        for child, started in children.get(stack.pop(), []):
            if child not in found:
                found[child] = started
                stack.append(child)
    return found


def alive(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z" and stat[2] == started


class ChildReaper:
    """Ends, at exit, the descendants started inside the ``with`` block that are still alive:
    SIGTERM, then SIGKILL after ``grace`` seconds. Processes that existed before are left alone."""

    def __init__(self, grace: float = 3.0):
        self.grace = grace
        self.before: dict[int, int] = {}
        self.reaped: list[str] = []  # "name (pid)" of each leftover

    def __enter__(self) -> "ChildReaper":
        self.before = descendants()
        return self

    def __exit__(self, *exc) -> None:
        self.reap()

    def reap(self) -> list[str]:
        """Ends the leftovers; returns them as "name (pid)" (empty when the orderly shutdown left none)."""
        left = {pid: t for pid, t in descendants().items() if self.before.get(pid) != t and _name(pid) not in OUTLIVE}
        self.reaped = [f"{_name(pid)} ({pid})" for pid in left]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + self.grace
            while left and time.monotonic() < deadline:
                _collect(left)
                left = {pid: t for pid, t in left.items() if alive(pid, t)}
                time.sleep(0.05)
            if not left:
                break
        return self.reaped


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _collect(pids: dict[int, int]) -> None:
    """Wait for those of ``pids`` that are our own exited children, so they do not linger as zombies."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (a grandchild), or already collected
            pass
