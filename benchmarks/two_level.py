"""Two-level votes on real gradients: how often a majority of group majorities agrees with the flat
majority of all peers, and how close each is to the direction of the whole batch (issue 16 §1).

In process: one model trains with plain Lion (on a pooled batch of 8 peers' worth between
measurements; the momentum a swarm with synced momenta shares). At each ``--at`` step, every peer computes its own Lion direction
sign(β1·m + (1 − β1)·g_i) on its own batch; the directions are packed and voted: flat majority of all
peers, exact counts combined over groups (checked equal to the flat vote, bit for bit), and the
majority of group majorities for each ``--groups`` size. "agree" is the fraction of parameters where
the majority of majorities equals the flat majority; "true" the fraction where a vote equals the sign
of the pooled direction sign(β1·m + (1 − β1)·mean_i g_i). Bits: what the second level receives per
parameter from all groups together (counts: ⌈log2(g+1)⌉ per group of g; majorities: 1 per group).

    nice -n 19 env OMP_NUM_THREADS=1 python benchmarks/two_level.py [--tasks digits byte-gpt]
        [--seeds 0 1 2] [--peers 256] [--groups 8 16 32] [--at 0 100 300] [--json runs/two_level.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from lioncub_p2p import LionCub, ops
from lioncub_p2p.allreduce.hierarchy import combine_counts, group_counts, majority_of_majorities, upward_bits
from lioncub_p2p.tasks.byte_gpt import stdlib_bytes_task
from lioncub_p2p.tasks.digits import digits_task

TASKS = {  # name: (task factory, lr, batch per peer), as benchmarks/flip_rate.py
    "digits": (lambda: digits_task(0), 3e-4, 32),
    "byte-gpt": (lambda: stdlib_bytes_task(), 1e-3, 16),
}
BETA1 = 0.9


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _bits(packed: torch.Tensor, numel: int) -> np.ndarray:
    return np.unpackbits(packed.numpy(), bitorder="little")[:numel]


def run(task_name: str, seed: int, peers: int, groups: list[int], at: list[int]) -> list[dict]:
    make, lr, batch = TASKS[task_name]
    task = make()
    model = task.make_model(seed)
    opt = LionCub(model.named_parameters(), lr=lr, weight_decay=0.1, betas=(BETA1, 0.99))
    gens = [torch.Generator().manual_seed(seed * 100_000 + i) for i in range(peers)]
    train_gen = torch.Generator().manual_seed(seed)
    rows = []
    for step in range(max(at) + 1):
        if step not in at:  # between measurements: plain Lion on a pooled batch of 8 peers' worth
            model.zero_grad()
            x, y = task.sample(0, 1, 8 * batch, train_gen)
            task.loss(model, x, y).backward()
            opt.step()
            continue
        grads = []
        for i in range(peers):
            model.zero_grad()
            x, y = task.sample(i, peers, batch, gens[i])
            task.loss(model, x, y).backward()
            grads.append(_flat_grad(model).clone())
        momentum = torch.cat([m.reshape(-1) for _, m in opt.momentum_buffers()])
        directions = torch.stack([BETA1 * momentum + (1 - BETA1) * g for g in grads])
        stack = torch.stack([ops.pack_signs(d, seed=step) for d in directions])
        numel = momentum.numel()
        flat = ops.majority_vote(stack, seed=seed, step=step)
        pooled = _bits(ops.pack_signs(directions.mean(0), seed=step), numel)
        flat_bits = _bits(flat, numel)
        row = {"task": task_name, "seed": seed, "step": step, "peers": peers, "params": numel,
               "flat_true": float((flat_bits == pooled).mean()), "groups": {}}
        for g in groups:
            members = [list(range(k, min(k + g, peers))) for k in range(0, peers, g)]
            exact = combine_counts([group_counts(stack[m]) for m in members], [len(m) for m in members],
                                   seed=seed, step=step)
            assert torch.equal(exact, flat), "exact counts combined must be the flat majority"
            mom = majority_of_majorities(torch.stack([ops.majority_vote(stack[m], seed=seed, step=step)
                                                      for m in members]), seed=seed, step=step)
            mom_bits = _bits(mom, numel)
            sizes = [len(m) for m in members]
            row["groups"][g] = {"agree": float((mom_bits == flat_bits).mean()),
                                "true": float((mom_bits == pooled).mean()),
                                "bits_counts": upward_bits(sizes, "counts"),
                                "bits_majorities": upward_bits(sizes, "majority")}
        rows.append(row)
        model.zero_grad()
        for p, g in zip(model.parameters(), _split(torch.stack(grads).mean(0), model)):
            p.grad = g
        opt.step()
    return rows


def _split(flat: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in model.parameters():
        out.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


def report(rows: list[dict], groups: list[int]) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        lines.append(f"\n{task}: {mine[0]['params']:,} parameters, {mine[0]['peers']} peers, "
                     f"seeds {sorted({r['seed'] for r in mine})} (median over seeds)")
        lines.append("| step | flat = pooled | " + " | ".join(f"groups of {g}: MoM = flat / MoM = pooled / bits "
                                                                "counts, majorities" for g in groups) + " |")
        lines.append("|---|---|" + "---|" * len(groups))
        for step in sorted({r["step"] for r in mine}):
            at = [r for r in mine if r["step"] == step]
            med = lambda f: statistics.median(f(r) for r in at)  # noqa: E731
            cells = [f"{med(lambda r: r['groups'][g]['agree']):.1%} / {med(lambda r: r['groups'][g]['true']):.1%} / "
                     f"{at[0]['groups'][g]['bits_counts']:.0f}, {at[0]['groups'][g]['bits_majorities']:.0f}"
                     for g in groups]
            lines.append(f"| {step} | {med(lambda r: r['flat_true']):.1%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--peers", type=int, default=256)
    p.add_argument("--groups", nargs="+", type=int, default=[8, 16, 32])
    p.add_argument("--at", nargs="+", type=int, default=[0, 100, 300])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    started, rows = time.perf_counter(), []
    for task in args.tasks:
        for seed in args.seeds:
            rows += run(task, seed, args.peers, args.groups, args.at)
    print(report(rows, args.groups))
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
