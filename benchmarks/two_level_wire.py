"""Flat vote vs two-level vote on the wire: n VoteNodes on loopback, side by side in one swarm (issue 16 §1).

For each n, one ``LocalSwarm`` runs flat rounds (every peer reduces 1/n, n − 1 streams each way) and
two-level rounds (``hierarchy.two_level_specs``: groups of at most ``--max-size``, then each part's
second-level round among the groups' reducers) alternately on the same packed signs. Per kind: the
median round time (the slowest peer's, over ``--rounds``), the bytes a peer sends (median peer, both
levels), the streams it opens, and whether every peer got the flat majority bit for bit. Loopback has
neither latency nor a bandwidth limit and the 2n daemons share this machine's cores, so the times
say what the message count costs in CPU, not what an internet link would (``sim/scale.py`` models that).

    nice -n 19 env OMP_NUM_THREADS=1 python benchmarks/two_level_wire.py [--peers 16 32]
        [--numel 1M] [--max-size 8] [--rounds 5] [--json runs/two_level_wire.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from lioncub_p2p import ops
from lioncub_p2p.allreduce import AllReduceConfig, hierarchy
from lioncub_p2p.testing import LocalSwarm

try:
    from kernels import parse_size
except ImportError:  # run as a module
    from benchmarks.kernels import parse_size


def _sent(report) -> int:
    return report.bytes_up + (report.combine.bytes_up if report.combine is not None else 0)


def _uploads(n: int, numel: int, step: int) -> list[torch.Tensor]:
    """Fresh signs every step, the same for both kinds."""
    return [ops.pack_signs(torch.randn(numel, generator=torch.Generator().manual_seed(step * 100_003 + i)))
            for i in range(n)]


def measure(n: int, numel: int, max_size: int, rounds: int) -> dict:
    uploads = _uploads(n, numel, 0)
    rows: dict[str, dict[str, list]] = {kind: {"s": [], "bytes": [], "exact": []} for kind in ("flat", "two-level")}
    # results as deltas off: a two-level round's result equals the flat round's of the same step, a delta
    # against it would be free (both kinds vote the same signs at each step)
    with LocalSwarm(n, config=AllReduceConfig(result_deltas=False)) as swarm:
        ids = [p.peer_id for p in swarm.group]
        layout = hierarchy.two_level_layout(ids, 0, uploads[0].numel(), max_size)
        swarm.allreduce(uploads)  # warm-up: connections
        swarm.two_level(uploads, max_size=max_size)
        for step in range(1, rounds + 1):
            uploads = _uploads(n, numel, step)
            stack = torch.stack(uploads)
            for kind in ("flat", "two-level"):
                if kind == "flat":
                    results = swarm.allreduce(uploads, step=step)
                else:
                    results = swarm.two_level(uploads, max_size=max_size, step=step)
                flat = ops.majority_vote(stack, step=step)
                row = rows[kind]
                row["s"].append(max(r.timings["total"] for r in swarm.reports))
                row["bytes"].append(statistics.median(_sent(r) for r in swarm.reports))
                row["exact"].append(all(r is not None and torch.equal(r, flat) for r in results))
    g, groups = max(len(x) for x in layout.groups), len(layout.groups)
    return {"peers": n, "numel": numel, "groups": groups, "max_group": g,
            "streams": {"flat": n - 1, "two-level": (g - 1) + (groups - 1)},
            **{kind: {"round_s": statistics.median(r["s"]), "bytes_up": statistics.median(r["bytes"]),
                      "exact_rounds": sum(r["exact"]), "rounds": len(r["s"])} for kind, r in rows.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", nargs="+", type=int, default=[16, 32])
    p.add_argument("--numel", type=parse_size, default=parse_size("1M"))
    p.add_argument("--max-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = []
    print("| peers | groups × size | flat: round s | two-level: round s | flat / two-level | "
          "kB sent per peer: flat / two-level | streams out per peer: flat / two-level | flat majority, bit for bit |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.peers:
        r = measure(n, args.numel, args.max_size, args.rounds)
        results.append(r)
        f, t = r["flat"], r["two-level"]
        print(f"| {n} | {r['groups']} × ≤{r['max_group']} | {f['round_s']:.3f} | {t['round_s']:.3f} | "
              f"{f['round_s'] / t['round_s']:.2f} | {f['bytes_up'] / 1e3:.0f} / {t['bytes_up'] / 1e3:.0f} | "
              f"{r['streams']['flat']} / {r['streams']['two-level']} | "
              f"{f['exact_rounds']}/{f['rounds']} and {t['exact_rounds']}/{t['rounds']} rounds |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
