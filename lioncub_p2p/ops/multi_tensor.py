"""Lion's direction+pack and unpack+apply over all of a model's parameters in one call.

A ``LionKernels`` is built once for a fixed list of parameters, their momenta, their byte offsets in
the flat vote buffer (parameter i owns bytes [offset_i, offset_i + ceil(numel_i/8))) and the param
group each belongs to. It sorts the tensors once into batches that one kernel call serves:

* float32 contiguous CPU tensors: one numba call over a table of addresses (``numba_impl``);
* contiguous CUDA tensors: one Triton launch per dtype over a table of chunks (``triton_impl``);
* anything else (other dtypes on CPU, non-contiguous parameters, a second device, no numba or
  triton): tensor by tensor on the reference path.

Every path produces the same bytes. Per step the Python cost is reading each gradient's address
(and each parameter's, to notice a replaced ``.data``), not a kernel launch per tensor.
"""
from __future__ import annotations

import operator
from typing import Sequence

import numpy as np
import torch

from .dispatch import impl_for, numba_impl, triton_impl
from .torch_impl import apply_scalars, coefficients


_data_ptr, _numel, _is_contiguous = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
_dtype_of, _is_cuda = operator.attrgetter("dtype"), operator.attrgetter("is_cuda")


def _none(values) -> bool:
    return not any(values)


def _aligned(addresses: np.ndarray) -> bool:
    return bool((addresses % 16 == 0).all())


