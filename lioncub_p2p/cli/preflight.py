"""lioncub-train --preflight: can this machine take part, and how fast will its rounds be?

Checks, in order, each with a one-line verdict: the coordinators answer (the DHT starts and finds
the run's records); whether peers can dial this machine or it needs --client-mode (from its
addresses: a private or loopback address without --announce-maddrs cannot be dialed from outside);
the upload and download bandwidth to a member of the run (a timed 4 MiB probe each way); the
compute time of one step of the chosen model here; and the resulting seconds per round.
"""
from __future__ import annotations

import ipaddress
import time

import torch

from ..swarm import Swarm, SwarmError
from ..swarm.probe import measure


def _dialable(maddrs: list[str]) -> bool:
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                ip = ipaddress.ip_address(parts[2])
            except ValueError:
                continue
            if not (ip.is_private or ip.is_loopback or ip.is_unspecified or ip.is_link_local):
                return True
        elif len(parts) > 2 and parts[1].startswith("dns"):
            return True
    return False


def preflight(args, config, task, model) -> int:
    """Print the checks; returns a process exit code (0: ready)."""
    print(f"preflight for run {config.run_id!r}")
    try:
        swarm = Swarm(config)
    except SwarmError as e:
        print(f"  [FAIL] coordinators: {e}")
        return 2
    try:
        records = swarm.loop.run(swarm.directory.peers(), timeout=30)
        group = swarm.loop.run(swarm.directory.group(), timeout=30)
        if not config.initial_peers:
            print("  [WARN] no --initial-peers: this machine would start a run of its own")
        elif not records and group is None:
            print("  [FAIL] coordinators answer, but nobody trains in this run yet (is --run-id right?)")
            return 3
        else:
            steps = max((r.step for r in records.values()), default=0)
            print(f"  [ OK ] coordinators answer: {len(records)} peers online, global step {steps}")
        visible = [str(m) for m in config.announce_maddrs] or [str(m) for m in swarm.dht.get_visible_maddrs()]
        if config.client_mode:
            print("  [ OK ] client mode: you dial out only; you vote and receive results, reduce nothing")
        elif _dialable(visible):
            print("  [ OK ] reachable: your addresses are public, peers can dial you")
        else:
            print("  [WARN] peers probably cannot dial you (only private/loopback addresses and no "
                  "--announce-maddrs): use --client-mode, or forward a port and pass --announce-maddrs")
        donors = [pid for pid, r in records.items() if r.synced and not r.client_mode and pid != swarm.peer_id]
        up = down = None
        for pid in donors[:3]:
            try:
                up, down = swarm.loop.run(measure(swarm.p2p, pid, token=swarm.admission.token(swarm.peer_id)),
                                          timeout=120)
                print(f"  [ OK ] bandwidth to {pid[:12]}…: upload {up:.1f} Mbit/s, download {down:.1f} Mbit/s")
                break
            except Exception as e:
                print(f"  [WARN] probe to {pid[:12]}… failed: {type(e).__name__}: {e}")
        numel = sum(p.numel() for p in model.parameters())
        x, y = task.sample(0, 1, args.batch, torch.Generator().manual_seed(0))
        started = time.perf_counter()
        for _ in range(3):
            task.loss(model, x, y).backward()
        compute = (time.perf_counter() - started) / 3
        n = max(len(records), 2)
        bits = 2 * (n - 1) / n * numel  # 1-bit votes up and results down, per peer per round
        print(f"  [ OK ] model: {numel / 1e6:.2f}M parameters, {compute * 1e3:.0f} ms per step of compute here")
        if up and down:
            seconds = compute + bits / 2 / (up * 1e6) + bits / 2 / (down * 1e6)
            verdict = "ready" if seconds < 10 else "slow: consider --client-mode"
            print(f"  [ OK ] estimated {seconds:.2f} s per round with {n} peers ({verdict})")
        else:
            print("  [WARN] no bandwidth figure (no synced member answered the probe): cannot estimate round time")
        return 0
    finally:
        swarm.shutdown()
