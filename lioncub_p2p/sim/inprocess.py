"""In-process comparison of vote encodings against global Lion (no network).

n simulated workers each hold a replica of the model, a shard of the data and their own momentum.
Every step each worker packs its direction with the real upload codec, one reducer tallies all
uploads with the real codecs, and every worker applies the decoded result; momenta are averaged
exactly on a ``MomentumSchedule``. Global Lion is data-parallel Lion: gradients averaged over the
workers (the batch of all shards) and one shared momentum.

Bits per element per step count what one peer sends plus receives, before the butterfly's
(n−1)/n factor: global Lion 32 up + 32 down (fp32); a vote = upload bits + result bits; a momentum
sync adds 16 + 16 (bf16 all-reduce) on the steps it runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..codecs import pack_planes, reduce_votes, result_codec, unpack_planes, upload_codec, wire_bits_per_element
from ..momentum import MomentumSchedule, average_in_process
from ..optim import LionCub
from .tasks import Task, digits_task

MOMENTUM_SYNC_BITS = 32.0  # bf16 all-reduce: 16 bits up + 16 down per element


@dataclass(frozen=True)
class Method:
    name: str
    upload: str | None = None  # None: global Lion (averaged gradients)
    result: str = "majority"
    momentum: MomentumSchedule = field(default_factory=MomentumSchedule.never)


def default_methods(sync_every: int = 10) -> list[Method]:
    sync = MomentumSchedule(every=sync_every)
    methods = [Method("global Lion (fp32 grads)")]
    for label, upload, result in (("1-bit majority", "sign", "majority"), ("1-bit mean vote", "sign", "mean"),
                                  ("L1 4-bit majority", "l1:4", "majority")):
        methods.append(Method(label, upload, result))
        methods.append(Method(f"{label} + momentum avg/{sync_every}", upload, result, sync))
    return methods


@dataclass
class Outcome:
    method: str
    steps: int
    workers: int
    test_accuracy: float
    test_loss: float
    bits_per_element_per_step: float
    replicas_identical: bool
    seconds: float
    curve: list = field(default_factory=list)  # (step, mean training loss over workers)
    train_loss: float = float("nan")  # final model on the whole training set (no sampling noise)


BYZANTINE = ("random", "invert", "ones")


def corrupt(upload: torch.Tensor, codec, behavior: str, gen: torch.Generator) -> torch.Tensor:
    """What a bad voter sends instead of its honest codes (planes, nbytes)."""
    if behavior == "random":
        return torch.randint(0, 256, upload.shape, dtype=torch.uint8, generator=gen)
    if behavior == "ones":
        return torch.full_like(upload, 255)
    if behavior == "invert":
        if codec.planes == 1:
            return ~upload
        codes = unpack_planes(upload, upload.shape[1] * 8).to(torch.int32).clamp(max=codec.max_code)
        return pack_planes(codec.max_code - codes, codec.planes)
    raise ValueError(f"unknown bad-voter behavior {behavior!r}; use one of {BYZANTINE}")


def run_method(method: Method, task: Task, *, workers: int = 4, steps: int = 300, batch: int = 32,
               lr: float = 3e-4, weight_decay: float = 0.1, seed: int = 0,
               byzantine: dict[int, str] | None = None) -> Outcome:
    """Train with ``workers`` simulated peers; ``byzantine[i]`` makes worker i send corrupt votes
    ("random" bits, "invert"ed votes, all "ones") while training honestly on its shard."""
    start = time.perf_counter()
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(workers)]
    base = task.make_model(seed)
    curve: list[tuple[int, float]] = []
    if method.upload is None:
        opt = LionCub(base.named_parameters(), lr=lr, weight_decay=weight_decay)
        for step in range(steps):
            batches = [task.sample(i, workers, batch, g) for i, g in enumerate(gens)]
            xb, yb = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            opt.zero_grad()
            loss = task.loss(base, xb, yb)  # equal shard batches: the mean of the workers' gradients
            loss.backward()
            opt.step()
            curve.append((step, loss.item()))
        loss, acc = task.evaluate(base)
        return Outcome(method.name, steps, workers, acc, loss, 64.0, True, time.perf_counter() - start, curve,
                       _train_loss(task, base))

    up, res = upload_codec(method.upload), result_codec(method.result)
    replicas = [copy.deepcopy(base) for _ in range(workers)]
    opts = [LionCub(m.named_parameters(), lr=lr, weight_decay=weight_decay, upload=up, seed=seed) for m in replicas]
    nbytes, syncs = opts[0].buffer_bytes, 0
    for step in range(steps):
        uploads, losses = [], []
        for i, (model, opt, g) in enumerate(zip(replicas, opts, gens)):
            xb, yb = task.sample(i, workers, batch, g)
            opt.zero_grad()
            loss = task.loss(model, xb, yb)
            loss.backward()
            losses.append(loss.item())
            uploads.append(opt.compute_upload())
        curve.append((step, sum(losses) / len(losses)))
        for i, behavior in (byzantine or {}).items():
            uploads[i] = corrupt(uploads[i], up, behavior, gens[i])
        wire = reduce_votes(uploads, up, res, numel=nbytes * 8, seed=seed, step=step)
        update = res.decode(wire, nbytes * 8, workers * up.max_code)
        for opt in opts:
            opt.apply_aggregate(update)
        if method.momentum.due(step + 1):
            average_in_process([opt.momentum_buffers() for opt in opts], method.momentum)
            syncs += 1
    identical = all(torch.equal(a, b) for m in replicas[1:] for a, b in zip(replicas[0].parameters(), m.parameters()))
    loss, acc = task.evaluate(replicas[0])
    bits = wire_bits_per_element(up, res, workers) + MOMENTUM_SYNC_BITS * syncs / steps
    return Outcome(method.name, steps, workers, acc, loss, bits, identical, time.perf_counter() - start, curve,
                   _train_loss(task, replicas[0]))


@torch.no_grad()
def _train_loss(task: Task, model: nn.Module) -> float:
    """Loss on the whole training set, for tasks that hold one in memory (NaN for the byte LM)."""
    if not hasattr(task, "x_train"):
        return float("nan")
    return task.loss(model, task.x_train, task.y_train).item()


def format_table(outcomes: list[Outcome]) -> str:
    rows = ["| method | test acc % | test loss | bits/elem/step | replicas equal | seconds |",
            "|---|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(f"| {o.method} | {o.test_accuracy:.1f} | {o.test_loss:.3f} | {o.bits_per_element_per_step:.2f} "
                    f"| {'yes' if o.replicas_identical else 'NO'} | {o.seconds:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="examples per worker per step")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--sync-every", type=int, default=10, help="momentum averaging period of the '+ momentum' runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/inprocess.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    task = digits_task(args.seed)
    outcomes = []
    for method in default_methods(args.sync_every):
        outcomes.append(run_method(method, task, workers=args.workers, steps=args.steps, batch=args.batch,
                                   lr=args.lr, weight_decay=args.weight_decay, seed=args.seed))
        print(f"  {method.name}: {outcomes[-1].test_accuracy:.1f}% in {outcomes[-1].seconds:.1f}s", flush=True)
    print(f"\ndigits, {args.workers} workers, {args.steps} steps, batch {args.batch}/worker\n")
    print(format_table(outcomes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                    "results": [asdict(o) for o in outcomes]}, indent=2))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