def _addresses(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.array(list(map(_data_ptr, tensors)), dtype=np.int64)


def _grad_addresses(grads: Sequence[torch.Tensor | None], numels: list[int], dtype: torch.dtype, cuda: bool,
                    keep: list) -> np.ndarray:
    """Address of each gradient (0 = none), after checking it fits its parameter (the kernels read
    exactly numel values of dtype there); a non-contiguous one is copied (into ``keep``) first."""
    try:  # the common case, in C-level loops (~35% less Python time per tensor than the loop below)
        addresses = list(map(_data_ptr, grads))
        if (list(map(_numel, grads)) == numels and all(map(_is_contiguous, grads))
                and all(d == dtype for d in map(_dtype_of, grads))
                and (all if cuda else _none)(map(_is_cuda, grads))):
            return np.array(addresses, dtype=np.int64)
    except TypeError:  # a None among them
        pass
    out = []
    for g, numel in zip(grads, numels):
        if g is None:
            out.append(0)
            continue
        if g.dtype != dtype or g.is_cuda != cuda or g.numel() != numel:
            raise ValueError(f"a gradient of {g.numel()} {g.dtype} values on {g.device} does not fit its parameter "
                             f"({numel} {dtype} values)")
        if not g.is_contiguous():
            keep.append(g.contiguous())
            g = keep[-1]
        out.append(g.data_ptr())
    return np.array(out, dtype=np.int64)


class _Batch:
    """Tensors that one kernel call serves; ``index`` are their positions in the ``LionKernels``."""

    def __init__(self, index: list[int], params: list[torch.Tensor], momenta: list[torch.Tensor], offsets: np.ndarray):
        self.index = np.array(index, dtype=np.int64)
        self.params = [params[i] for i in index]
        self.aliases = [p.detach() for p in self.params]  # keep the storage alive whatever happens to .data
        self.momenta = [momenta[i] for i in index]
        self.p_addrs = _addresses(self.aliases)
        self.m_addrs = _addresses(self.momenta)
        self.numels = np.array([p.numel() for p in self.params], dtype=np.int64)
        self.numel_list = self.numels.tolist()
        self.dtype = self.params[0].dtype
        self.cuda = self.params[0].is_cuda
        self.offsets = offsets[self.index]

    def grad_addresses(self, grads: list, keep: list) -> np.ndarray:
        return _grad_addresses(grads, self.numel_list, self.dtype, self.cuda, keep)

    def unchanged(self) -> bool:
        return np.array_equal(_addresses(self.params), self.p_addrs)


class _NumbaBatch(_Batch):
    def direction_pack(self, grads: list, coefs: np.ndarray, keys: np.ndarray, out: torch.Tensor) -> None:
        keep: list[torch.Tensor] = []
        impl = numba_impl()
        impl.lion_pack_many(self.grad_addresses(grads, keep), self.m_addrs, self.numels, self.offsets, coefs, keys,
                            out.data_ptr(), impl.NO_GRAD_ADDRESS)

    def apply(self, update: torch.Tensor, scalars: np.ndarray) -> None:
        numba_impl().apply_many(self.p_addrs, self.numels, self.offsets, np.ascontiguousarray(scalars[:, 0]),
                                np.ascontiguousarray(scalars[:, 1]), update.data_ptr(), update.dtype == torch.uint8)


class _TritonBatch(_Batch):
    """Contiguous CUDA tensors of one dtype: one launch, tables on the device."""

    def __init__(self, index: list[int], params: list[torch.Tensor], momenta: list[torch.Tensor], offsets: np.ndarray):
        super().__init__(index, params, momenta, offsets)
        impl, device = triton_impl(), self.params[0].device
        as_device = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        self.d_p, self.d_m = as_device(self.p_addrs), as_device(self.m_addrs)
        self.d_numels, self.d_offsets = as_device(self.numels), as_device(self.offsets)
        nbytes = [(int(n) + 7) // 8 for n in self.numels]
        self.pack_chunks = impl.chunk_table(nbytes, impl.PACK_BLOCK, device)
        self.elem_chunks = impl.chunk_table([int(n) for n in self.numels], impl.ELEM_BLOCK, device)
        # 16-byte aligned addresses let the kernels read and write 16 bytes at a time
        self.p_aligned, self.m_aligned = _aligned(self.p_addrs), _aligned(self.m_addrs)

    def direction_pack(self, grads: list, coefs: np.ndarray, keys: np.ndarray, out: torch.Tensor) -> None:
        keep: list[torch.Tensor] = []
        n = len(self.index)
        table = np.empty(4 * n, dtype=np.int64)  # g addresses | keys | coefs as float32 pairs: one copy
        table[:n], table[n : 2 * n] = self.grad_addresses(grads, keep), keys
        table[2 * n :] = np.ascontiguousarray(coefs, dtype=np.float32).view(np.int64).reshape(-1)
        d = torch.from_numpy(table).to(out.device)
        triton_impl().lion_pack_many(self.dtype, self.pack_chunks, self.d_m, self.d_numels, self.d_offsets, d[:n],
                                     d[n : 2 * n], d[2 * n :].view(torch.float32), out,
                                     self.m_aligned and _aligned(table[:n]))

    def apply(self, update: torch.Tensor, scalars: np.ndarray) -> None:
        d = torch.from_numpy(np.ascontiguousarray(scalars, dtype=np.float32)).to(update.device)
        triton_impl().apply_many(self.dtype, self.elem_chunks, self.d_p, self.d_numels, self.d_offsets, d.view(-1),
                                 update, self.p_aligned)


class LionKernels:
    """See the module docstring. ``out``/``update`` buffers live on the first parameter's device;
    ``group_index[i]`` says which entry of the per-group hyperparameters tensor i uses (default 0)."""

    def __init__(self, params: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor], offsets: Sequence[int],
                 group_index: Sequence[int] | None = None):
        if not (len(params) == len(momenta) == len(offsets)) or not params:
            raise ValueError("need one momentum and one offset per parameter, and at least one parameter")
        self.params = list(params)
        self.momenta = list(momenta)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        for p, m, offset in zip(self.params, self.momenta, self.offsets):
            if p.shape != m.shape or p.device != m.device or offset < 0:
                raise ValueError(f"a momentum of shape {tuple(m.shape)} on {m.device} (offset {offset}) for a "
                                 f"parameter of shape {tuple(p.shape)} on {p.device}")
        numels = np.array([p.numel() for p in self.params], dtype=np.int64)
        self.nbytes = int((self.offsets + (numels + 7) // 8).max())  # bytes a buffer must hold
        self.nvalues = int((8 * self.offsets + numels).max())  # values a float update must hold
        self.group_index = np.zeros(len(params), dtype=np.int64) if group_index is None else np.asarray(group_index)
        self.device = self.params[0].device
        self._sort()

    def _sort(self) -> None:
        batches: dict[object, list[int]] = {}
        self.rest: list[int] = []
        for i, (p, m) in enumerate(zip(self.params, self.momenta)):
            if not (p.is_contiguous() and m.is_contiguous() and p.dtype == m.dtype and p.device == self.device):
                self.rest.append(i)
            elif self.device.type == "cpu" and numba_impl() is not None and p.dtype == torch.float32:
                batches.setdefault("numba", []).append(i)
            elif p.is_cuda and triton_impl() is not None:
                batches.setdefault(p.dtype, []).append(i)
            else:
                self.rest.append(i)
        self.batches: list[_Batch] = [
            (_NumbaBatch if kind == "numba" else _TritonBatch)(index, self.params, self.momenta, self.offsets)
            for kind, index in batches.items()]
        self.whole = len(self.batches) == 1 and not self.rest  # then a batch's index is 0..n-1

    def _check_params(self) -> None:
        """Sort again if a parameter's storage was replaced (``p.data = ...``) since the last call."""
        if not all(batch.unchanged() for batch in self.batches):
            self._sort()

    def _select(self, values: list | np.ndarray, batch: _Batch) -> list | np.ndarray:
        if self.whole:
            return values
        if isinstance(values, np.ndarray):
            return values[batch.index]
        return [values[i] for i in batch.index]

    def direction_pack(self, grads: Sequence[torch.Tensor | None], betas: Sequence[tuple[float, float]],
                       keys: np.ndarray, out: torch.Tensor) -> None:
        """out[offset_i: ...] ← packed sign of c_i = β1·m_i + (1−β1)·g_i (exact zeros: the bit of the
        stream keyed keys[i]), then m_i ← β2·m_i + (1−β2)·g_i. ``grads[i]`` None means g_i = 0;
        ``betas`` has one (β1, β2) per group; ``out`` is contiguous uint8 on ``device``."""
        self._check_params()
        if (out.device != self.device or out.dtype != torch.uint8 or not out.is_contiguous()
                or out.numel() < self.nbytes):
            raise ValueError(f"out must be a contiguous uint8 tensor of >= {self.nbytes} bytes on {self.device}")
        if len(grads) != len(self.params) or len(keys) != len(self.params):
            raise ValueError(f"need one gradient (or None) and one key per parameter ({len(self.params)}), "
                             f"got {len(grads)} and {len(keys)}")
        keys = np.asarray(keys, dtype=np.int64)
        betas = np.asarray(betas, dtype=np.float64).reshape(-1, 2)[self.group_index]
        coefs = coefficients(betas[:, 0], betas[:, 1])
        grads = list(grads)
        for batch in self.batches:
            batch.direction_pack(self._select(grads, batch), self._select(coefs, batch), self._select(keys, batch), out)
        for i in self.rest:
            p, m = self.params[i], self.momenta[i]
            g = grads[i] if grads[i] is not None else torch.zeros_like(p)
            bits = impl_for(m).lion_direction_pack(g.to(m.device), m, float(betas[i, 0]), float(betas[i, 1]),
                                                   int(keys[i]))
            out[self.offsets[i] : self.offsets[i] + bits.numel()] = bits.to(out.device)

    def apply(self, update: torch.Tensor, lr: Sequence[float], weight_decay: Sequence[float]) -> None:
        """θ_i ← θ_i·(1 − lr·λ) − lr·u_i with lr, λ of tensor i's group and u_i its packed bits (uint8,
        bytes at offset_i) or float32 values (at 8·offset_i) in ``update``."""
        self._check_params()
        packed = update.dtype == torch.uint8
        if not packed and update.dtype != torch.float32:
            raise TypeError(f"update must be packed uint8 or float32, got {update.dtype}")
        if update.dim() != 1 or update.numel() < (self.nbytes if packed else self.nvalues):
            raise ValueError(f"update has shape {tuple(update.shape)}; needs at least "
                             f"{self.nbytes if packed else self.nvalues} values")
        update = update.to(self.device).contiguous()
        lr = np.asarray(lr, dtype=np.float64)[self.group_index]
        weight_decay = np.asarray(weight_decay, dtype=np.float64)[self.group_index]
        scalars = apply_scalars(lr, weight_decay)
        for batch in self.batches:
            batch.apply(update, self._select(scalars, batch))
        for i in self.rest:
            p, start = self.params[i], int(self.offsets[i])
            u = update[start : start + (p.numel() + 7) // 8] if packed else update[8 * start : 8 * start + p.numel()]
            target = p.detach() if p.is_contiguous() else p.detach().contiguous()
            impl_for(target).apply_update(target, u.to(p.device), float(lr[i]), float(weight_decay[i]))
            if target.data_ptr() != p.data_ptr():
                p.detach().copy_(target)
