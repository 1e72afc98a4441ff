"""Which implementation runs a tensor: Triton on CUDA, numba on CPU, the torch path otherwise.

``LIONCUB_KERNELS=torch`` forces the torch path everywhere (the reference every other path must
match byte for byte); numba or triton that fail to import fall back to it silently, since the
results are the same, only slower."""
from __future__ import annotations

import functools
import os
import sys
from types import ModuleType

import torch

from . import torch_impl


def _forced_torch() -> bool:
    return os.environ.get("LIONCUB_KERNELS", "") == "torch"


@functools.lru_cache(maxsize=1)
def triton_impl() -> ModuleType | None:
    if _forced_torch():
        return None
    try:
        from . import triton_impl as impl
    except Exception:  # triton missing or unusable (no driver, old GPU): the torch path serves every device
        return None
    return impl


@functools.lru_cache(maxsize=1)
def numba_impl() -> ModuleType | None:
    if _forced_torch() or sys.byteorder != "little":  # the kernels' bit order assumes little-endian lanes
        return None
    try:
        from . import numba_impl as impl
    except ImportError:  # numba missing on this platform
        return None
    return impl


def impl_for(t: torch.Tensor) -> ModuleType:
    if t.is_cuda:
        return triton_impl() or torch_impl
    if t.device.type == "cpu":
        return numba_impl() or torch_impl
    return torch_impl
