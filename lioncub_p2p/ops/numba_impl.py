"""CPU kernels compiled by numba: one pass over memory, the same bytes as ``torch_impl``.

Each kernel walks the tensors it is given by raw address, 8 elements (one packed byte) per step, so
many tensors cost one call. float32 tensors only: other dtypes go to ``torch_impl`` (see the
wrappers at the end). Exact zeros of the direction take the zero-sign stream's bits, one hash word
per 4 output bytes computed whether or not a zero needs it: no branch, no slow path.

The 8-lane steps are LLVM intrinsics: a comparison of 8 lanes becomes the packed byte itself
(``fcmp`` then ``bitcast <8 x i1> to i8``: one ``movmskps`` on x86), and a byte becomes 8 lanes the
same way back (lane 0 is bit 0 on little-endian machines, the only ones ``dispatch`` sends here),
so neither packing nor unpacking needs a table or a per-bit loop. Rounding follows
torch's CPU kernels exactly: ``m.mul(β)`` rounds to float32, ``add_(g, alpha=a)`` is one fused
multiply-add (``fma(g, a, x)``), and θ ± lr of a ±1 update is one float32 add (the product is exact).
LLVM picks the vector width the CPU has; there are no fast-math flags, so nothing else is fused.

Compiled once per machine: ``cache=True`` keeps the machine code in ``__pycache__`` (or numba's user
cache when that is read-only), keyed by this file's timestamp, which is why the intrinsics live here
too; the first call of a fresh install pays a few seconds.
"""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import torch_impl
from .randbits import FMIX_1, FMIX_2, GOLDEN, KEY_START, fold_key as _fold_key_py

# -- 8-lane intrinsics ---------------------------------------------------------------------------------

