"""The Triton kernels produce the same bytes as the torch path.

On a machine without CUDA they run through ``TRITON_INTERPRET=1`` (set in conftest.py) on CPU
tensors; bf16 is passed to them as raw int16 bits, so the interpreter's bf16 trap does not apply,
and the bf16 cases compare against the torch path and, for signs, against numpy."""
import os

import numpy as np
import pytest
import torch

from lioncub_p2p.ops import step_zero_keys, tie_key, torch_impl, triton_impl, zero_sign_key
from lioncub_p2p.ops.multi_tensor import _TritonBatch

from reference import pack

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _gen(seed: int) -> torch.Generator:
    """Every random input comes from a seeded generator, so a failure reproduces."""
    return torch.Generator().manual_seed(seed)


def _x(numel: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(numel, generator=_gen(numel))
    x[::5] = 0.0
    x[::13] = -0.0
    x[7::50] = float("nan")
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 9, 4099])
def test_pack_signs_same_bytes(dtype, numel):
    x = _x(numel, dtype)
    got = triton_impl.pack_signs(x, zero_sign_key(3)).cpu()
    assert torch.equal(got, torch_impl.pack_signs(x.cpu(), zero_sign_key(3)))
    nonzero = (x.cpu().float() != 0).numpy()
    got_bits = np.unpackbits(got.numpy(), bitorder="little")[:numel]
    np.testing.assert_array_equal(got_bits[nonzero], (x.cpu().float().numpy() > 0)[nonzero])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1037, 8195])
