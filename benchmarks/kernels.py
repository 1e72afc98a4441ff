"""Kernel benchmark: throughput of each op and its ratio to ``torch.clone`` of the same bytes.

Each op is timed side by side with a clone of its reference buffer in the same run (median of
--repeats): ratio = clone time / op time, so > 1 means the op processes its buffer faster than
memory can copy it. Reference buffers:

  pack_signs          the float32 input            (reads 4 B/elem, writes 1/8)
  unpack_signs        the float32 output           (reads 1/8 B/elem, writes 4)
  vote_counts n=k     the (k, numel/8) uint8 stack (reads k/8 B/elem, writes 1)
  majority_vote n=k   the stack
  lion_direction_pack grad and momentum, float32   (reads 8 B/elem, writes 4 + 1/8)
  apply_update        the float32 parameter         (reads 4 + 1/8 B/elem, writes 4)

    python benchmarks/kernels.py [--device cuda] [--sizes 1M 16M] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from lioncub_p2p import ops


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _seconds(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def side_by_side(op: Callable[[], object], reference: Callable[[], object], device: str,
                 repeats: int) -> tuple[float, float]:
    """Median seconds of ``op`` and ``reference``, timed alternately so drift hits both alike."""
    op(), reference()  # warm-up (and Triton compilation)
    pairs = [(_seconds(op, device), _seconds(reference, device)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def cases(numel: int, device: str) -> list[tuple[str, torch.Tensor, Callable[[], object]]]:
    x = torch.randn(numel, device=device)
    packed = ops.pack_signs(x)
    grad, mom, param = torch.randn(numel, device=device), torch.randn(numel, device=device), x.clone()
    out = [
        ("pack_signs", x, lambda: ops.pack_signs(x)),
        ("unpack_signs", torch.empty(numel, device=device), lambda: ops.unpack_signs(packed, numel)),
    ]
    for n in (4, 16, 64):
        stack = torch.randint(0, 256, (n, numel // 8), dtype=torch.uint8, device=device)
        out.append((f"vote_counts n={n}", stack, lambda s=stack: ops.vote_counts(s)))
    stack16 = torch.randint(0, 256, (16, numel // 8), dtype=torch.uint8, device=device)
    out.append(("majority_vote n=16", stack16, lambda: ops.majority_vote(stack16)))
    out.append(("lion_direction_pack", torch.cat([grad, mom]), lambda: ops.lion_direction_pack(grad, mom, 0.9, 0.99)))
    out.append(("apply_update", param, lambda: ops.apply_update(param, packed, 1e-6, 0.0)))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="packed-sign kernel throughput vs torch.clone")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(f"device {args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats}")
    print(f"{'op':<22}{'elements':>10}{'ms':>10}{'elem/s':>12}{'clone ms':>10}{'x clone':>9}")
    for size in args.sizes:
        numel = parse_size(size)
        for name, reference, fn in cases(numel, args.device):
            t_op, t_clone = side_by_side(fn, lambda r=reference: r.clone(), args.device, args.repeats)
            row = dict(op=name, numel=numel, device=args.device, ms=t_op * 1e3, elements_per_s=numel / t_op,
                       reference_bytes=reference.numel() * reference.element_size(), clone_ms=t_clone * 1e3,
                       ratio_to_clone=t_clone / t_op)
            rows.append(row)
            print(f"{name:<22}{size:>10}{row['ms']:>10.2f}{row['elements_per_s']:>12.3g}"
                  f"{row['clone_ms']:>10.2f}{row['ratio_to_clone']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
