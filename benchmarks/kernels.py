"""Kernel and optimizer-step benchmark: each op side by side with a copy of the same bytes.

Yardstick: ``dst.copy_(src)`` into a buffer allocated once, of as many bytes as the op reads (or
writes, when that is more). A fresh ``clone`` is the wrong yardstick: at 16M elements its time is
mostly page faults of new memory. Every op is timed alternately with its copy in the same run
(median of --repeats), so load on the machine hits both alike; "x copy" = op time / copy time
(lower is better; the goal for pack and apply is <= 1.5). The torch path is timed in a rotation of
its own, with the same copy.

Ops ("fused" = the one-pass kernel the optimizer uses: numba on CPU, Triton on CUDA, through
``ops.LionKernels``; "torch" = the per-tensor torch path, the reference and the fallback):

  lion pack     direction + pack + momentum update   reads grad, momentum (8 B/elem), writes 4 + 1/8
  apply packed  unpack + θ·(1−lr·λ) − lr·u           reads param + bits (4 + 1/8), writes 4
  apply float   the same with a float32 update       reads 8, writes 4
  pack_signs, unpack_signs, vote_counts, majority_vote: the single-tensor ops

"zeros" rows put exact zeros in 1% of gradient and momentum positions (the 5.45M-parameter model
has ~45k per step), which take the seeded random stream's bits.

The optimizer section times ``LionCub.compute_upload`` and ``apply_aggregate`` against the
per-tensor path they replaced (``optim.reference_upload`` / ``reference_apply``) for the
simulator's 5.45M-parameter digits MLP (64-2300-2300-10), 200 tensors of 1k elements and one of
200k.

On CUDA a last section times Triton's counting kernels on 32-bit words against its byte kernels
(``--counting``: the voters).

    python benchmarks/kernels.py [--device cuda] [--sizes 1M 16M] [--threads 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import numpy as np
import torch
from torch import nn

from lioncub_p2p import LionCub, ops
from lioncub_p2p.codecs import SignUpload
from lioncub_p2p.ops import torch_impl
from lioncub_p2p.optim import reference_apply, reference_upload


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _seconds(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def side_by_side(fns: list[Callable[[], object]], device: str, repeats: int) -> list[float]:
    """Median seconds of each function, timed in turn within every repetition."""
    for fn in fns:  # warm-up (JIT compilation, caches)
        fn()
    runs = [[_seconds(fn, device) for fn in fns] for _ in range(repeats)]
    return [statistics.median(run[i] for run in runs) for i in range(len(fns))]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _copy(nbytes: int, device: str) -> Callable[[], object]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def kernel_cases(numel: int, device: str, zeros: bool) -> list[tuple[str, int, Callable, Callable | None]]:
    """(op, bytes of the yardstick copy, fused op, torch-path op or None)."""
    gen = torch.Generator().manual_seed(numel)
    grad, mom = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    if zeros:
        where = torch.rand(numel, generator=gen) < 0.01
        grad[where], mom[where] = 0.0, 0.0
    grad, mom = grad.to(device), mom.to(device)
    mom_ref = mom.clone()
    param = torch.randn(numel, generator=gen).to(device)
    key = ops.zero_sign_key(1)
    kernels = ops.LionKernels([param], [mom], [0])
    packed = torch.empty((numel + 7) // 8, dtype=torch.uint8, device=device)
    keys = np.array([key], dtype=np.int64)
    kernels.direction_pack([grad], [(0.9, 0.99)], keys, packed)
    floats = (torch.rand(numel, generator=gen) * 2 - 1).to(device)
    suffix = " zeros" if zeros else ""
    cases = [
        ("lion pack" + suffix, 8 * numel, lambda: kernels.direction_pack([grad], [(0.9, 0.99)], keys, packed),
         lambda: torch_impl.lion_direction_pack(grad, mom_ref, 0.9, 0.99, key)),
        ("apply packed" + suffix, 4 * numel + numel // 8, lambda: kernels.apply(packed, [1e-6], [0.1]),
         lambda: torch_impl.apply_update(param, packed, 1e-6, 0.1)),
    ]
    if zeros:
        return cases
    x = grad
    stack16 = torch.randint(0, 256, (16, numel // 8), dtype=torch.uint8, device=device)
    cases += [
        ("apply float", 8 * numel, lambda: kernels.apply(floats, [1e-6], [0.1]),
         lambda: torch_impl.apply_update(param, floats, 1e-6, 0.1)),
        ("pack_signs", 4 * numel, lambda: ops.pack_signs(x), lambda: torch_impl.pack_signs(x, key)),
        ("unpack_signs", 4 * numel, lambda: ops.unpack_signs(packed, numel),
         lambda: torch_impl.unpack_signs(packed, numel, torch.float32)),
        ("vote_counts n=16", 2 * numel, lambda: ops.vote_counts(stack16), None),
        ("majority_vote n=16", 2 * numel, lambda: ops.majority_vote(stack16), None),
    ]
    return cases


def run_kernels(sizes: list[str], device: str, repeats: int) -> list[dict]:
    rows = []
    print(f"\n{'op':<22}{'elements':>9}{'fused ms':>10}{'torch ms':>10}{'copy ms':>9}{'copy GB/s':>10}"
          f"{'fused GB/s':>11}{'fused x copy':>13}{'torch x copy':>13}")
    for size in sizes:
        numel = parse_size(size)
        for zeros in (False, True):
            for name, nbytes, fused, reference in kernel_cases(numel, device, zeros):
                copy = _copy(nbytes, device)
                t_fused, t_copy = side_by_side([fused, copy], device, repeats)
                # the torch path in a rotation of its own: its host work idles the GPU, whose clocks
                # then drop, which slows whatever runs next
                t_ref = side_by_side([reference, copy], device, repeats)[0] if reference else float("nan")
                row = dict(op=name, numel=numel, device=device, fused_ms=t_fused * 1e3, torch_ms=t_ref * 1e3,
                           copy_ms=t_copy * 1e3, copy_bytes=nbytes, fused_x_copy=t_fused / t_copy,
                           torch_x_copy=t_ref / t_copy)
                rows.append(row)
                print(f"{name:<22}{size:>9}{t_fused * 1e3:>10.3f}{t_ref * 1e3:>10.3f}{t_copy * 1e3:>9.3f}"
                      f"{nbytes / t_copy / 1e9:>10.2f}{nbytes / t_fused / 1e9:>11.2f}{t_fused / t_copy:>13.2f}"
                      f"{t_ref / t_copy:>13.2f}")
    return rows


def run_counting(size: str, device: str, repeats: int, voters: list[int]) -> list[dict]:
    """Triton's counting kernels on 32-bit words (bit-sliced) against its byte kernels, which take rows
    that do not start on a word boundary (the same bytes one byte further into an allocation), and a
    copy of the stack. ``triton_impl`` directly: ``ops`` would first make a strided view contiguous."""
    from lioncub_p2p.ops import triton_impl

    numel, rows = parse_size(size), []
    print(f"\n{'op':<22}{'voters':>7}{'elements':>9}{'words ms':>10}{'bytes ms':>10}{'copy ms':>9}"
          f"{'words x copy':>13}{'bytes x copy':>13}")
    for n in voters:
        words = torch.randint(0, 256, (n, numel // 8), dtype=torch.uint8, device=device)
        off_word = torch.empty(n * numel // 8 + 1, dtype=torch.uint8, device=device)[1:].view(n, numel // 8)
        off_word.copy_(words)
        if triton_impl._word_rows(off_word) is not None or triton_impl._word_rows(words) is None:
            raise SystemExit("the layouts do not select the byte and the word kernels")
        copy = _copy(n * numel // 8, device)
        key = ops.tie_key(1, 2)
        for name, op in (("vote_counts", triton_impl.vote_counts),
                         ("majority_vote", lambda s: triton_impl.majority_vote(s, "random", key))):
            if not torch.equal(op(words), op(off_word)):  # the same bytes through the word and the byte kernels
                raise SystemExit(f"{name}: the word and byte kernels disagree")
            t_words, t_bytes, t_copy = side_by_side([lambda: op(words), lambda: op(off_word), copy], device, repeats)
            rows.append(dict(op=name, voters=n, numel=numel, words_ms=t_words * 1e3, bytes_ms=t_bytes * 1e3,
                             copy_ms=t_copy * 1e3, words_x_copy=t_words / t_copy, bytes_x_copy=t_bytes / t_copy))
            print(f"{name:<22}{n:>7}{size:>9}{t_words * 1e3:>10.3f}{t_bytes * 1e3:>10.3f}{t_copy * 1e3:>9.3f}"
                  f"{t_words / t_copy:>13.2f}{t_bytes / t_copy:>13.2f}")
    return rows


class _Echo:
    upload = SignUpload()


def _optimizer(shapes: list[tuple[int, ...]], device: str, zeros: bool) -> tuple[LionCub, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(shapes))
    params = [nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt = LionCub(params, lr=1e-6, weight_decay=0.1, aggregator=_Echo())
    if zeros:  # exact zeros where gradient and momentum are both zero
        for p, (_, m) in zip(params, opt.momentum_buffers()):
            where = (torch.rand(p.shape, generator=gen) < 0.01).to(device)
            p.grad[where], m[where] = 0.0, 0.0
    return opt, opt.compute_upload()[0]


MODELS = {
    "digits MLP 5.45M (6 tensors)": [(2300, 64), (2300,), (2300, 2300), (2300,), (10, 2300), (10,)],
    "200 tensors x 1k": [(1000,)] * 200,
    "1 tensor x 200k": [(200_000,)],
}


def run_optimizer(device: str, repeats: int) -> list[dict]:
    rows = []
    print(f"\n{'model':<30}{'zeros':>6}{'upload ms':>11}{'before ms':>11}{'apply ms':>10}{'before ms':>11}"
          f"{'upload+apply':>14}{'before':>9}")
    for name, shapes in MODELS.items():
        for zeros in (False, True):
            opt, update = _optimizer(shapes, device, zeros)
            upload, apply = side_by_side([opt.compute_upload, lambda: opt.apply_aggregate(update)], device, repeats)
            before = side_by_side([lambda: reference_upload(opt), lambda: reference_apply(opt, update)], device, repeats)
            t = [upload, before[0], apply, before[1]]
            row = dict(model=name, zeros=zeros, device=device, upload_ms=t[0] * 1e3, upload_before_ms=t[1] * 1e3,
                       apply_ms=t[2] * 1e3, apply_before_ms=t[3] * 1e3)
            rows.append(row)
            print(f"{name:<30}{'1%' if zeros else '-':>6}{t[0] * 1e3:>11.3f}{t[1] * 1e3:>11.3f}{t[2] * 1e3:>10.3f}"
                  f"{t[3] * 1e3:>11.3f}{(t[0] + t[2]) * 1e3:>14.3f}{(t[1] + t[3]) * 1e3:>9.3f}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="one-pass kernels and optimizer step vs a copy of the same bytes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the numba kernels use one)")
    parser.add_argument("--skip", choices=["kernels", "optimizer"], default=None)
    parser.add_argument("--counting", type=int, nargs="*", default=[4, 16, 64, 255],
                        help="voters for the Triton counting comparison (CUDA only; at the largest size)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    probe = ops.LionKernels([torch.zeros(8, device=args.device)], [torch.zeros(8, device=args.device)], [0])
    backend = type(probe.batches[0]).__name__.strip("_").removesuffix("Batch").lower() if probe.batches else "torch"
    print(f"device {args.device} (fused path: {backend}), torch {torch.__version__}, threads {args.threads}, "
          f"median of {args.repeats}")
    result = {}
    if args.skip != "kernels":
        result["kernels"] = run_kernels(args.sizes, args.device, args.repeats)
    if args.skip != "optimizer":
        result["optimizer"] = run_optimizer(args.device, args.repeats)
    if args.device.startswith("cuda") and args.counting:
        result["counting"] = run_counting(max(args.sizes, key=parse_size), args.device, args.repeats, args.counting)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
