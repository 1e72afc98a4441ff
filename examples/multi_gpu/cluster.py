"""LionCub on one machine's GPUs, or a cluster, over torch.distributed: the swarm's 1-bit vote and
codecs, NCCL or gloo as the transport. Every rank ends with bitwise identical parameters.

    torchrun --nproc-per-node 4 examples/multi_gpu/cluster.py     # one process per GPU (NCCL)
    python examples/multi_gpu/cluster.py [--ranks 3] [--steps 100] # CPU: gloo ranks spawned here

The one changed line against single-process training is the aggregator:
``LionCub(..., aggregator=ClusterAggregator(upload="sign", result="majority", momentum=...))``.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lioncub_p2p import LionCub, MomentumSchedule
from lioncub_p2p.cluster import ClusterAggregator
from lioncub_p2p.tasks.digits import digits_task
from lioncub_p2p.swarm import snapshot


def train(rank: int, world: int, steps: int, device: torch.device) -> None:
    task = digits_task()
    model = task.make_model(0).to(device)  # same seed on every rank: equal replicas
    aggregator = ClusterAggregator(upload="sign", result="majority", momentum=MomentumSchedule(every=20))
    opt = LionCub(model.named_parameters(), lr=1e-3, weight_decay=0.1, aggregator=aggregator)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = task.sample(rank, world, 32, gen)  # each rank its own shard
        opt.zero_grad()
        task.loss(model, x.to(device), y.to(device)).backward()
        opt.step()
    digest = torch.frombuffer(bytearray(snapshot.params_digest(opt)), dtype=torch.uint8).to(device)
    digests = [torch.empty_like(digest) for _ in range(world)]
    dist.all_gather(digests, digest)
    identical = all(torch.equal(d, digests[0]) for d in digests)
    if rank == 0:
        accuracy = task.evaluate(model.cpu())[1]
        print(f"{world} ranks ({dist.get_backend()}), {steps} steps: test accuracy {accuracy:.1f}%, "
              f"{8 * aggregator.stats.vote_bytes / sum(p.numel() for p in model.parameters()):.2f} bits per "
              f"parameter sent per step, parameters identical: {identical}")
    dist.barrier()  # nobody tears the group down while rank 0 still evaluates (gloo aborts a rank that does)


def spawned(rank: int, world: int, store: str, steps: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks on this machine talk over loopback
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        train(rank, world, steps, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3, help="ranks to spawn when not started by torchrun")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun: one process per GPU (or CPU ranks with gloo)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            train(dist.get_rank(), dist.get_world_size(), args.steps, device)
        finally:
            dist.destroy_process_group()
        return
    if args.ranks < 1:
        parser.error("--ranks must be at least 1")
    with tempfile.TemporaryDirectory(prefix="lioncub-cluster-") as workdir:
        mp.start_processes(spawned, args=(args.ranks, os.path.join(workdir, "store"), args.steps), nprocs=args.ranks,
                           start_method="spawn")


if __name__ == "__main__":
    main()
