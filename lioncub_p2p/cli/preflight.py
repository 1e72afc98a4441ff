"""lioncub-train --preflight: can this machine take part, and how fast will its rounds be?

Checks, in order, each with a one-line verdict: the coordinators answer (the DHT starts and finds
the run's records); the run admits this peer (a private run's leader refuses a peer without its
secret, an open run one with a secret) and this peer's flags agree with the run's manifest: a
failed check with a non-zero exit; whether peers can dial this machine, and if not the exact flags
to change; the upload and download bandwidth to a member of the run (a timed 4 MiB probe each way;
a refused probe is a failed check); the compute time of one step of the run's task here; and the
resulting seconds per round. Exit code 0: ready.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from ..swarm import AdmissionRefused, Manifest, SettingsMismatch, Swarm, SwarmConfig, SwarmError
from ..swarm.peer import LISTEN_ALL
from ..swarm.probe import measure
from .addresses import PUBLIC_PORT_ADVICE, dialable_from_outside, scope

FAIL_COORDINATORS, FAIL_EMPTY_RUN, FAIL_ADMISSION, FAIL_PROBE, FAIL_SETTINGS = 2, 3, 4, 5, 6


def reachability_verdict(config: SwarmConfig, visible: list[str]) -> tuple[str, str]:
    """("OK" or "WARN", the line saying whether others can dial this peer and which flag to change)."""
    if config.client_mode:
        return "OK", "client mode: you dial out only; you vote and receive results, reduce nothing"
    if dialable_from_outside(visible):
        public = [m for m in visible if scope(m) == "public"]
        return "OK", f"reachable: peers can dial you at {public[0]}" + (f" (+{len(public) - 1} more)" if public[1:] else "")
    if visible and all(scope(m) == "loopback" for m in visible):
        return "WARN", (f"you listen on loopback only ({' '.join(config.host_maddrs)}): no other machine can dial you; "
                        f"listen on every interface with --host-maddrs {' '.join(LISTEN_ALL)} (the default), then "
                        f"{PUBLIC_PORT_ADVICE}")
    return "WARN", (f"peers on other networks probably cannot dial you (private addresses only: "
                    f"{', '.join(visible) or 'none'}): {PUBLIC_PORT_ADVICE}")


def preflight(config: SwarmConfig, task_for: Callable[[Manifest], tuple]) -> int:
    """Print the checks; returns a process exit code (0: ready). ``task_for(run manifest)`` gives
    (settings, task, batches_for) of the task this peer would train."""
    print(f"preflight for run {config.run_id!r}", flush=True)
    try:
        swarm = Swarm(config)
    except AdmissionRefused as e:
        print(f"  [FAIL] admission: {e}", flush=True)
        return FAIL_ADMISSION
    except SettingsMismatch as e:
        print(f"  [FAIL] settings: {e}", flush=True)
        return FAIL_SETTINGS
    except SwarmError as e:
        print(f"  [FAIL] coordinators: {e}", flush=True)
        return FAIL_COORDINATORS
    try:
        records = swarm.loop.run(swarm.directory.peers(), timeout=30)
        group = swarm.loop.run(swarm.directory.group(), timeout=30)
        if not config.initial_peers:
            print("  [WARN] no --initial-peers: this machine would start a run of its own")
        elif not records and group is None:
            print("  [FAIL] coordinators answer, but nobody trains in this run yet (is --run-id right?)")
            return FAIL_EMPTY_RUN
        else:
            steps = max((r.step for r in records.values()), default=0)
            print(f"  [ OK ] coordinators answer: {len(records)} peers online, global step {steps}")
        if group is not None:
            print(f"  [ OK ] admission: the run's group (epoch {group.epoch}, {len(group.members)} members) "
                  f"admits this peer{' (run secret checked)' if config.run_secret else ''}")
        visible = [str(m) for m in config.announce_maddrs] or swarm.visible_maddrs()
        verdict, line = reachability_verdict(config, visible)
        print(f"  [{verdict:^4}] {line}", flush=True)
        up = down = None
        refusals = []
        donors = [pid for pid, r in records.items() if r.synced and not r.client_mode and pid != swarm.peer_id]
        for pid in donors[:3]:
            try:
                up, down = swarm.loop.run(measure(swarm.p2p, pid, token=swarm.admission.token(swarm.peer_id)),
                                          timeout=120)
                print(f"  [ OK ] bandwidth to {pid[:12]}…: upload {up:.1f} Mbit/s, download {down:.1f} Mbit/s")
                break
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                refusals.append(f"{pid[:12]}… ({type(e).__name__})")  # a member closes a probe it refuses, unanswered
            except Exception as e:
                print(f"  [WARN] probe to {pid[:12]}… failed: {type(e).__name__}: {e}")
        if refusals and up is None:
            print(f"  [FAIL] the run's members refused the bandwidth probe: {', '.join(refusals)}: they admit only "
                  f"holders of the run's secret (check --run-secret) or allow-listed peer ids", flush=True)
            return FAIL_PROBE
        settings, task, batches_for = task_for(swarm.manifest)
        numel = sum(p.numel() for p in task.model.parameters())
        batches = batches_for(torch.Generator().manual_seed(0))
        started = time.perf_counter()
        for _ in range(3):
            task.loss(task.model, next(batches)).backward()
        compute = (time.perf_counter() - started) / 3
        task.model.zero_grad(set_to_none=True)
        n = max(len(records), 2)
        bits = 2 * (n - 1) / n * numel  # 1-bit votes up and results down, per peer per round
        print(f"  [ OK ] model ({task.name}, batch {settings.batch}): {numel / 1e6:.2f}M parameters, "
              f"{compute * 1e3:.0f} ms per step of compute here")
        if up and down:
            seconds = compute + bits / 2 / (up * 1e6) + bits / 2 / (down * 1e6)
            verdict = "ready" if seconds < 10 else "slow: consider --client-mode"
            print(f"  [ OK ] estimated {seconds:.2f} s per round with {n} peers ({verdict})")
        else:
            print("  [WARN] no bandwidth figure (no synced member answered the probe): cannot estimate round time")
        return 0
    finally:
        swarm.shutdown()
