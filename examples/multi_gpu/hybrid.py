"""A volunteer with several GPUs takes part in a swarm as ONE peer: its local ranks count their votes
exactly over torch.distributed, local rank 0 votes the sign of that count in the swarm and hands the
swarm's update to every local rank.

    python examples/multi_gpu/hybrid.py [--ranks 2] [--peers 2] [--steps 60]

Here, on one machine: ``--peers`` single-device volunteers (threads, real swarm peers on 127.0.0.1)
and one box of ``--ranks`` local ranks (gloo processes; on a GPU box, one NCCL process per GPU)
whose rank 0 is the box's swarm peer. Everyone ends with bitwise identical parameters.

What a box runs, per local rank (launched by torchrun on a real box)::

    dist.init_process_group("nccl")
    swarm = Swarm(SwarmConfig(run_id, initial_peers=...)) if local_rank == 0 else None
    aggregator = HybridAggregator(None, swarm, momentum=MomentumSchedule(every=20))  # the run's schedule
    opt = LionCub(model.named_parameters(), lr=..., aggregator=aggregator)
    aggregator.join(opt)         # rank 0 joins the run (and may download its state); all ranks take it
    ... opt.step() as usual ...
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from local_swarm import LOCAL, LOOPBACK  # noqa: E402

from lioncub_p2p import LionCub, MomentumSchedule  # noqa: E402
from lioncub_p2p.cluster import HybridAggregator  # noqa: E402
from lioncub_p2p.tasks.digits import digits_task  # noqa: E402
from lioncub_p2p.swarm import Swarm, SwarmConfig, snapshot  # noqa: E402

RUN = "multi-gpu-example"
SCHEDULE = MomentumSchedule(every=20)  # the swarm's default: the box averages on the run's steps


def train(task, opt, model, steps: int, shard: int, shards: int) -> None:
    gen = torch.Generator().manual_seed(shard)
    while opt.step_count < steps:
        x, y = task.sample(shard, shards, 32, gen)
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()


def box_rank(rank: int, ranks: int, workdir: str, maddrs: list[str], steps: int, shards: int) -> None:
    """One local rank of the multi-GPU volunteer (data shard ``shards - 1``: the box's own data,
    split again between its ranks)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=ranks)
    swarm = Swarm(SwarmConfig(RUN, initial_peers=maddrs, host_maddrs=LOCAL, allreduce=LOOPBACK)) if rank == 0 else None
    try:
        task = digits_task()
        model = task.make_model(0)
        aggregator = HybridAggregator(None, swarm, momentum=SCHEDULE)
        opt = LionCub(model.named_parameters(), lr=1e-3, weight_decay=0.1, aggregator=aggregator)
        aggregator.join(opt, wait_peers=shards)  # rank 0 waits with the volunteers; all ranks take its state
        Path(workdir, f"joined{rank}").touch()
        train(task, opt, model, steps, shard=(shards - 1) * ranks + rank, shards=shards * ranks)
        Path(workdir, f"box{rank}.digest").write_bytes(snapshot.params_digest(opt))
        if swarm is not None:
            print(f"box: its last round had a group of {swarm.stats.group_size} swarm peers; "
                  f"{swarm.missed_rounds} rounds missed, {swarm.repairs} repairs", flush=True)
        dist.barrier()  # every local rank is done before the box leaves the swarm
    finally:
        if swarm is not None:
            swarm.shutdown()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (GPUs) of the box")
    parser.add_argument("--peers", type=int, default=2, help="single-device volunteers besides the box")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.peers < 1:
        parser.error("--ranks and --peers must be at least 1")
    task = digits_task()
    shards = args.peers + 1
    first = Swarm(SwarmConfig(RUN, host_maddrs=LOCAL, allreduce=LOOPBACK))
    maddrs = [str(m) for m in first.dht.get_visible_maddrs()]
    swarms = [first] + [Swarm(SwarmConfig(RUN, initial_peers=maddrs, host_maddrs=LOCAL, allreduce=LOOPBACK))
                        for _ in range(args.peers - 1)]
    with tempfile.TemporaryDirectory(prefix="lioncub-hybrid-") as workdir:
        box = mp.start_processes(box_rank, args=(args.ranks, workdir, maddrs, args.steps, shards), nprocs=args.ranks,
                                 join=False, start_method="spawn")
        results: list = [None] * args.peers
        errors: list[BaseException] = []

        def volunteer(i: int) -> None:
            try:
                model = task.make_model(0)
                opt = LionCub(model.named_parameters(), lr=1e-3, weight_decay=0.1, aggregator=swarms[i])
                swarms[i].join(opt, wait_peers=args.peers + 1)  # start together: these and the box's rank 0
                deadline = time.monotonic() + 300
                while not all(Path(workdir, f"joined{r}").exists() for r in range(args.ranks)):  # start together
                    if time.monotonic() > deadline or not all(p.is_alive() or p.exitcode == 0 for p in box.processes):
                        raise RuntimeError("the multi-GPU box did not join")
                    time.sleep(0.2)
                train(task, opt, model, args.steps, i, shards)
                results[i] = (task.evaluate(model)[1], snapshot.params_digest(opt))
            except BaseException as e:  # re-raised below
                errors.append(e)

        threads = [threading.Thread(target=volunteer, args=(i,)) for i in range(args.peers)]
        try:
            for t in threads:
                t.start()
                time.sleep(0.2)
            for t in threads:
                t.join()
            # join() returns once any rank ends (False while others run): killing rank 0 below while it
            # still leaves the swarm orphaned its DHT process, which held the output open (a CI hang)
            deadline = time.monotonic() + 120
            while not box.join(timeout=5) and time.monotonic() < deadline:
                pass
        finally:
            for p in box.processes:
                if p.is_alive():
                    p.kill()
            for s in swarms:
                s.shutdown()
        if errors:
            raise errors[0]
        box_digests = [Path(workdir, f"box{r}.digest").read_bytes() for r in range(args.ranks)]
    digests = {d for _, d in results} | set(box_digests)
    identical = len(digests) == 1
    print(f"{args.peers} volunteers + one box of {args.ranks} local ranks (one swarm peer), {args.steps} steps: "
          f"test accuracy {results[0][0]:.1f}%, parameters identical: {identical}")
    return {"accuracy": results[0][0], "identical": identical}


if __name__ == "__main__":
    main()
