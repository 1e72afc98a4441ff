"""hivemind's DHT process: started with a bound on the wait, stopped with its libp2p daemon.

``hivemind.DHT(start=True)`` forks a process that starts the daemon and bootstraps, and waits for it
with no time limit. That process has been seen to hang before it was ready (on a loaded machine, in a
process spawned by another), leaving the peer stuck before its first log line. ``start_dht`` bounds
the wait: a start that does not finish in time is killed with its daemon and tried again, and the last
failure is raised as ``TimeoutError`` for the caller to report in one line. ``stop_dht`` makes sure no
daemon outlives its DHT.
"""
from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

from hivemind import DHT

logger = logging.getLogger(__name__)

DHT_START_S = 60.0  # a healthy start takes ~0.5 s, ~10 s on a machine under heavy load
DHT_START_TRIES = 2


def start_dht(*, timeout: float = DHT_START_S, tries: int = DHT_START_TRIES, **kwargs) -> DHT:
    """A started ``DHT(**kwargs)``; its own errors (a port in use, no initial peer reachable) pass through."""
    for attempt in range(tries):
        dht = DHT(start=False, **kwargs)
        try:
            dht.run_in_background(await_ready=True, timeout=timeout)
            return dht
        except TimeoutError:
            _kill(descendants(dht.pid) + [dht.pid])
            dht.join(5)
            if attempt + 1 < tries:
                logger.warning("the DHT did not start in %.0f s: starting it again", timeout)
        except Exception:  # it reported why (a port in use): it and its daemon must not outlive the error
            if dht.pid is not None:
                _kill(descendants(dht.pid) + [dht.pid])
                dht.join(5)
            raise
    raise TimeoutError(f"the DHT did not start in {timeout:.0f} s, {tries} times")


def stop_dht(dht: DHT) -> None:
    """Stop the DHT process; make sure its p2pd and helpers are gone with it."""
    below = descendants(dht.pid) if dht.pid is not None else []
    dht.shutdown()
    dht.join(10)
    left = [pid for pid in ([dht.pid] + below if dht.is_alive() else below) if pid is not None and alive(pid)]
    for pid in left:
        logger.info("process %d of the DHT outlived it: killing it", pid)
    _kill(left)


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc), deepest last: the DHT process's p2pd and helpers."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pids: list[int | None]) -> None:
    for pid in pids:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def port_in_use(error: Exception) -> bool:
    """Whether a DHT start failed because its listening port is taken."""
    return "address already in use" in str(error).lower()


def start_failure(error: Exception, host_maddrs: Sequence[str]) -> str:
    """One line for a DHT that did not start, naming its likely cause: a listening port in use is this
    machine's (another trainer, a coordinator still running), not the coordinators' reachability."""
    if port_in_use(error):
        taken = " ".join(str(m) for m in host_maddrs)
        return (f"could not listen on {taken}: the port is in use (another lioncub-train or lioncub-coordinator "
                f"still running on this machine?); stop it, or pass --host-maddrs with another port (tcp/0: any free one)")
    return f"could not start the DHT ({error}); check --initial-peers and that the coordinators are reachable"
