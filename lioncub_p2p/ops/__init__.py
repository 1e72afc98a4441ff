"""Packed-sign kernels: Lion's direction to packed bits, votes counted on packed words, updates applied.

Bit layout everywhere: element k of a flattened tensor is bit ``k % 8`` (LSB first) of byte ``k // 8``,
as ``numpy.packbits(..., bitorder="little")``; padding bits of the last byte are 0.

CUDA tensors run Triton kernels when ``triton`` imports, CPU tensors numba kernels when ``numba``
imports, everything else the vectorized torch path (``dispatch``). All produce the same bytes: the
torch path is the reference, and tests compare the others with it (Triton under ``TRITON_INTERPRET=1``).
``LionKernels`` runs Lion's direction+pack and unpack+apply over all of a model's parameters at once.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .bitslice import count_planes, planes_needed, planes_to_counts
from .dispatch import impl_for as _impl, numba_impl as _numba_impl
from .multi_tensor import LionKernels
from .randbits import derive_key, derive_keys_numpy, random_bits_packed

__all__ = [
    "pack_signs", "unpack_signs", "vote_counts", "majority_vote", "lion_direction_pack", "apply_update",
    "count_planes", "planes_to_counts", "planes_needed", "packed_size", "zero_sign_key", "tie_key",
    "FLOAT_DTYPES", "MAX_VOTERS", "random_tie_bits", "zero_sign_keys", "step_zero_keys", "LionKernels",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_VOTERS = 32767  # counts must fit int16
TIE_RULES = ("random", "zero")


def packed_size(numel: int) -> int:
    """Bytes holding ``numel`` bits."""
    return (numel + 7) // 8


def zero_sign_key(seed: int) -> int:
    """Key of the bit stream that replaces exact zeros in ``pack_signs``."""
    return derive_key(1, seed)


def zero_sign_keys(parts: tuple[int, ...], count: int) -> np.ndarray:
    """int64 ``[zero_sign_key(derive_key(*parts, i)) for i in range(count)]``: the zero-sign keys of
    ``count`` tensors packed with seeds ``derive_key(*parts, i)``, in one call instead of ~10 µs each."""
    impl = _numba_impl()
    if impl is not None:
        return impl.derive_keys(tuple(parts), count, outer=(1,))
    return derive_keys_numpy(tuple(parts), count, outer=(1,)).astype(np.int64)


def step_zero_keys(seed: int, step: int, count: int) -> np.ndarray:
    """The zero-sign keys of ``count`` tensors at an optimizer step: steps 2k and 2k + 1 share one
    stream per tensor and the odd step's bits are inverted (bit 32 of its keys). A position whose
    direction is exactly 0 on every peer (an unused embedding row, a dead unit) then gets a unanimous
    +1 and then −1: it is back at its weight-decayed value every second step, where unpaired bits
    would random-walk it by ~lr·√steps."""
    return zero_sign_keys((seed, step // 2), count) | np.int64((step & 1) << 32)


def tie_key(seed: int, step: int) -> int:
    """Key of the bit stream that breaks even-n ties in ``majority_vote``."""
    return derive_key(2, seed, step)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_float(name: str, t: object) -> torch.Tensor:
    t = _check_tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    return t


def _check_packed(name: str, packed: object, numel: int) -> torch.Tensor:
    packed = _check_tensor(name, packed)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"{name} must be a 1-D uint8 tensor, got {packed.dtype} with shape {tuple(packed.shape)}")
    if packed.numel() != packed_size(numel):
        problem = "too short" if packed.numel() < packed_size(numel) else "too long"
        raise ValueError(f"{name} has {packed.numel()} bytes: {problem} for {numel} elements "
                         f"(needs exactly {packed_size(numel)})")
    return packed.contiguous()


def _check_stack(stack: object) -> torch.Tensor:
    stack = _check_tensor("stack", stack)
    if stack.dtype != torch.uint8:
        raise TypeError(f"stack must be uint8 packed rows, got {stack.dtype}")
    if stack.dim() != 2:
        raise ValueError(f"stack must have shape (n, nbytes), got {tuple(stack.shape)}")
    if not 1 <= stack.shape[0] <= MAX_VOTERS:
        raise ValueError(f"stack has n = {stack.shape[0]} rows; need 1 <= n <= {MAX_VOTERS}")
    return stack.contiguous()


def pack_signs(x: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
    """1-D uint8 of ceil(numel/8) bytes: bit = 1 iff x > 0 (NaN -> 0).

    An exact zero (±0) becomes the bit of a pseudo-random stream at its position, keyed by ``seed``
    alone, so every peer packs the same bits and idle parameters get no systematic push. Vary
    ``seed`` per step (the optimizer does) so the same position is not pushed the same way twice."""
    x = _check_float("x", x)
    return _impl(x).pack_signs(x, zero_sign_key(seed))


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values (numel,) of ``dtype`` from packed bits."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    packed = _check_packed("packed", packed, numel)
    return _impl(packed).unpack_signs(packed, numel, dtype)


def vote_counts(stack: torch.Tensor) -> torch.Tensor:
    """Per-position number of 1-bits over the n rows of a (n, nbytes) uint8 stack: (nbytes*8,).

    dtype uint8 when n < 256, else int16. Counted on packed words (a carry-save adder tree on CPU,
    per-byte bit extraction in registers on GPU); no (n, nbytes*8) tensor is ever built."""
    stack = _check_stack(stack)
    return _impl(stack).vote_counts(stack)


def majority_vote(stack: torch.Tensor, *, ties: str = "random", seed: int = 0, step: int = 0) -> torch.Tensor:
    """Packed (nbytes,) bit = 1 where more than half of the rows have 1.

    Even n ties (exactly half) get the bit of a stream keyed by (seed, step): the same on every peer,
    unbiased over positions, new each step. ``ties="zero"`` leaves tied bits 0, for callers that
    carry ties separately (the ternary result)."""
    stack = _check_stack(stack)
    if ties not in TIE_RULES:
        raise ValueError(f"ties must be one of {TIE_RULES}, got {ties!r}")
    return _impl(stack).majority_vote(stack, ties, tie_key(seed, step))


def lion_direction_pack(grad: torch.Tensor, exp_avg: torch.Tensor, beta1: float, beta2: float, *,
                        seed: int = 0) -> torch.Tensor:
    """One pass: c = β1·m + (1−β1)·g; return pack_signs(c, seed); then m ← β2·m + (1−β2)·g in place."""
    grad, exp_avg = _check_float("grad", grad), _check_float("exp_avg", exp_avg)
    if grad.shape != exp_avg.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != exp_avg shape {tuple(exp_avg.shape)}")
    if grad.device != exp_avg.device:
        raise ValueError(f"grad on {grad.device} but exp_avg on {exp_avg.device}")
    if not exp_avg.is_contiguous():
        raise ValueError("exp_avg must be contiguous (it is updated in place)")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {beta}")
    return _impl(grad).lion_direction_pack(grad, exp_avg, float(beta1), float(beta2), zero_sign_key(seed))


def apply_update(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    """In place: θ ← θ·(1 − lr·λ) − lr·u.

    ``update`` is packed 1-bit signs (uint8, ceil(numel/8) bytes, u = ±1) or a decoded float
    tensor of numel values (ternary or mean results, u in [−1, 1])."""
    param = _check_float("param", param)
    update = _check_tensor("update", update)
    if not param.is_contiguous():
        raise ValueError("param must be contiguous (it is updated in place)")
    if not (math.isfinite(lr) and math.isfinite(weight_decay)):
        raise ValueError(f"lr and weight_decay must be finite, got {lr}, {weight_decay}")
    if update.dtype == torch.uint8:
        update = _check_packed("update", update.reshape(-1), param.numel())
    elif update.dtype in FLOAT_DTYPES:
        if update.numel() != param.numel():
            raise ValueError(f"float update has {update.numel()} values for a parameter of {param.numel()}")
        update = update.reshape(-1).to(torch.float32).contiguous()
    else:
        raise TypeError(f"update must be packed uint8 or a float tensor, got {update.dtype}")
    if update.device != param.device:
        raise ValueError(f"update on {update.device} but param on {param.device}")
    _impl(param).apply_update(param, update, float(lr), float(weight_decay))


def random_tie_bits(seed: int, step: int, nbytes: int, *, offset: int = 0,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Bytes [offset, offset+nbytes) of ``majority_vote``'s packed tie-break stream for (seed, step),
    for codecs that vote on planes of one part of a larger buffer."""
    if offset % 4:
        raise ValueError(f"offset must be a multiple of 4 bytes, got {offset}")
    return random_bits_packed(tie_key(seed, step), nbytes, device, first_byte=offset)
