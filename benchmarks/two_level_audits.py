"""What a two-level vote's audits cost on the wire, against the round they check (issue 16 §1).

After a round, a voter compares one slice of another part's result with the second level's signed
slice (``VoteNode._compare_with_second_level``: the slice's bytes, header and signature) and then
checks the margins that part's reducer sent up (``VoteNode._check_margins``: one margin leaf of every
counted reducer from the slice's combiner, and the reducer's counted voters' codes for the same
positions, each with its Merkle path). Both run after a share ``slice_audit_rate`` (0.25) of rounds.
Here every voter audits every round (rate 1, one part each) in a ``LocalSwarm`` on loopback; the bytes
of each kind of answer are summed as serialized (protobuf ``ByteSize``; stream framing not counted)
and set beside the median peer's bytes of the round itself (both levels, up and down).

    nice -n 19 env OMP_NUM_THREADS=1 python benchmarks/two_level_audits.py [--peers 13 32]
        [--numel 1M] [--max-size 4 8] [--rounds 4]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from lioncub_p2p import ops
from lioncub_p2p.allreduce import AllReduceConfig
from lioncub_p2p.testing import LocalSwarm

try:
    from kernels import parse_size
except ImportError:  # run as a module
    from benchmarks.kernels import parse_size

RATE = 0.25  # AllReduceConfig.slice_audit_rate's default


def _round_bytes(report) -> int:
    both = report.bytes_up + report.bytes_down
    return both + (report.combine.bytes_up + report.combine.bytes_down if report.combine is not None else 0)


def _count(node, tally: dict[str, int], calls: dict[str, int]) -> None:
    """Wrap the node's audit requests and slice fetches to add up the bytes of their answers."""
    ask_audit, fetch_slice = node._ask_audit, node._fetch_slice

    async def counted_ask(spec, j, leaves, voters):
        answers = await ask_audit(spec, j, leaves, voters)
        kind = "margins (combiner)" if spec.second_level else "margins (reducer)"
        tally[kind] += sum(a.ByteSize() for found in answers.values() for a in found)
        calls[kind] += 1
        return answers

    async def counted_fetch(second, q, per_ask, **kwargs):
        got = await fetch_slice(second, q, per_ask, **kwargs)
        if got is not None:
            piece = got[1]
            tally["slice compare"] += len(piece.wire) + len(piece.header) + len(piece.signature) + len(piece.public_key)
            calls["slice compare"] += 1
        return got

    node._ask_audit, node._fetch_slice = counted_ask, counted_fetch


def measure(n: int, numel: int, max_size: int, rounds: int) -> dict:
    config = AllReduceConfig(result_deltas=False, slice_audit_rate=1.0, audits_per_round=1)
    tally = {"slice compare": 0, "margins (combiner)": 0, "margins (reducer)": 0}
    calls = dict.fromkeys(tally, 0)
    round_bytes = []
    with LocalSwarm(n, config=config) as swarm:
        for node in swarm.nodes:
            _count(node, tally, calls)
        for step in range(1, rounds + 1):
            uploads = [ops.pack_signs(torch.randn(numel, generator=torch.Generator().manual_seed(step * 1009 + i)))
                       for i in range(n)]
            swarm.two_level(uploads, max_size=max_size, step=step)
            swarm.settle_audits()
            round_bytes.append(statistics.median(_round_bytes(r) for r in swarm.reports))
        checked = sum(node.margins_checked for node in swarm.nodes)
        caught = sum(len(node.caught) for node in swarm.nodes)
    per_round = statistics.median(round_bytes)
    per_check = {k: v / max(calls[k], 1) for k, v in tally.items()}
    # each voter audits one part a round (after a share RATE of rounds): a compare, then a margins check
    return {"peers": n, "max_size": max_size, "numel": numel, "checks": checked, "caught": caught,
            "round_bytes_per_peer": per_round, "per_check": per_check,
            "share_at_default_rate": {k: RATE * v / per_round for k, v in per_check.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", nargs="+", type=int, default=[13, 32])
    p.add_argument("--numel", type=parse_size, default=parse_size("1M"))
    p.add_argument("--max-size", nargs="+", type=int, default=[4, 8])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    print("| peers | groups of ≤ | round kB per peer | per check kB: slice compare / margins at combiner / at "
          "reducer | at rate 0.25, share of the round's bytes: compare / margins | checks (honest reports) |")
    print("|---|---|---|---|---|---|")
    for n in args.peers:
        for size in args.max_size:
            r = measure(n, args.numel, size, args.rounds)
            c, s = r["per_check"], r["share_at_default_rate"]
            print(f"| {n} | {size} | {r['round_bytes_per_peer'] / 1e3:.0f} | {c['slice compare'] / 1e3:.1f} / "
                  f"{c['margins (combiner)'] / 1e3:.1f} / {c['margins (reducer)'] / 1e3:.1f} | "
                  f"{100 * s['slice compare']:.1f}% / "
                  f"{100 * (s['margins (combiner)'] + s['margins (reducer)']):.1f}% | {r['checks']} "
                  f"({r['caught']}) |", flush=True)


if __name__ == "__main__":
    main()
