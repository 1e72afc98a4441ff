"""Triton kernels: one pass over memory per call, the same bytes as ``torch_impl``.

Floating inputs are handled so the kernels behave identically compiled (CUDA) and under
``TRITON_INTERPRET=1`` (CPU), where a bfloat16 tensor is read as raw 16-bit integers: bf16 data is
passed as an int16 view and converted with bit operations (bf16 is the top half of a float32).
``pack_signs`` works on integer views for every dtype, so its sign test is pure integer logic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch shapes: bytes or elements per program, warps; the fastest of benchmarks/triton_tune.py's sweep
# on an H200 at 64M elements (docs/benchmarks.md). Within ~10% of each other: 256-512 bytes with 2-4
# warps for packing, any of 1024-4096 elements for the elementwise kernels, any for counting.
PACK_BLOCK, PACK_WARPS = 256, 2  # output bytes per program (2048 elements)
ELEM_BLOCK, ELEM_WARPS = 4096, 8  # elements per program in the elementwise kernels (a multiple of 8)
COUNT_BLOCK, COUNT_WARPS = 512, 4  # bytes per program in the counting kernels

# dtype -> (integer view, largest bit pattern of a non-NaN positive value, magnitude mask)
_INT_VIEW = {
    torch.float32: (torch.int32, 0x7F800000, 0x7FFFFFFF),
    torch.float16: (torch.int16, 0x7C00, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7F80, 0x7FFF),
}


@triton.jit
def _random_bit(key, pos):
    """Bit ``pos`` of the stream in randbits.py: (mix32(key, pos // 32) >> (pos % 32)) & 1 for a
    32-bit ``key`` (the low half of randbits' key; its bit 32, "inverted", is applied by the caller)."""
    h = (pos >> 5).to(tl.uint32) * 0x9E3779B1
    h = h ^ key.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return ((h >> (pos & 31).to(tl.uint32)) & 1) != 0


@triton.jit
def _load_f32(ptr, offs, mask, IS_BF16: tl.constexpr, WHOLE: tl.constexpr = False):
    """WHOLE: every offset is inside, no mask (a masked load with a bound of unknown alignment is
    split into 4-byte accesses)."""
    if WHOLE:
        raw = tl.load(ptr + offs)
    else:
        raw = tl.load(ptr + offs, mask=mask, other=0)
    if IS_BF16:
        return ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _bf16_bits(x):
    """float32 -> bf16 bit pattern (in the low 16 bits of an int32), round to nearest even."""
    b = x.to(tl.int32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@triton.jit
def _round_to(x, ptr, IS_BF16: tl.constexpr):
    """Round float32 ``x`` to the element type of ``ptr`` and back, as a store and reload would."""
    if IS_BF16:
        return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_f32(ptr, offs, x, mask, IS_BF16: tl.constexpr, WHOLE: tl.constexpr = False):
    if IS_BF16:
        x = _bf16_bits(x).to(tl.int16)
    else:
        x = x.to(ptr.dtype.element_ty)
    if WHOLE:
        tl.store(ptr + offs, x)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _pack_byte(bits, lane):
    return tl.sum(bits.to(tl.int32) << lane[None, :], axis=1).to(tl.uint8)


# The single-tensor kernels below: a program wholly inside the tensor runs without masks (WHOLE), so
# its accesses are 16 bytes wide whatever the length; Triton's own specialization (a length divisible
# by 16) gave that only to some lengths, and a mask of unknown alignment splits every access in four.


@triton.jit
def _pack_chunk(x_ptr, out_ptr, byte, numel, nbytes, key, POS_LIMIT: tl.constexpr, MAG_MASK: tl.constexpr,
                FLIP: tl.constexpr, WHOLE: tl.constexpr):
    lane = tl.arange(0, 8)
    pos = byte[:, None] * 8 + lane[None, :]
    inside = pos < numel
    if WHOLE:
        v = tl.load(x_ptr + pos)
    else:
        v = tl.load(x_ptr + pos, mask=inside, other=0)
    positive = (v > 0) & (v <= POS_LIMIT)  # sign bit clear, nonzero, not NaN
    zero = (v & MAG_MASK) == 0
    bits = (positive | (zero & (_random_bit(key, pos) != FLIP))) & inside
    if WHOLE:
        tl.store(out_ptr + byte, _pack_byte(bits, lane))
    else:
        tl.store(out_ptr + byte, _pack_byte(bits, lane), mask=byte < nbytes)


@triton.jit
def _pack_kernel(x_ptr, out_ptr, numel, nbytes, key, POS_LIMIT: tl.constexpr, MAG_MASK: tl.constexpr,
                 FLIP: tl.constexpr, BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCK
    byte = first + tl.arange(0, BLOCK)
    if (first + BLOCK) * 8 <= numel:
        _pack_chunk(x_ptr, out_ptr, byte, numel, nbytes, key, POS_LIMIT, MAG_MASK, FLIP, True)
    else:
        _pack_chunk(x_ptr, out_ptr, byte, numel, nbytes, key, POS_LIMIT, MAG_MASK, FLIP, False)


@triton.jit
def _unpack_chunk(packed_ptr, out_ptr, offs, numel, OUT_BF16: tl.constexpr, WHOLE: tl.constexpr):
    mask = offs < numel
    if WHOLE:
        byte = tl.load(packed_ptr + offs // 8).to(tl.int32)
    else:
        byte = tl.load(packed_ptr + offs // 8, mask=mask, other=0).to(tl.int32)
    bit = (byte >> (offs % 8).to(tl.int32)) & 1
    _store_f32(out_ptr, offs, (bit * 2 - 1).to(tl.float32), mask, OUT_BF16, WHOLE)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, numel, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    if first + BLOCK <= numel:
        _unpack_chunk(packed_ptr, out_ptr, offs, numel, OUT_BF16, True)
    else:
        _unpack_chunk(packed_ptr, out_ptr, offs, numel, OUT_BF16, False)


@triton.jit
def _lion_step_pack(g, m, m_ptr, out_ptr, byte, pos, inside, nbytes, random, beta1, one_minus_beta1, beta2,
                    one_minus_beta2, M_BF16: tl.constexpr, WHOLE: tl.constexpr):
    """Lion's direction packed into ``out_ptr`` at ``byte`` (zeros take ``random``), the momentum stepped:
    the one copy of the math both lion-pack kernels share."""
    c = tl.fma(g, one_minus_beta1, m * beta1)  # the rounding of torch's mul then add_(alpha=)
    bits = ((c > 0) | ((c == 0) & random)) & inside
    lane = tl.arange(0, 8)
    if WHOLE:
        tl.store(out_ptr + byte, _pack_byte(bits, lane))
    else:
        tl.store(out_ptr + byte, _pack_byte(bits, lane), mask=byte < nbytes)
    _store_f32(m_ptr, pos, tl.fma(g, one_minus_beta2, m * beta2), inside, M_BF16, WHOLE)


@triton.jit
def _lion_pack_one(g_ptr, m_ptr, out_ptr, byte, numel, nbytes, key, beta1, one_minus_beta1, beta2, one_minus_beta2,
                   G_BF16: tl.constexpr, M_BF16: tl.constexpr, FLIP: tl.constexpr, WHOLE: tl.constexpr):
    pos = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    inside = pos < numel
    g = _load_f32(g_ptr, pos, inside, G_BF16, WHOLE)
    m = _load_f32(m_ptr, pos, inside, M_BF16, WHOLE)
    _lion_step_pack(g, m, m_ptr, out_ptr, byte, pos, inside, nbytes, _random_bit(key, pos) != FLIP, beta1,
                    one_minus_beta1, beta2, one_minus_beta2, M_BF16, WHOLE)


@triton.jit
def _lion_pack_kernel(g_ptr, m_ptr, out_ptr, numel, nbytes, key, beta1, one_minus_beta1, beta2,
                      one_minus_beta2, G_BF16: tl.constexpr, M_BF16: tl.constexpr, FLIP: tl.constexpr,
                      BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCK
    byte = first + tl.arange(0, BLOCK)
    if (first + BLOCK) * 8 <= numel:
        _lion_pack_one(g_ptr, m_ptr, out_ptr, byte, numel, nbytes, key, beta1, one_minus_beta1, beta2,
                       one_minus_beta2, G_BF16, M_BF16, FLIP, True)
    else:
        _lion_pack_one(g_ptr, m_ptr, out_ptr, byte, numel, nbytes, key, beta1, one_minus_beta1, beta2,
                       one_minus_beta2, G_BF16, M_BF16, FLIP, False)


@triton.jit
def _apply_one(p_ptr, u_ptr, offs, numel, lr, decay_scale, PACKED: tl.constexpr, HAS_DECAY: tl.constexpr,
               P_BF16: tl.constexpr, WHOLE: tl.constexpr):
    mask = offs < numel
    p = _load_f32(p_ptr, offs, mask, P_BF16, WHOLE)
    if HAS_DECAY:
        p = _round_to(p * decay_scale, p_ptr, P_BF16)
    if PACKED:
        if WHOLE:
            byte = tl.load(u_ptr + offs // 8).to(tl.int32)
        else:
            byte = tl.load(u_ptr + offs // 8, mask=mask, other=0).to(tl.int32)
        u = (((byte >> (offs % 8).to(tl.int32)) & 1) * 2 - 1).to(tl.float32)
    else:
        u = _load_f32(u_ptr, offs, mask, False, WHOLE)
    _store_f32(p_ptr, offs, tl.fma(u, -lr, p), mask, P_BF16, WHOLE)


@triton.jit
def _apply_kernel(p_ptr, u_ptr, numel, lr, decay_scale, PACKED: tl.constexpr, HAS_DECAY: tl.constexpr,
                  P_BF16: tl.constexpr, BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    if first + BLOCK <= numel:
        _apply_one(p_ptr, u_ptr, offs, numel, lr, decay_scale, PACKED, HAS_DECAY, P_BF16, True)
    else:
        _apply_one(p_ptr, u_ptr, offs, numel, lr, decay_scale, PACKED, HAS_DECAY, P_BF16, False)


@triton.jit
def _count_rows(stack_ptr, row_stride, n, byte, mask, lane, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK, 8), dtype=tl.int32)
    for r in range(0, n):
        b = tl.load(stack_ptr + r * row_stride + byte, mask=mask, other=0).to(tl.int32)
        acc += (b[:, None] >> lane[None, :]) & 1
    return acc


@triton.jit
def _count_kernel(stack_ptr, out_ptr, n, nbytes, row_stride, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    mask = byte < nbytes
    acc = _count_rows(stack_ptr, row_stride, n, byte, mask, lane, BLOCK)
    tl.store(out_ptr + byte[:, None] * 8 + lane[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _majority_kernel(stack_ptr, out_ptr, n, nbytes, row_stride, key, RANDOM_TIES: tl.constexpr,
                     BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    mask = byte < nbytes
    twice = _count_rows(stack_ptr, row_stride, n, byte, mask, lane, BLOCK) * 2
    bits = twice > n
    if RANDOM_TIES:
        bits = bits | ((twice == n) & _random_bit(key, byte[:, None] * 8 + lane[None, :]))
    tl.store(out_ptr + byte, _pack_byte(bits, lane), mask=mask)


# -- counting on 32-bit words, bit-sliced: plane k holds bit k of the count at each of the word's 32
# positions, so adding a row is a ripple of (and, xor) through the planes: 2 * NPLANES operations per
# word and row, where unpacking to one counter per position costs 24 per 4 bytes (the byte kernels
# above, kept for over 255 voters and odd layouts). The packed result falls out of the planes as is.


@triton.jit
def _add_row(x, p0, p1, p2, p3, p4, p5, p6, p7, NPLANES: tl.constexpr):
    c = p0 & x
    p0 = p0 ^ x
    if NPLANES > 1:
        t = p1 & c
        p1 = p1 ^ c
        c = t
    if NPLANES > 2:
        t = p2 & c
        p2 = p2 ^ c
        c = t
    if NPLANES > 3:
        t = p3 & c
        p3 = p3 ^ c
        c = t
    if NPLANES > 4:
        t = p4 & c
        p4 = p4 ^ c
        c = t
    if NPLANES > 5:
        t = p5 & c
        p5 = p5 ^ c
        c = t
    if NPLANES > 6:
        t = p6 & c
        p6 = p6 ^ c
        c = t
    if NPLANES > 7:
        p7 = p7 ^ c
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _count_planes(words_ptr, row_stride, n, w, mask, NPLANES: tl.constexpr, BLOCK: tl.constexpr):
    z = tl.zeros((BLOCK,), dtype=tl.int32)
    p0, p1, p2, p3, p4, p5, p6, p7 = z, z, z, z, z, z, z, z
    for r in range(0, n):
        x = tl.load(words_ptr + r * row_stride + w, mask=mask, other=0)
        p0, p1, p2, p3, p4, p5, p6, p7 = _add_row(x, p0, p1, p2, p3, p4, p5, p6, p7, NPLANES)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _compare_plane(gt, eq, p, k, h):
    """One step, from the top plane down, of count > h and count == h for a scalar h."""
    hk = 0 - ((h >> k) & 1)  # all ones where bit k of h is set
    gt = gt | (eq & p & ~hk)
    eq = eq & ~(p ^ hk)
    return gt, eq


@triton.jit
def _majority_words_kernel(words_ptr, out_ptr, n, nwords, row_stride, first_word, key, RANDOM_TIES: tl.constexpr,
                           NPLANES: tl.constexpr, BLOCK: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = w < nwords
    p0, p1, p2, p3, p4, p5, p6, p7 = _count_planes(words_ptr, row_stride, n, w, mask, NPLANES, BLOCK)
    h = n // 2  # majority: count > h; a tie (even n): count == h
    gt = tl.zeros((BLOCK,), dtype=tl.int32)
    eq = gt - 1
    if NPLANES > 7:
        gt, eq = _compare_plane(gt, eq, p7, 7, h)
    if NPLANES > 6:
        gt, eq = _compare_plane(gt, eq, p6, 6, h)
    if NPLANES > 5:
        gt, eq = _compare_plane(gt, eq, p5, 5, h)
    if NPLANES > 4:
        gt, eq = _compare_plane(gt, eq, p4, 4, h)
    if NPLANES > 3:
        gt, eq = _compare_plane(gt, eq, p3, 3, h)
    if NPLANES > 2:
        gt, eq = _compare_plane(gt, eq, p2, 2, h)
    if NPLANES > 1:
        gt, eq = _compare_plane(gt, eq, p1, 1, h)
    gt, eq = _compare_plane(gt, eq, p0, 0, h)
    if RANDOM_TIES:
        if n % 2 == 0:  # the tie stream's word for these 32 positions: _random_bit's hash of the word index
            r = (w + first_word).to(tl.uint32) * 0x9E3779B1
            r = r ^ key.to(tl.uint32)
            r = r ^ (r >> 16)
            r = r * 0x85EBCA6B
            r = r ^ (r >> 13)
            r = r * 0xC2B2AE35
            r = r ^ (r >> 16)
            gt = gt | (eq & r.to(tl.int32, bitcast=True))
    tl.store(out_ptr + w, gt, mask=mask)


@triton.jit
def _count_words_kernel(words_ptr, out_ptr, n, nwords, row_stride, NPLANES: tl.constexpr, BLOCK: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = w < nwords
    p0, p1, p2, p3, p4, p5, p6, p7 = _count_planes(words_ptr, row_stride, n, w, mask, NPLANES, BLOCK)
    j = tl.arange(0, 32)[None, :]
    count = (p0[:, None] >> j) & 1
    if NPLANES > 1:
        count += ((p1[:, None] >> j) & 1) << 1
    if NPLANES > 2:
        count += ((p2[:, None] >> j) & 1) << 2
    if NPLANES > 3:
        count += ((p3[:, None] >> j) & 1) << 3
    if NPLANES > 4:
        count += ((p4[:, None] >> j) & 1) << 4
    if NPLANES > 5:
        count += ((p5[:, None] >> j) & 1) << 5
    if NPLANES > 6:
        count += ((p6[:, None] >> j) & 1) << 6
    if NPLANES > 7:
        count += ((p7[:, None] >> j) & 1) << 7
    tl.store(out_ptr + w[:, None] * 32 + j, count.to(tl.uint8), mask=mask[:, None])


# -- many tensors per launch: a table of (tensor, first byte or element) chunks; tensors by address --
# A chunk wholly inside its tensor runs without masks (WHOLE), at addresses the compiler is told are
# 16-byte aligned (ALIGNED): then its loads and stores are 16 bytes wide. A mask whose bound comes
# from the table, or an address of unknown alignment, splits every access into 4-byte ones.


@triton.jit
def _lion_pack_chunk(has_grad, g_ptr, m_ptr, out, byte, numel, coef_ptr, key, t, IS_BF16: tl.constexpr,
                     WHOLE: tl.constexpr, BLOCK: tl.constexpr):
    pos = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    inside = pos < numel
    if has_grad:
        g = _load_f32(g_ptr, pos, inside, IS_BF16, WHOLE)
    else:  # no gradient: g = +0.0
        g = tl.zeros((BLOCK, 8), dtype=tl.float32)
    m = _load_f32(m_ptr, pos, inside, IS_BF16, WHOLE)
    beta1, one_minus_beta1 = tl.load(coef_ptr + 4 * t), tl.load(coef_ptr + 4 * t + 1)
    beta2, one_minus_beta2 = tl.load(coef_ptr + 4 * t + 2), tl.load(coef_ptr + 4 * t + 3)
    random = _random_bit(key & 0xFFFFFFFF, pos) != (((key >> 32) & 1) != 0)
    _lion_step_pack(g, m, m_ptr, out, byte, pos, inside, (numel + 7) // 8, random, beta1, one_minus_beta1, beta2,
                    one_minus_beta2, IS_BF16, WHOLE)


@triton.jit
def _lion_pack_many_kernel(chunk_tensor_ptr, chunk_start_ptr, m_addr_ptr, numel_ptr, offset_ptr, g_addr_ptr, key_ptr,
                           coef_ptr, out_ptr, ELEM: tl.constexpr, IS_BF16: tl.constexpr, ALIGNED: tl.constexpr,
                           BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + chunk)
    first = tl.multiple_of(tl.load(chunk_start_ptr + chunk), BLOCK)
    byte = first + tl.arange(0, BLOCK)
    numel = tl.load(numel_ptr + t)
    g_addr = tl.load(g_addr_ptr + t)
    g_ptr, m_ptr = g_addr.to(tl.pointer_type(ELEM)), tl.load(m_addr_ptr + t).to(tl.pointer_type(ELEM))
    if ALIGNED:  # a hint on the pointer: one on the integer address is lost in the cast
        g_ptr, m_ptr = tl.multiple_of(g_ptr, 16), tl.multiple_of(m_ptr, 16)
    key = tl.load(key_ptr + t)  # int64: the stream's key below bit 32, "inverted" at bit 32
    out = out_ptr + tl.load(offset_ptr + t)
    if (first + BLOCK) * 8 <= numel:
        _lion_pack_chunk(g_addr != 0, g_ptr, m_ptr, out, byte, numel, coef_ptr, key, t, IS_BF16, True, BLOCK)
    else:
        _lion_pack_chunk(g_addr != 0, g_ptr, m_ptr, out, byte, numel, coef_ptr, key, t, IS_BF16, False, BLOCK)


@triton.jit
def _apply_chunk(p_ptr, u, offs, row, numel, scale, neg_lr, IS_BF16: tl.constexpr, PACKED: tl.constexpr,
                 WHOLE: tl.constexpr):
    mask = offs < numel
    # scale = 1 (no decay) leaves p exactly as torch's skipped mul_ does
    p = _round_to(_load_f32(p_ptr, offs, mask, IS_BF16, WHOLE) * scale, p_ptr, IS_BF16)
    if PACKED:  # one byte per row of 8 values, read once
        byte = tl.load(u + row, mask=row < (numel + 7) // 8, other=0).to(tl.int32)
        v = (((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1) * 2 - 1).to(tl.float32)
    else:
        v = _load_f32(u, offs, mask, False, WHOLE)
    _store_f32(p_ptr, offs, tl.fma(v, neg_lr, p), mask, IS_BF16, WHOLE)


@triton.jit
def _apply_many_kernel(chunk_tensor_ptr, chunk_start_ptr, p_addr_ptr, numel_ptr, offset_ptr, scalar_ptr, u_ptr,
                       ELEM: tl.constexpr, IS_BF16: tl.constexpr, PACKED: tl.constexpr, ALIGNED: tl.constexpr,
                       BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + chunk)
    first = tl.multiple_of(tl.load(chunk_start_ptr + chunk), BLOCK)
    local = tl.arange(0, BLOCK // 8)
    row = first // 8 + local  # the byte of the tensor's bits that holds each row of 8 values
    offs = first + local[:, None] * 8 + tl.arange(0, 8)[None, :]  # (not row * 8, whose alignment is unknown)
    numel = tl.load(numel_ptr + t)
    p_ptr = tl.load(p_addr_ptr + t).to(tl.pointer_type(ELEM))
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
    scale, neg_lr = tl.load(scalar_ptr + 2 * t), tl.load(scalar_ptr + 2 * t + 1)
    offset = tl.load(offset_ptr + t)
    u = u_ptr + offset if PACKED else u_ptr + 8 * offset
    if first + BLOCK <= numel:
        _apply_chunk(p_ptr, u, offs, row, numel, scale, neg_lr, IS_BF16, PACKED, True)
    else:
        _apply_chunk(p_ptr, u, offs, row, numel, scale, neg_lr, IS_BF16, PACKED, False)


_ELEM = {torch.float32: (tl.float32, False), torch.float16: (tl.float16, False), torch.bfloat16: (tl.int16, True)}


def chunk_table(numels: list[int], block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index, first unit) of every ``block``-sized chunk of every tensor of ``numels`` units."""
    tensor, start = [], []
    for i, n in enumerate(numels):
        firsts = range(0, max(n, 1), block)
        tensor.extend([i] * len(firsts))
        start.extend(firsts)
    return (torch.tensor(tensor, dtype=torch.int64, device=device),
            torch.tensor(start, dtype=torch.int64, device=device))


def lion_pack_many(dtype: torch.dtype, pack_chunks: tuple[torch.Tensor, torch.Tensor], m_addrs: torch.Tensor,
                   numels: torch.Tensor, offsets: torch.Tensor, g_addrs: torch.Tensor, keys: torch.Tensor,
                   coefs: torch.Tensor, out: torch.Tensor, aligned: bool) -> None:
    """Every tensor's direction packed into ``out`` at its offset, momenta updated; tables on the device
    (chunks of PACK_BLOCK bytes; coefs float32 (n, 4) = β1, 1−β1, β2, 1−β2; g_addrs 0 = no gradient);
    ``aligned``: every gradient and momentum address is a multiple of 16."""
    elem, is_bf16 = _ELEM[dtype]
    _lion_pack_many_kernel[(pack_chunks[0].numel(),)](pack_chunks[0], pack_chunks[1], m_addrs, numels, offsets,
                                                      g_addrs, keys, coefs, out, elem, is_bf16, aligned, PACK_BLOCK,
                                                      num_warps=PACK_WARPS)


def apply_many(dtype: torch.dtype, elem_chunks: tuple[torch.Tensor, torch.Tensor], p_addrs: torch.Tensor,
               numels: torch.Tensor, offsets: torch.Tensor, scalars: torch.Tensor, update: torch.Tensor,
               aligned: bool) -> None:
    """θ ← θ·scale − lr·u for every tensor (chunks of ELEM_BLOCK elements; scalars float32 (n, 2) =
    1 − lr·λ, −lr); u packed uint8 at byte offsets, or float32 at 8·offsets; ``aligned``: every
    parameter address is a multiple of 16."""
    elem, is_bf16 = _ELEM[dtype]
    _apply_many_kernel[(elem_chunks[0].numel(),)](elem_chunks[0], elem_chunks[1], p_addrs, numels, offsets, scalars,
                                                  update, elem, is_bf16, update.dtype == torch.uint8, aligned,
                                                  ELEM_BLOCK, num_warps=ELEM_WARPS)


def _grid(count: int, block: int) -> tuple[int]:
    return (triton.cdiv(max(count, 1), block),)


def _as_kernel_arg(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """bf16 travels as its int16 bits (see module docstring)."""
    return (t.view(torch.int16), True) if t.dtype == torch.bfloat16 else (t, False)


def pack_signs(x: torch.Tensor, key: int) -> torch.Tensor:
    view_dtype, pos_limit, mag_mask = _INT_VIEW[x.dtype]
    flat = x.reshape(-1).view(view_dtype)
    nbytes = (flat.numel() + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    _pack_kernel[_grid(nbytes, PACK_BLOCK)](flat, out, flat.numel(), nbytes, key & 0xFFFFFFFF, pos_limit, mag_mask,
                                            bool((key >> 32) & 1), PACK_BLOCK, num_warps=PACK_WARPS)
    return out


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    target, is_bf16 = _as_kernel_arg(out)
    _unpack_kernel[_grid(numel, ELEM_BLOCK)](packed, target, numel, is_bf16, ELEM_BLOCK, num_warps=ELEM_WARPS)
    return out


MAX_WORD_VOTERS = 255  # the word kernels' 8 planes


def _word_rows(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``stack`` as (n, nbytes // 4) int32 words, and its last nbytes % 4 bytes as one zero-padded word
    per row (or None); None when the layout does not allow a word view (then the byte kernels run)."""
    n, nbytes = stack.shape
    if not 0 < n <= MAX_WORD_VOTERS or stack.stride(1) != 1 or stack.stride(0) % 4 or stack.data_ptr() % 4:
        return None
    main = nbytes // 4 * 4
    words = stack[:, :main].view(torch.int32)
    tail = None
    if main < nbytes:
        tail = torch.zeros((n, 4), dtype=torch.uint8, device=stack.device)
        tail[:, : nbytes - main] = stack[:, main:]
        tail = tail.view(torch.int32)
    return words, tail


def vote_counts(stack: torch.Tensor) -> torch.Tensor:
    n, nbytes = stack.shape
    out = torch.empty(nbytes * 8, dtype=torch.uint8 if n < 256 else torch.int16, device=stack.device)
    rows = _word_rows(stack)
    if rows is None:
        _count_kernel[_grid(nbytes, COUNT_BLOCK)](stack, out, n, nbytes, stack.stride(0), COUNT_BLOCK,
                                                  num_warps=COUNT_WARPS)
        return out
    words, tail = rows
    planes, block = n.bit_length(), COUNT_BLOCK // 4
    if words.shape[1]:
        _count_words_kernel[_grid(words.shape[1], block)](words, out, n, words.shape[1], words.stride(0), planes,
                                                          block, num_warps=COUNT_WARPS)
    if tail is not None:
        counts = torch.empty(32, dtype=torch.uint8, device=stack.device)
        _count_words_kernel[(1,)](tail, counts, n, 1, 1, planes, block, num_warps=COUNT_WARPS)
        out[words.shape[1] * 32:] = counts[: nbytes * 8 - words.shape[1] * 32]
    return out


def majority_vote(stack: torch.Tensor, ties: str, key: int) -> torch.Tensor:
    n, nbytes = stack.shape
    out = torch.empty(nbytes, dtype=torch.uint8, device=stack.device)
    rows = _word_rows(stack)
    if rows is None:
        _majority_kernel[_grid(nbytes, COUNT_BLOCK)](stack, out, n, nbytes, stack.stride(0), key, ties == "random",
                                                     COUNT_BLOCK, num_warps=COUNT_WARPS)
        return out
    words, tail = rows
    planes, block, nwords = n.bit_length(), COUNT_BLOCK // 4, words.shape[1]
    if nwords:
        _majority_words_kernel[_grid(nwords, block)](words, out[: nwords * 4].view(torch.int32), n, nwords,
                                                     words.stride(0), 0, key, ties == "random", planes, block,
                                                     num_warps=COUNT_WARPS)
    if tail is not None:
        last = torch.empty(1, dtype=torch.int32, device=stack.device)
        _majority_words_kernel[(1,)](tail, last, n, 1, 1, nwords, key, ties == "random", planes, block,
                                     num_warps=COUNT_WARPS)
        out[nwords * 4:] = last.view(torch.uint8)[: nbytes - nwords * 4]
    return out


def lion_direction_pack(grad: torch.Tensor, exp_avg: torch.Tensor, beta1: float, beta2: float, key: int) -> torch.Tensor:
    g, g_bf16 = _as_kernel_arg(grad.reshape(-1))
    m, m_bf16 = _as_kernel_arg(exp_avg.view(-1))
    numel = g.numel()
    nbytes = (numel + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=grad.device)
    _lion_pack_kernel[_grid(nbytes, PACK_BLOCK)](g, m, out, numel, nbytes, key & 0xFFFFFFFF, beta1, 1 - beta1, beta2,
                                                 1 - beta2, g_bf16, m_bf16, bool((key >> 32) & 1), PACK_BLOCK,
                                                 num_warps=PACK_WARPS)
    return out


def apply_update(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    p, p_bf16 = _as_kernel_arg(param.view(-1))
    numel = p.numel()
    _apply_kernel[_grid(numel, ELEM_BLOCK)](p, update, numel, lr, 1 - lr * weight_decay, update.dtype == torch.uint8,
                                            weight_decay != 0, p_bf16, ELEM_BLOCK, num_warps=ELEM_WARPS)