_F32 = ir.FloatType()
_I1, _I8, _I32, _I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V8 = ir.VectorType(_F32, 8)
_MASK8 = ir.VectorType(_I1, 8)
_PTR = ir.PointerType()
_ZERO8 = ir.Constant(_V8, [0.0] * 8)


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """llvm.fma on scalars or <8 x float> (llvmlite's builder.fma takes scalars only)."""
    name = "llvm.fma.v8f32" if a.type == _V8 else "llvm.fma.f32"
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def _splat(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    v = builder.insert_element(ir.Constant(_V8, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_V8, ir.Undefined), ir.Constant(ir.VectorType(_I32, 8), [0] * 8))


def _load8(builder: ir.IRBuilder, addr: ir.Value) -> tuple[ir.Value, ir.Value]:
    ptr = builder.inttoptr(addr, _PTR)
    return ptr, builder.load(ptr, typ=_V8, align=4)


def _mask_byte(builder: ir.IRBuilder, mask: ir.Value) -> ir.Value:
    return builder.zext(builder.bitcast(mask, _I8), _I64)


def _byte_mask(builder: ir.IRBuilder, byte: ir.Value) -> ir.Value:
    return builder.bitcast(builder.trunc(byte, _I8), _MASK8)


def _sign_and_zero_bits(builder: ir.IRBuilder, c: ir.Value) -> ir.Value:
    """(c > 0 bits) | (c == ±0 bits) << 8; NaN sets neither."""
    positive = _mask_byte(builder, builder.fcmp_ordered(">", c, _ZERO8))
    zero = _mask_byte(builder, builder.fcmp_ordered("==", c, _ZERO8))
    return builder.or_(positive, builder.shl(zero, ir.Constant(_I64, 8)))


@intrinsic
def lion8(typingctx, g_addr, m_addr, beta1, one_minus_beta1, beta2, one_minus_beta2):
    """c = fma(g, 1−β1, m·β1) and m ← fma(g, 1−β2, m·β2) for 8 elements; returns c's sign and zero bits."""
    sig = types.int64(types.int64, types.int64, types.float32, types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        g_addr, m_addr, b1, a1, b2, a2 = args
        _, g = _load8(builder, g_addr)
        m_ptr, m = _load8(builder, m_addr)
        c = _fma(builder, g, _splat(builder, a1), builder.fmul(m, _splat(builder, b1)))
        builder.store(_fma(builder, g, _splat(builder, a2), builder.fmul(m, _splat(builder, b2))), m_ptr, align=4)
        return _sign_and_zero_bits(builder, c)

    return sig, codegen


@intrinsic
def sign8(typingctx, x_addr):
    """Sign and zero bits of 8 float32 values (as ``lion8``)."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        _, x = _load8(builder, args[0])
        return _sign_and_zero_bits(builder, x)

    return sig, codegen


def _apply_codegen(decay: bool, packed: bool):
    def codegen(context, builder, signature, args):
        p_addr, update, scale, neg_lr = args
        p_ptr, p = _load8(builder, p_addr)
        if decay:
            p = builder.fmul(p, _splat(builder, scale))
        lr = _splat(builder, neg_lr)
        if packed:  # θ + (−lr)·(±1): the product is exact, so one add rounds like torch's fma
            p = builder.fadd(p, builder.select(_byte_mask(builder, update), lr, builder.fneg(lr)))
        else:
            _, u = _load8(builder, update)
            p = _fma(builder, u, lr, p)
        builder.store(p, p_ptr, align=4)
        return context.get_dummy_value()

    return codegen


def _apply_intrinsic(decay: bool, packed: bool):
    def typer(typingctx, p_addr, update, scale, neg_lr):
        return types.void(types.int64, types.int64, types.float32, types.float32), _apply_codegen(decay, packed)

    return intrinsic(typer)


# θ ← θ·scale − lr·u for 8 elements; u from one packed byte (bit 1 → +1) or from 8 float32 at an address
apply8_packed = _apply_intrinsic(decay=False, packed=True)
apply8_packed_decay = _apply_intrinsic(decay=True, packed=True)
apply8_float = _apply_intrinsic(decay=False, packed=False)
apply8_float_decay = _apply_intrinsic(decay=True, packed=False)


@intrinsic
def unpack8(typingctx, out_addr, byte):
    """Store the ±1.0 float32 values of one packed byte's 8 bits."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        out_addr, byte = args
        ones = ir.Constant(_V8, [1.0] * 8)
        values = builder.select(_byte_mask(builder, byte), ones, builder.fneg(ones))
        builder.store(values, builder.inttoptr(out_addr, _PTR), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fma32(typingctx, a, b, c):
    sig = types.float32(types.float32, types.float32, types.float32)
    return sig, lambda context, builder, signature, args: _fma(builder, *args)


@intrinsic
def load_f32(typingctx, addr):
    sig = types.float32(types.int64)
    return sig, lambda context, builder, signature, args: builder.load(
        builder.inttoptr(args[0], _PTR), typ=_F32, align=4)


@intrinsic
def store_f32(typingctx, addr, value):
    sig = types.void(types.int64, types.float32)

    def codegen(context, builder, signature, args):
        builder.store(args[1], builder.inttoptr(args[0], _PTR), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_u8(typingctx, addr, value):
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        builder.store(builder.trunc(args[1], _I8), builder.inttoptr(args[0], _PTR), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def load_u8(typingctx, addr):
    sig = types.int64(types.int64)
    return sig, lambda context, builder, signature, args: builder.zext(
        builder.load(builder.inttoptr(args[0], _PTR), typ=_I8, align=1), _I64)


def _fmix32(builder: ir.IRBuilder, h: ir.Value) -> ir.Value:
    h = builder.xor(h, builder.lshr(h, ir.Constant(_I32, 16)))
    h = builder.mul(h, ir.Constant(_I32, FMIX_1))
    h = builder.xor(h, builder.lshr(h, ir.Constant(_I32, 13)))
    h = builder.mul(h, ir.Constant(_I32, FMIX_2))
    return builder.xor(h, builder.lshr(h, ir.Constant(_I32, 16)))


@intrinsic
def mix32(typingctx, key, word):
    """randbits' stream word: fmix32(word·GOLDEN ^ key), in wrapping 32-bit arithmetic; as int64."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        key, word = (builder.trunc(a, _I32) for a in args)
        h = builder.xor(builder.mul(word, ir.Constant(_I32, GOLDEN)), key)
        return builder.zext(_fmix32(builder, h), _I64)

    return sig, codegen


@intrinsic
def fold_key(typingctx, h, part):
    """One part of randbits.derive_key: for both 32-bit halves x of part, h = fmix32(h ^ x) + GOLDEN."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        h, part = args
        h = builder.trunc(h, _I32)
        for shift in (0, 32):
            half = builder.trunc(builder.ashr(part, ir.Constant(_I64, shift)), _I32)
            h = builder.add(_fmix32(builder, builder.xor(h, half)), ir.Constant(_I32, GOLDEN))
        return builder.zext(h, _I64)

    return sig, codegen


@intrinsic
def finish_key(typingctx, h):
    """The last step of randbits.derive_key: fmix32(h)."""
    sig = types.int64(types.int64)
    return sig, lambda context, builder, signature, args: builder.zext(
        _fmix32(builder, builder.trunc(args[0], _I32)), _I64)


# -- kernels ------------------------------------------------------------------------------------------

# The gradient of a parameter without one: 8 zeros read with stride 0 (g = +0.0, as torch.zeros_like).
_NO_GRAD = np.zeros(8, dtype=np.float32)
NO_GRAD_ADDRESS = _NO_GRAD.ctypes.data

_JIT = dict(cache=True, nogil=True)


@njit(**_JIT)
def _stream_bit(key, position):
    return ((mix32(key, position >> 5) >> (position & 31)) & 1) ^ ((key >> 32) & 1)


# Packing: one stream word (32 bits) per 4 output bytes, computed whether or not a zero needs it: a
# branch on "this byte has a zero" mispredicts when ~10% of values are zeros, the hash costs less.


@njit(**_JIT)
def _lion_pack_one(g, g_step, m, n, b1, a1, b2, a2, key, out):
    """Lion's direction of n elements at addresses g (stride g_step bytes) and m, packed to out;
    m updated in place."""
    full = n >> 3
    flip = ((key >> 32) & 1) * 0xFFFFFFFF
    for b in range(full):
        if b & 3 == 0:
            stream = mix32(key, b >> 2) ^ flip
        r = lion8(g + 8 * g_step * b, m + 32 * b, b1, a1, b2, a2)
        store_u8(out + b, (r & 0xFF) | ((r >> 8) & (stream >> ((b & 3) << 3))))
    if n > full * 8:
        bits = 0
        for i in range(full * 8, n):
            gi = load_f32(g + g_step * i)
            mi = load_f32(m + 4 * i)
            c = fma32(gi, a1, mi * b1)
            store_f32(m + 4 * i, fma32(gi, a2, mi * b2))
            if c > 0:
                bits |= 1 << (i & 7)
            elif c == 0:
                bits |= _stream_bit(key, i) << (i & 7)
        store_u8(out + full, bits)


@njit(**_JIT)
def lion_pack_many(g_addrs, m_addrs, numels, offsets, coefs, keys, out, no_grad):
    """``_lion_pack_one`` for every tensor s: bytes out + offsets[s]; coefs[s] = (β1, 1−β1, β2, 1−β2);
    g_addrs[s] == 0 means no gradient (g = 0)."""
    for s in range(numels.size):
        g, g_step = g_addrs[s], 4
        if g == 0:
            g, g_step = no_grad, 0
        _lion_pack_one(g, g_step, m_addrs[s], numels[s], coefs[s, 0], coefs[s, 1], coefs[s, 2], coefs[s, 3],
                       keys[s], out + offsets[s])


@njit(**_JIT)
def pack_signs_one(x, n, key, out):
    full = n >> 3
    flip = ((key >> 32) & 1) * 0xFFFFFFFF
    for b in range(full):
        if b & 3 == 0:
            stream = mix32(key, b >> 2) ^ flip
        r = sign8(x + 32 * b)
        store_u8(out + b, (r & 0xFF) | ((r >> 8) & (stream >> ((b & 3) << 3))))
    if n > full * 8:
        bits = 0
        for i in range(full * 8, n):
            v = load_f32(x + 4 * i)
            if v > 0:
                bits |= 1 << (i & 7)
            elif v == 0:
                bits |= _stream_bit(key, i) << (i & 7)
        store_u8(out + full, bits)


@njit(**_JIT)
def _apply_packed_one(p, n, update, scale, neg_lr):
    full = n >> 3
    if scale != 1.0:
        for b in range(full):
            apply8_packed_decay(p + 32 * b, load_u8(update + b), scale, neg_lr)
    else:
        for b in range(full):
            apply8_packed(p + 32 * b, load_u8(update + b), scale, neg_lr)
    if n > full * 8:
        byte = load_u8(update + full)
        for i in range(full * 8, n):
            x = load_f32(p + 4 * i)
            if scale != 1.0:
                x = x * scale
            store_f32(p + 4 * i, x + (neg_lr if (byte >> (i & 7)) & 1 else -neg_lr))


@njit(**_JIT)
def _apply_float_one(p, n, update, scale, neg_lr):
    full = n >> 3
    if scale != 1.0:
        for b in range(full):
            apply8_float_decay(p + 32 * b, update + 32 * b, scale, neg_lr)
    else:
        for b in range(full):
            apply8_float(p + 32 * b, update + 32 * b, scale, neg_lr)
    for i in range(full * 8, n):
        x = load_f32(p + 4 * i)
        if scale != 1.0:
            x = x * scale
        store_f32(p + 4 * i, fma32(load_f32(update + 4 * i), neg_lr, x))


@njit(**_JIT)
def apply_many(p_addrs, numels, offsets, scales, neg_lrs, update, packed):
    """θ ← θ·scale − lr·u for every tensor s; u at byte offsets[s] of a packed update, or at float
    8·offsets[s] of a float32 one."""
    for s in range(numels.size):
        if packed:
            _apply_packed_one(p_addrs[s], numels[s], update + offsets[s], scales[s], neg_lrs[s])
        else:
            _apply_float_one(p_addrs[s], numels[s], update + 32 * offsets[s], scales[s], neg_lrs[s])


@njit(**_JIT)
def unpack_one(packed, n, out):
    full = n >> 3
    for b in range(full):
        unpack8(out + 32 * b, load_u8(packed + b))
    for i in range(full * 8, n):
        store_f32(out + 4 * i, np.float32(1.0) if (load_u8(packed + (i >> 3)) >> (i & 7)) & 1 else np.float32(-1.0))


@njit(**_JIT)
def _derive_keys(prefix, count, outer_prefix, has_outer):
    keys = np.empty(count, dtype=np.int64)
    for i in range(count):
        k = finish_key(fold_key(prefix, i))
        if has_outer:
            k = finish_key(fold_key(outer_prefix, k))
        keys[i] = k
    return keys


def derive_keys(parts: tuple[int, ...], count: int, outer: tuple[int, ...] = ()) -> np.ndarray:
    """As ``randbits.derive_keys_numpy``, as int64."""
    prefix = outer_prefix = KEY_START
    for part in parts:
        prefix = _fold_key_py(prefix, part)
    for part in outer:
        outer_prefix = _fold_key_py(outer_prefix, part)
    return _derive_keys(prefix, count, outer_prefix, bool(outer))


# -- the single-tensor ops (same signatures as torch_impl) -------------------------------------------


def _fast(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def pack_signs(x: torch.Tensor, key: int) -> torch.Tensor:
    if not _fast(x):
        return torch_impl.pack_signs(x, key)
    flat = x.reshape(-1).contiguous()
    out = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8)
    pack_signs_one(flat.data_ptr(), flat.numel(), key, out.data_ptr())
    return out


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype != torch.float32 or packed.device.type != "cpu":
        return torch_impl.unpack_signs(packed, numel, dtype)
    out = torch.empty(numel, dtype=torch.float32)
    unpack_one(packed.data_ptr(), numel, out.data_ptr())
    return out


def lion_direction_pack(grad: torch.Tensor, exp_avg: torch.Tensor, beta1: float, beta2: float,
                        key: int) -> torch.Tensor:
    if not _fast(grad, exp_avg):
        return torch_impl.lion_direction_pack(grad, exp_avg, beta1, beta2, key)
    g = grad.reshape(-1).contiguous()
    out = torch.empty((g.numel() + 7) // 8, dtype=torch.uint8)
    b1, a1, b2, a2 = torch_impl.coefficients(beta1, beta2)
    _lion_pack_one(g.data_ptr(), 4, exp_avg.data_ptr(), g.numel(), b1, a1, b2, a2, key, out.data_ptr())
    return out


def apply_update(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    if not _fast(param) or update.device.type != "cpu":
        return torch_impl.apply_update(param, update, lr, weight_decay)
    scale, neg_lr = torch_impl.apply_scalars(lr, weight_decay)
    update = update.contiguous()
    if update.dtype == torch.uint8:
        _apply_packed_one(param.data_ptr(), param.numel(), update.data_ptr(), scale, neg_lr)
    else:
        _apply_float_one(param.data_ptr(), param.numel(), update.data_ptr(), scale, neg_lr)


vote_counts = torch_impl.vote_counts
majority_vote = torch_impl.majority_vote
