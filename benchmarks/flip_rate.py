"""How often the voted sign flips from one step to the next, and the result leg's bits per parameter
when each part's result is sent as a delta against the previous step's (``codecs_delta``).

In process: ``--workers`` replicas train with LionCub (1-bit sign upload, majority result, the vote
path of ``sim/inprocess.py``: one tally of all uploads, every replica applies the same update) on
each task and seed. Every step's packed result is compared with the previous one: the flip rate is
the fraction of parameters whose voted sign changed. Each part of the butterfly (``--workers``
equal parts, ``partition.part_bounds``) is encoded as a reducer would send it: plain (1 bit per
position), the Golomb-Rice and zlib deltas against the previous result, the context delta (also
against the result before it), and the smallest of them (what ``encode_delta`` sends); bits per
parameter count every byte of every part (tags and headers included) over the model's parameters. "entropy" is the bound for a coder of independent flips at the measured rate;
"H(flip given last flip)" the bound for one that also conditions on whether the parameter flipped
one step earlier (the receiver knows: it holds the last two results).

    nice -n 19 env OMP_NUM_THREADS=1 python benchmarks/flip_rate.py [--tasks digits byte-gpt]
        [--seeds 0 1 2] [--steps 300] [--workers 4] [--json runs/flip_rate.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from lioncub_p2p.allreduce.partition import PeerSpec, part_bounds
from lioncub_p2p.codecs import reduce_votes, result_codec, upload_codec
from lioncub_p2p.codecs_delta import decode_delta, encode_candidates, encoded_kind
from lioncub_p2p.momentum import MomentumSchedule, average_in_process
from lioncub_p2p.optim import LionCub
from lioncub_p2p.tasks.byte_gpt import stdlib_bytes_task
from lioncub_p2p.tasks.digits import digits_task

WINDOWS = [(1, 10), (10, 50), (50, 100), (100, 200), (200, 300), (300, 10**9)]
TASKS = {  # name: (task factory, lr, batch per worker): the settings lioncub-compare and the examples use
    "digits": (lambda: digits_task(0), 3e-4, 32),
    "byte-gpt": (lambda: stdlib_bytes_task(), 1e-3, 16),
}


def entropy(p: float) -> float:
    return 0.0 if p <= 0.0 or p >= 1.0 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def param_mask(opt: LionCub) -> np.ndarray:
    """True at the bit positions of the flat buffer that hold a parameter (not byte padding)."""
    mask = np.zeros(8 * opt.buffer_bytes, dtype=bool)
    for slot in opt.slots:
        mask[8 * slot.offset : 8 * slot.offset + slot.param.numel()] = True
    return mask


def run(task_name: str, seed: int, steps: int, workers: int, sync_every: int) -> dict:
    make, lr, batch = TASKS[task_name]
    task = make()
    up, res = upload_codec("sign"), result_codec("majority")
    base = task.make_model(seed)
    models = [copy.deepcopy(base) for _ in range(workers)]
    opts = [LionCub(m.named_parameters(), lr=lr, weight_decay=0.1, upload=up, seed=seed) for m in models]
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(workers)]
    schedule = MomentumSchedule(every=sync_every) if sync_every else MomentumSchedule.never()
    nbytes = opts[0].buffer_bytes
    mask = param_mask(opts[0])
    numel = int(mask.sum())
    bounds = [b for b in part_bounds(nbytes, [PeerSpec(str(i)) for i in range(workers)]) if b[1] > b[0]]
    previous = before = flipped_before = None
    rows, encode_s, decode_s = [], 0.0, 0.0
    for step in range(steps):
        uploads = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = task.sample(i, workers, batch, gens[i])
            opt.zero_grad()
            task.loss(model, x, y).backward()
            uploads.append(opt.compute_upload())
        result = reduce_votes(uploads, up, res, numel=8 * nbytes, seed=seed, step=step)
        for opt in opts:
            opt.apply_aggregate(result)
        if schedule.due(step + 1):
            average_in_process([opt.momentum_buffers() for opt in opts], schedule)
        current = result.numpy()
        kind_counts: dict[str, int] = {}
        sizes = {"plain": 0, "rice": 0, "zlib": 0, "context": 0, "chosen": 0}
        for a, b in bounds:
            prev_part = None if previous is None else previous[a:b]
            before_part = None if before is None else before[a:b]
            started = time.perf_counter()
            candidates = encode_candidates(current[a:b], prev_part, before_part)
            chosen = min(candidates.values(), key=len)
            encode_s += time.perf_counter() - started
            started = time.perf_counter()
            assert decode_delta(chosen, prev_part, b - a, before_part).numpy().tobytes() == current[a:b].tobytes()
            decode_s += time.perf_counter() - started
            for name in ("plain", "rice", "zlib", "context"):
                sizes[name] += len(candidates.get(name, chosen))  # not available yet: what was sent
            sizes["chosen"] += len(chosen)
            kind_counts[encoded_kind(chosen)] = kind_counts.get(encoded_kind(chosen), 0) + 1
        flips = conditional = None
        if previous is not None:
            changed = np.unpackbits(current ^ previous, bitorder="little").astype(bool)[mask]
            flips = float(changed.mean())
            if flipped_before is not None:  # H(flip | flipped one step earlier): what a context coder could reach
                again, fresh = changed[flipped_before], changed[~flipped_before]
                share = float(flipped_before.mean())
                conditional = share * entropy(float(again.mean()) if again.size else 0.0) + \
                    (1 - share) * entropy(float(fresh.mean()) if fresh.size else 0.0)
            flipped_before = changed
        rows.append({"step": step, "flip_rate": flips, "conditional_entropy": conditional,
                     "kind": max(kind_counts, key=kind_counts.get),
                     **{f"{k}_bytes": v for k, v in sizes.items()}})
        previous, before = current.copy(), previous
    loss = task.evaluate(models[0])
    return {"task": task_name, "seed": seed, "workers": workers, "steps": steps, "params": numel, "nbytes": nbytes,
            "parts": len(bounds), "sync_every": sync_every, "rows": rows, "test": list(loss),
            "encode_ms_per_step": 1e3 * encode_s / steps, "decode_ms_per_step": 1e3 * decode_s / steps}


def summarize(runs: list[dict]) -> str:
    lines = []
    for task_name in dict.fromkeys(r["task"] for r in runs):
        mine = [r for r in runs if r["task"] == task_name]
        numel, steps = mine[0]["params"], mine[0]["steps"]
        lines.append(f"\n{task_name}: {numel:,} parameters, {mine[0]['workers']} workers, {mine[0]['parts']} parts, "
                     f"{steps} steps, seeds {[r['seed'] for r in mine]}, momentum sync every "
                     f"{mine[0]['sync_every'] or 'never'}; test loss {[round(r['test'][0], 3) for r in mine]}")
        lines.append("| steps | flip rate % (mean, min–max over seeds) | entropy | H(flip given last flip) | plain | "
                     "rice | zlib | context | sent (smallest) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for lo, hi in WINDOWS + [(1, 10**9)]:
            per_seed = []
            for r in mine:
                window = [row for row in r["rows"] if lo <= row["step"] < hi and row["flip_rate"] is not None]
                if not window:
                    continue
                bits = {k: 8 * statistics.mean(row[f"{k}_bytes"] for row in window) / numel
                        for k in ("plain", "rice", "zlib", "context", "chosen")}
                rate = statistics.mean(row["flip_rate"] for row in window)
                h = statistics.mean(entropy(row["flip_rate"]) for row in window)
                ctx = [row["conditional_entropy"] for row in window if row["conditional_entropy"] is not None]
                per_seed.append((rate, h, bits, statistics.mean(ctx) if ctx else float("nan")))
            if not per_seed:
                continue
            rates = [s[0] for s in per_seed]
            mean = lambda key: statistics.mean(s[2][key] for s in per_seed)  # noqa: E731
            h = statistics.mean(s[1] for s in per_seed)
            hc = statistics.mean(s[3] for s in per_seed)
            label = "all (from 1)" if hi == 10**9 and lo == 1 else f"{lo}–{min(hi, steps) - 1}"
            lines.append(f"| {label} | {100 * statistics.mean(rates):.2f} ({100 * min(rates):.2f}–{100 * max(rates):.2f})"
                         f" | {h:.3f} | {hc:.3f} | {mean('plain'):.3f} | {mean('rice'):.3f} | {mean('zlib'):.3f} | "
                         f"{mean('context'):.3f} | **{mean('chosen'):.3f}** |")
        every = [8 * statistics.mean(row["chosen_bytes"] for row in r["rows"]) / numel for r in mine]
        kinds = {}
        for r in mine:
            for row in r["rows"]:
                kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
        plain = [8 * statistics.mean(row["plain_bytes"] for row in r["rows"]) / numel for r in mine]
        lines.append(f"result leg over all {steps} steps (step 0 plain): {statistics.mean(plain):.3f} → "
                     f"{statistics.mean(every):.3f} bits/param ({statistics.mean(plain) / statistics.mean(every):.2f}× "
                     f"fewer); encode {statistics.mean(r['encode_ms_per_step'] for r in mine):.2f} ms, decode "
                     f"{statistics.mean(r['decode_ms_per_step'] for r in mine):.2f} ms per step (all parts, 1 thread); "
                     f"steps by the encoding most parts sent: {kinds}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=0, help="momentum averaging period (0: never)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.workers < 1:
        parser.error("need --steps >= 2 and --workers >= 1")
    torch.set_num_threads(1)
    runs = []
    for task_name in args.tasks:
        for seed in args.seeds:
            started = time.perf_counter()
            runs.append(run(task_name, seed, args.steps, args.workers, args.sync_every))
            print(f"  {task_name} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    print(summarize(runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}))
        print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
