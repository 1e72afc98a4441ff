"""Round time against the number of peers: flat butterfly vs two-level vote (issue 16 §1), side by side.

Two steps, both printed in one run:

1. **Calibrate** the cost of one message end (send or receive: framing, stream bookkeeping, the daemon
   hop) on real rounds: ``LocalSwarm`` rounds of a tiny buffer for several group sizes, all peers in
   one process, so a round's time is its messages' CPU; the slope of the median round time against
   2 n (n - 1) messages, two ends each, is the cost per end (``--per-message-ms`` skips this).
2. **Model** (``lioncub_p2p.sim.scale``) one round of each protocol for each n and each seed of the
   links: rates drawn from the simulator's default links (100/50/20/10 Mbit/s), access latencies so
   that round trips span 20-150 ms, every peer starting at once. Medians over seeds.

    nice -n 19 python benchmarks/scale.py [--peers 16 64 256 1024] [--numel 1M 16M] [--seeds 0 1 2]
        [--group 32] [--json runs/scale.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from lioncub_p2p import ops
from lioncub_p2p.allreduce import AllReduceConfig
from lioncub_p2p.allreduce.hierarchy import assign_groups
from lioncub_p2p.sim.scale import Network, flat_round, two_level_round

try:
    from kernels import parse_size
except ImportError:  # run as a module
    from benchmarks.kernels import parse_size

MAX_STREAMS = AllReduceConfig().max_streams  # incoming streams a peer serves at once


def calibrate(sizes: list[int], rounds: int) -> tuple[float, list[dict]]:
    """Seconds per message end, from real rounds of a tiny buffer: for each group size, the round time
    beyond the smallest group's over the extra message ends; the median of these (one size starved of
    CPU by something else on the machine must not set it)."""
    from lioncub_p2p.testing import LocalSwarm
    rows = []
    for n in sizes:
        with LocalSwarm(n) as swarm:
            uploads = [ops.pack_signs(torch.randn(4096, generator=torch.Generator().manual_seed(i))) for i in range(n)]
            for step in range(3):  # warm-up: connections, kept streams
                swarm.allreduce(uploads, step=step)
            times = []
            for step in range(3, 3 + rounds):
                started = time.perf_counter()
                swarm.allreduce(uploads, step=step)
                times.append(time.perf_counter() - started)
        rows.append({"peers": n, "round_s": statistics.median(times), "message_ends": 4 * n * (n - 1)})
        print(f"  real round, {n} peers in one process: {rows[-1]['round_s'] * 1000:.1f} ms median of {rounds}")
    base = rows[0]
    slopes = [(r["round_s"] - base["round_s"]) / (r["message_ends"] - base["message_ends"]) for r in rows[1:]]
    print("  per message end, each size against the smallest: " + ", ".join(f"{s * 1000:.3f} ms" for s in slopes))
    return statistics.median(slopes), rows


def model(peers: list[int], numels: list[int], seeds: list[int], group: int, per_message_s: float) -> list[dict]:
    rows = []
    for numel in numels:
        for n in peers:
            runs = []
            for seed in seeds:
                net = Network.draw(n, seed=seed, per_message_s=per_message_s)
                flat, two = flat_round(net, numel), two_level_round(net, numel, max_size=group, epoch=seed)
                runs.append((flat, two))
            med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
            sizes = [len(g) for g in assign_groups([str(i) for i in range(n)], 0, group)]
            row = {"numel": numel, "peers": n, "groups": len(sizes), "group_size": max(sizes),
                   "flat_s": med(lambda r: r[0].round_s), "two_level_s": med(lambda r: r[1].round_s),
                   "flat_median_peer_s": med(lambda r: float(np.median(r[0].finished))),
                   "two_level_median_peer_s": med(lambda r: float(np.median(r[1].finished))),
                   "flat_mb_up": med(lambda r: float(r[0].bytes_up.mean()) / 1e6),
                   "two_level_mb_up": med(lambda r: float(r[1].bytes_up.mean()) / 1e6),
                   "two_level_mb_up_max": med(lambda r: float(r[1].bytes_up.max()) / 1e6),
                   "flat_messages": med(lambda r: float(r[0].messages.max())),
                   "two_level_messages": med(lambda r: float(r[1].messages.max()))}
            rows.append(row)
            print(f"  modelled {n} peers, {numel:,} params: flat {row['flat_s']:.3f} s, "
                  f"two-level {row['two_level_s']:.3f} s", flush=True)
    return rows


def report(rows: list[dict], seeds: int, per_message_s: float) -> str:
    lines = [f"\nmedians over {seeds} link draws; {per_message_s * 1000:.3f} ms per message end; "
             "links 100/50/20/10 Mbit/s, RTT 20-150 ms",
             "| params | peers | groups × size | flat: round s | two-level: round s | flat / two-level | "
             "MB up per peer: flat / two-level (max) | messages sent per peer (max): flat / two-level | "
             "flat streams in per peer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        streams = r["peers"] - 1
        cap = f"{streams} (> cap {MAX_STREAMS})" if streams > MAX_STREAMS else str(streams)
        lines.append(f"| {r['numel'] / 1e6:g}M | {r['peers']} | {r['groups']} × {r['group_size']} | "
                     f"{r['flat_s']:.3f} | {r['two_level_s']:.3f} | {r['flat_s'] / r['two_level_s']:.2f}× | "
                     f"{r['flat_mb_up']:.3f} / {r['two_level_mb_up']:.3f} ({r['two_level_mb_up_max']:.3f}) | "
                     f"{r['flat_messages']:.0f} / {r['two_level_messages']:.0f} | {cap} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", nargs="+", type=int, default=[16, 64, 256, 1024])
    p.add_argument("--numel", nargs="+", default=["1M", "16M"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--group", type=int, default=32, help="largest group of the two-level vote")
    p.add_argument("--per-message-ms", type=float, default=None, help="skip the calibration")
    p.add_argument("--calibrate-peers", nargs="+", type=int, default=[2, 4, 6, 8])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    started = time.perf_counter()
    calibration: list[dict] = []
    if args.per_message_ms is None:
        print("calibrating on real rounds:")
        per_message_s, calibration = calibrate(args.calibrate_peers, args.rounds)
        print(f"  => {per_message_s * 1000:.3f} ms per message end")
    else:
        per_message_s = args.per_message_ms / 1000
    rows = model(args.peers, [parse_size(s) for s in args.numel], args.seeds, args.group, per_message_s)
    print(report(rows, len(args.seeds), per_message_s))
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"per_message_s": per_message_s, "calibration": calibration,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
