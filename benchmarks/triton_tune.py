"""Sweep the Triton kernels' launch shapes (block, warps) on a GPU, checking the bytes at every shape.

Three families share a shape in ``ops/triton_impl.py``: pack (``PACK_BLOCK``/``PACK_WARPS``: lion pack
over all tensors, pack_signs), elementwise (``ELEM_*``: packed and float apply over all tensors,
unpack_signs) and counting (``COUNT_*``: majority vote of 16). For every shape each op first runs on
fresh inputs (a table of one tensor, as the optimizer's one launch) and must give the torch path's bytes (and momenta or parameters), then is timed side by
side with a device copy of the bytes it moves, as in ``benchmarks/kernels.py`` (median of --repeats).
A family's best shape has the smallest sum of "x copy" over its ops at the largest size. Prints the
table and the best shapes; ``--json`` writes the rows. On the CPU (``TRITON_INTERPRET=1``) it only
checks the bytes, at small sizes.

    python benchmarks/triton_tune.py [--sizes 16M 64M] [--repeats 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
from typing import Callable

import numpy as np
import torch

from kernels import _copy, parse_size, side_by_side
from lioncub_p2p import ops
from lioncub_p2p.ops import torch_impl, triton_impl
from lioncub_p2p.ops.multi_tensor import _TritonBatch

SHAPES = {
    "pack": list(itertools.product([256, 512, 1024], [2, 4, 8])),
    "elem": list(itertools.product([1024, 2048, 4096], [4, 8])),
    "count": list(itertools.product([256, 512, 1024, 2048], [4, 8])),
}
_ATTRS = {"pack": ("PACK_BLOCK", "PACK_WARPS"), "elem": ("ELEM_BLOCK", "ELEM_WARPS"),
          "count": ("COUNT_BLOCK", "COUNT_WARPS")}


def set_shape(family: str, block: int, warps: int) -> None:
    for attr, value in zip(_ATTRS[family], (block, warps)):
        setattr(triton_impl, attr, value)


def _equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: the Triton kernel's output differs from the torch path")


def family_ops(family: str, numel: int, device: str) -> list[tuple[str, int, Callable[[], object]]]:
    """(op, bytes of the yardstick copy, op) after checking each op's output once against torch_impl."""
    gen = torch.Generator().manual_seed(numel)
    grad, mom, param = (torch.randn(numel, generator=gen).to(device) for _ in range(3))
    grad[::97] = 0.0
    mom[::97] = 0.0  # exact zeros take the seeded stream's bits
    key = ops.zero_sign_key(1)
    if family == "count":
        stack = torch.randint(0, 256, (16, numel // 8), dtype=torch.uint8, generator=gen).to(device)
        tie = ops.tie_key(1, 2)
        _equal(triton_impl.majority_vote(stack, "random", tie), torch_impl.majority_vote(stack, "random", tie),
               "majority_vote")
        return [("majority_vote n=16", 2 * numel, lambda: triton_impl.majority_vote(stack, "random", tie))]
    m_ref = mom.clone()  # the torch path's momentum after the step
    ref_bits = torch_impl.lion_direction_pack(grad, m_ref, 0.9, 0.99, key)
    if family == "pack":
        m = mom.clone()
        batch = _TritonBatch([0], [param], [m], np.zeros(1, dtype=np.int64))
        packed = torch.empty_like(ref_bits)
        keys, coefs = np.array([key], dtype=np.int64), torch_impl.coefficients([0.9], [0.99])
        batch.direction_pack([grad], coefs, keys, packed)
        _equal(packed, ref_bits, "lion pack")
        _equal(m, m_ref, "lion pack momentum")
        _equal(triton_impl.pack_signs(grad, key), torch_impl.pack_signs(grad, key), "pack_signs")
        return [("lion pack", 8 * numel, lambda: batch.direction_pack([grad], coefs, keys, packed)),
                ("pack_signs", 4 * numel, lambda: triton_impl.pack_signs(grad, key))]
    p = param.clone()  # elementwise
    batch = _TritonBatch([0], [p], [mom.clone()], np.zeros(1, dtype=np.int64))
    floats = (torch.rand(numel, generator=gen) * 2 - 1).to(device)
    for update in (ref_bits, floats):
        p.copy_(param)
        p_ref = param.clone()
        batch.apply(update, torch_impl.apply_scalars([1e-3], [0.1]))
        torch_impl.apply_update(p_ref, update, 1e-3, 0.1)
        _equal(p, p_ref, f"apply {update.dtype}")
    scalars = torch_impl.apply_scalars([1e-6], [0.1])
    _equal(triton_impl.unpack_signs(ref_bits, numel, torch.float32),
           torch_impl.unpack_signs(ref_bits, numel, torch.float32), "unpack_signs")
    return [("apply packed", 4 * numel + numel // 8, lambda: batch.apply(ref_bits, scalars)),
            ("apply float", 8 * numel, lambda: batch.apply(floats, scalars)),
            ("unpack_signs", 4 * numel, lambda: triton_impl.unpack_signs(ref_bits, numel, torch.float32))]

def sweep(sizes: list[str], device: str, repeats: int) -> tuple[list[dict], dict[str, tuple[int, int]]]:
    rows, best = [], {}
    defaults = {family: tuple(getattr(triton_impl, a) for a in _ATTRS[family]) for family in SHAPES}
    print(f"{'family':<7}{'block':>6}{'warps':>6}  {'op':<20}{'elements':>9}{'ms':>9}{'copy ms':>9}{'x copy':>8}")
    for family, shapes in SHAPES.items():
        scores = {}
        for block, warps in shapes:
            set_shape(family, block, warps)
            for size in sizes:
                numel = parse_size(size)
                for op, nbytes, fn in family_ops(family, numel, device):
                    if device == "cpu":  # the interpreter: bytes checked, nothing worth timing
                        continue
                    t_op, t_copy = side_by_side([fn, _copy(nbytes, device)], device, repeats)
                    rows.append(dict(family=family, block=block, warps=warps, op=op, numel=numel, ms=t_op * 1e3,
                                     copy_ms=t_copy * 1e3, x_copy=t_op / t_copy))
                    print(f"{family:<7}{block:>6}{warps:>6}  {op:<20}{size:>9}{t_op * 1e3:>9.3f}{t_copy * 1e3:>9.3f}"
                          f"{t_op / t_copy:>8.2f}")
                    if size == sizes[-1]:
                        scores[(block, warps)] = scores.get((block, warps), 0.0) + t_op / t_copy
        best[family] = min(scores, key=scores.get) if scores else defaults[family]
        set_shape(family, *defaults[family])
    print("best (block, warps):", best, "| defaults:", defaults)
    return rows, best


def main(argv: list[str] | None = None) -> dict[str, tuple[int, int]]:
    parser = argparse.ArgumentParser(description="sweep the Triton kernels' launch shapes, checking bytes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=["16M", "64M"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows, best = sweep(args.sizes, args.device, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, best={k: list(v) for k, v in best.items()}), f, indent=2)
    return best


if __name__ == "__main__":
    main()
