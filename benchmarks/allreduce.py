"""Vote all-reduce vs hivemind's DecentralizedAverager, 4 peers on loopback, side by side in one run.

For each size: median round time of our 1-bit sign/majority butterfly (LocalSwarm) and of hivemind's
float32 and float16 all-reduce of the same number of parameters, the bytes each peer put on the wire
(ours counted by the protocol, framing included; hivemind's from the butterfly formula, as it does not
count them), and the ratios. Loopback has no bandwidth limit, so times here are CPU-bound; the
bandwidth-capped comparison is the simulator's job.

    python benchmarks/allreduce.py [--sizes 1M 16M 64M] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from lioncub_p2p import ops
from lioncub_p2p.sim.baselines import HivemindAllReduce
from lioncub_p2p.testing import LocalSwarm

try:
    from kernels import parse_size
except ImportError:  # run as a module
    from benchmarks.kernels import parse_size


def ours(numel: int, n: int, rounds: int) -> tuple[float, float]:
    with LocalSwarm(n) as swarm:
        uploads = [ops.pack_signs(torch.randn(numel, generator=torch.Generator().manual_seed(i))) for i in range(n)]
        swarm.allreduce(uploads)  # warm-up: streams, connections
        times, sent = [], []
        for step in range(rounds):
            swarm.allreduce(uploads, step=step)
            times.append(max(r.timings["total"] for r in swarm.reports))
            sent.append(max(r.bytes_up for r in swarm.reports))
        return statistics.median(times), statistics.median(sent)


def hivemind(numel: int, n: int, rounds: int, wire_dtype: str) -> float:
    with HivemindAllReduce(n, numel, wire_dtype=wire_dtype, prefix=f"bench-{numel}-{wire_dtype}") as group:
        group.step()
        return statistics.median(group.step() for _ in range(rounds))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="vote all-reduce vs hivemind averager on loopback")
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M", "64M"])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    n, rows = args.peers, []
    print(f"{args.peers} peers on 127.0.0.1, median of {args.rounds} rounds")
    print(f"{'params':>8} {'ours s':>8} {'ours MB/peer':>13} {'lower bound':>12} {'fp32 s':>8} {'fp16 s':>8} "
          f"{'time fp32/ours':>15} {'time fp16/ours':>15} {'bytes fp32/ours':>16}")
    for size in args.sizes:
        numel = parse_size(size)
        t_ours, sent = ours(numel, n, args.rounds)
        t32 = hivemind(numel, n, args.rounds, "float32")
        t16 = hivemind(numel, n, args.rounds, "float16")
        bound = 2 * (n - 1) / n * numel / 8
        fp32_bytes = 2 * (n - 1) / n * numel * 4
        row = dict(numel=numel, peers=n, ours_s=t_ours, ours_bytes_up=sent, lower_bound_bytes=bound,
                   ours_bytes_over_bound=sent / bound, hivemind_fp32_s=t32, hivemind_fp16_s=t16,
                   hivemind_fp32_bytes_up=fp32_bytes, hivemind_fp16_bytes_up=fp32_bytes / 2,
                   speedup_vs_fp32=t32 / t_ours, speedup_vs_fp16=t16 / t_ours, bytes_ratio_fp32=fp32_bytes / sent,
                   ours_goodput_params_per_s=numel / t_ours)
        rows.append(row)
        print(f"{size:>8} {t_ours:>8.3f} {sent / 1e6:>13.3f} {sent / bound:>11.3f}x {t32:>8.3f} {t16:>8.3f} "
              f"{t32 / t_ours:>14.1f}x {t16 / t_ours:>14.1f}x {fp32_bytes / sent:>15.1f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
