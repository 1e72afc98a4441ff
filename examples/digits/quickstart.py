"""Quickstart on scikit-learn's digits (real 8x8 scans, shipped offline): alone, then as a swarm.

    python examples/digits/quickstart.py [--steps 100] [--peers 3]

Alone, LionCub is plain Lion. In the swarm, each of --peers volunteers (threads on 127.0.0.1 here,
separate machines in real life) trains on its own shard and votes with 1-bit signs every step;
they end with bitwise identical parameters.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from local_swarm import run_local_swarm  # noqa: E402

from lioncub_p2p import LionCub  # noqa: E402
from lioncub_p2p.tasks.digits import digits_task  # noqa: E402
from lioncub_p2p.swarm import snapshot  # noqa: E402


def train(task, optimizer, model, steps: int, shard: int, shards: int) -> None:
    gen = torch.Generator().manual_seed(shard)
    while optimizer.step_count < steps:
        x, y = task.sample(shard, shards, 32, gen)
        task.loss(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--peers", type=int, default=3)
    args = parser.parse_args(argv)
    task = digits_task()

    model = task.make_model(0)
    alone = LionCub(model.parameters(), lr=1e-3, weight_decay=0.1)
    train(task, alone, model, args.steps, 0, 1)
    print(f"alone:  test accuracy {task.evaluate(model)[1]:.1f}% after {args.steps} steps")

    def volunteer(i, swarm):
        model = task.make_model(0)
        opt = LionCub(model.parameters(), lr=1e-3, weight_decay=0.1, aggregator=swarm)  # the one changed line
        swarm.join(opt)
        train(task, opt, model, args.steps, i, args.peers)
        return task.evaluate(model)[1], snapshot.params_digest(opt)

    results = run_local_swarm(args.peers, volunteer, run_id="digits-quickstart")
    identical = len({digest for _, digest in results}) == 1
    print(f"swarm:  test accuracy {results[0][0]:.1f}% after {args.steps} steps, {args.peers} peers, "
          f"parameters identical: {identical}")
    return {"alone": task.evaluate(model)[1], "swarm": results[0][0], "identical": identical}


if __name__ == "__main__":
    main()
