"""Cluster path vs butterfly: the same 1-bit vote of the same buffers, side by side in one run.

For each size, n ranks/peers on loopback vote packed signs (sign upload, majority result):

* cluster: n gloo processes, ``ClusterAggregator.aggregate`` (all-to-all of parts, counts on packed
  words, all-gather of results), the round time being the slowest rank's;
* butterfly: ``LocalSwarm`` (n libp2p peers in this process, signed results, audits), the round
  time being the slowest peer's ``timings["total"]``;
* yardstick: the same n gloo processes all-reducing the float32 values (``dist.all_reduce``,
  what data-parallel training sends per step).

Bytes are what one rank sends per round: the cluster's payload (``ClusterStats.vote_bytes``), the
butterfly's bytes written to streams (framing, headers and signatures included) and its payload,
and the all-reduce's ring formula 2·(n−1)/n·4 bytes per element. Every run checks that the cluster
and the butterfly returned the same bytes on every rank. Loopback has no bandwidth limit: times
here are CPU (and, for the butterfly, protocol) costs, not network ones.

    nice -n 19 env OMP_NUM_THREADS=1 python benchmarks/cluster.py [--sizes 1M 16M] [--ranks 4]
        [--rounds 7] [--json runs/cluster.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lioncub_p2p import ops
from lioncub_p2p.cluster import ClusterAggregator
from lioncub_p2p.testing import LocalSwarm

try:
    from kernels import parse_size
except ImportError:  # run as a module
    from benchmarks.kernels import parse_size


def uploads_for(numel: int, n: int) -> list[torch.Tensor]:
    return [ops.pack_signs(torch.randn(numel, generator=torch.Generator().manual_seed(i))).unsqueeze(0)
            for i in range(n)]


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _rank(rank: int, world: int, workdir: str, numel: int, rounds: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    try:
        upload = uploads_for(numel, world)[rank]
        agg = ClusterAggregator(None, seed=0, check=True)
        agg.aggregate(upload, step=0)  # warm-up: connections
        vote_times = []
        for step in range(rounds):
            dist.barrier()
            started = time.perf_counter()
            agg.aggregate(upload, step=step)
            vote_times.append(_slowest(time.perf_counter() - started))
        values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        dist.all_reduce(values.clone())
        reduce_times = []
        for _ in range(rounds):
            buffer = values.clone()
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer)
            reduce_times.append(_slowest(time.perf_counter() - started))
        last = agg.aggregate(upload, step=rounds)  # the bytes the butterfly must match (step = rounds)
        out = {"vote_s": statistics.median(vote_times), "allreduce_s": statistics.median(reduce_times),
               "vote_bytes": agg.stats.vote_bytes, "digest": hashlib.sha256(last.numpy().tobytes()).hexdigest()}
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def cluster(numel: int, world: int, rounds: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="lioncub-cluster-bench-") as workdir:
        ctx = mp.start_processes(_rank, args=(world, workdir, numel, rounds), nprocs=world, join=False,
                                 start_method="spawn")
        try:
            deadline = time.monotonic() + 1800
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError("gloo ranks did not finish in 30 minutes")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        return [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(world)]


def butterfly(numel: int, n: int, rounds: int) -> dict:
    uploads = uploads_for(numel, n)
    with LocalSwarm(n) as swarm:
        swarm.allreduce(uploads)  # warm-up: streams, connections
        times, sent, payload = [], [], []
        for step in range(rounds):
            swarm.allreduce(uploads, step=step)
            times.append(max(r.timings["total"] for r in swarm.reports))
            sent.append(max(r.bytes_up for r in swarm.reports))
            payload.append(max(r.payload_up for r in swarm.reports))
        last = swarm.allreduce(uploads, step=rounds)
    return {"vote_s": statistics.median(times), "bytes_up": statistics.median(sent),
            "payload_up": statistics.median(payload),
            "digests": [hashlib.sha256(u.numpy().tobytes()).hexdigest() for u in last]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[1 << 20, 16 << 20])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.rounds < 1:
        parser.error("need --ranks >= 2 and --rounds >= 1")
    torch.set_num_threads(1)
    rows = []
    for numel in args.sizes:
        ranks = cluster(numel, args.ranks, args.rounds)
        ours = butterfly(numel, args.ranks, args.rounds)
        equal = all(r["digest"] == d for r, d in zip(ranks, ours["digests"]))
        rows.append({"numel": numel, "ranks": args.ranks, "cluster_s": ranks[0]["vote_s"],
                     "cluster_bytes": max(r["vote_bytes"] for r in ranks), "butterfly_s": ours["vote_s"],
                     "butterfly_bytes": ours["bytes_up"], "butterfly_payload": ours["payload_up"],
                     "allreduce_s": ranks[0]["allreduce_s"],
                     "allreduce_bytes": 2 * (args.ranks - 1) / args.ranks * 4 * numel, "same_bytes": equal})
        print(f"  {numel:,}: done", flush=True)
    print(f"\n{args.ranks} ranks on loopback, sign upload + majority result, median of {args.rounds} rounds "
          f"(slowest rank)\n")
    print("| parameters | cluster (gloo) ms | butterfly (libp2p) ms | butterfly ÷ cluster | fp32 all-reduce (gloo) ms "
          "| bytes sent per rank: cluster / butterfly (payload) / fp32 all-reduce | same update bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['numel']:,} | {1e3 * r['cluster_s']:.1f} | {1e3 * r['butterfly_s']:.1f} | "
              f"{r['butterfly_s'] / r['cluster_s']:.1f}× | {1e3 * r['allreduce_s']:.1f} | "
              f"{r['cluster_bytes']:,} / {r['butterfly_bytes']:,} ({r['butterfly_payload']:,}) / "
              f"{int(r['allreduce_bytes']):,} | {'yes' if r['same_bytes'] else 'NO'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
        print(f"\nJSON: {args.json}")
    if not all(r["same_bytes"] for r in rows):
        raise SystemExit("the cluster path and the butterfly returned different bytes")


if __name__ == "__main__":
    main()