def test_unpack_same_values(dtype, numel):
    packed = torch.randint(0, 256, ((numel + 7) // 8,), dtype=torch.uint8, generator=_gen(2))
    got = triton_impl.unpack_signs(packed.to(DEVICE), numel, dtype).cpu()
    assert torch.equal(got, torch_impl.unpack_signs(packed, numel, dtype))


@pytest.mark.parametrize("n", [1, 2, 4, 7, 16, 254, 255, 256])
@pytest.mark.parametrize("layout", ["words", "tail", "misaligned"])
def test_counts_and_majority_same_bytes(n, layout):
    """Up to 255 voters the word kernels count bit-sliced (1 to 8 planes; 254: ties at a count of 127),
    over a whole number of words, a zero-padded last word ("tail"), or rows that do not start on a
    word (the byte kernels, as for 256 voters); the bytes equal the torch path's and numpy's counts."""
    nbytes = {"words": 300, "tail": 301, "misaligned": 300}[layout]
    full = torch.randint(0, 256, (n, 308), dtype=torch.uint8, generator=_gen(3 + n))  # rows 4-byte aligned
    first = 1 if layout == "misaligned" else 0
    stack, dev = full[:, first:first + nbytes], full.to(DEVICE)[:, first:first + nbytes]
    assert (triton_impl._word_rows(dev) is None) == (layout == "misaligned" or n > 255)
    counts = triton_impl.vote_counts(dev).cpu()
    assert torch.equal(counts, torch_impl.vote_counts(stack))
    np.testing.assert_array_equal(counts.numpy(), np.unpackbits(stack.numpy(), axis=1, bitorder="little").sum(0))
    for ties in ("random", "zero"):
        got = triton_impl.majority_vote(dev, ties, tie_key(1, 2)).cpu()
        assert torch.equal(got, torch_impl.majority_vote(stack, ties, tie_key(1, 2)))
    expected = np.packbits(2 * counts.numpy().astype(np.int64) > n, bitorder="little")
    np.testing.assert_array_equal(triton_impl.majority_vote(dev, "zero", 0).cpu().numpy(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [2051, 8195])  # a whole program and a tail of the pack and apply kernels
def test_fused_lion_and_apply_same_bytes(dtype, numel):
    gen = _gen(4)
    g, m = torch.randn(numel, generator=gen).to(dtype), torch.randn(numel, generator=gen).to(dtype)
    g[:100], m[:100] = 0, 0
    m_ref, m_dev = m.clone(), m.clone().to(DEVICE)
    key = zero_sign_key(8) | 1 << 32  # an odd step's key: its zero signs inverted
    packed = triton_impl.lion_direction_pack(g.to(DEVICE), m_dev, 0.9, 0.99, key).cpu()
    assert torch.equal(packed, torch_impl.lion_direction_pack(g, m_ref, 0.9, 0.99, key))
    assert torch.equal(m_dev.cpu(), m_ref)
    for update in (packed, torch.rand(numel, generator=gen) * 2 - 1):
        p_ref = torch.randn(numel, generator=gen).to(dtype)
        p_dev = p_ref.clone().to(DEVICE)
        triton_impl.apply_update(p_dev, update.to(DEVICE), 3e-3, 0.1)
        torch_impl.apply_update(p_ref, update, 3e-3, 0.1)
        assert torch.equal(p_dev.cpu(), p_ref)


def test_bf16_signs_are_not_read_as_raw_integers():
    """The interpreter trap: every nonzero bf16 read as a positive integer would give all ones."""
    x = torch.tensor([-1.0, -2.0, 3.0, -0.5, 0.25, -8.0, 1.0, -1e-3], dtype=torch.bfloat16).to(DEVICE)
    got = triton_impl.pack_signs(x, zero_sign_key(0)).cpu().numpy()
    np.testing.assert_array_equal(got, pack(x.cpu().float().numpy() > 0))


def _at(t: torch.Tensor, misalign: int) -> torch.Tensor:
    """``t`` on DEVICE, ``misalign`` elements past the start of its storage (0: 16-byte aligned)."""
    room = torch.empty(t.numel() + misalign, dtype=t.dtype, device=DEVICE)
    view = room[misalign:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("misalign", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_tensor_kernels_same_bytes(dtype, misalign):
    """One launch over a table of tensors (odd sizes, empty, no gradient, exact zeros, chunks wholly
    inside a tensor and its last, addresses 16-byte aligned or not) gives the bytes, momenta and
    parameters of the per-tensor torch path."""
    gen = _gen(5)
    whole = 8 * max(triton_impl.PACK_BLOCK, triton_impl.ELEM_BLOCK)  # elements of two whole chunks or more
    shapes = [(3,), (17,), (5, 7), (4099,), (0,), (1,), (1030,), (whole + 13,)]
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    moms = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads[1] = None
    grads[3][:100], moms[3][:100] = 0, 0
    nbytes = [(p.numel() + 7) // 8 for p in params]
    offsets = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    keys = step_zero_keys(3, 5, len(shapes))  # an odd step: bit 32 of every key set
    betas = np.array([0.9, 0.8, 0.9, 0.95, 0.9, 0.9, 0.5, 0.9]), np.full(len(shapes), 0.99)
    expected = torch.empty(sum(nbytes), dtype=torch.uint8)
    expected_moms = [m.clone() for m in moms]
    for i, (g, m) in enumerate(zip(grads, expected_moms)):
        bits = torch_impl.lion_direction_pack(g if g is not None else torch.zeros_like(m), m, float(betas[0][i]),
                                              float(betas[1][i]), int(keys[i]))
        expected[offsets[i] : offsets[i] + nbytes[i]] = bits
    dev = lambda ts: [_at(t, misalign) if t is not None else None for t in ts]  # noqa: E731
    batch = _TritonBatch(list(range(len(shapes))), dev(params), dev(moms), offsets)
    out = torch.empty(sum(nbytes), dtype=torch.uint8, device=DEVICE)
    assert batch.m_aligned == batch.p_aligned == (misalign == 0)
    batch.direction_pack(dev(grads), torch_impl.coefficients(*betas), keys, out)
    assert torch.equal(out.cpu(), expected)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(batch.momenta, expected_moms))
    lr, wd = np.array([1e-2, 3e-3, 1e-2, 1e-2, 1e-2, 1e-2, 5e-2, 1e-2]), np.array([0.1, 0.0, 0.1, 0.1, 0.1, 0.1, 0.3, 0])
    for update in (expected, torch.rand(8 * sum(nbytes), generator=gen) * 2 - 1):
        ref = [p.cpu().clone() for p in batch.params]
        batch.apply(update.to(DEVICE), torch_impl.apply_scalars(lr, wd))
        for i, p in enumerate(ref):
            start = int(offsets[i])
            u = update[start : start + nbytes[i]] if update.dtype == torch.uint8 else \
                update[8 * start : 8 * start + p.numel()]
            torch_impl.apply_update(p.view(-1), u, float(lr[i]), float(wd[i]))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(batch.params, ref))
