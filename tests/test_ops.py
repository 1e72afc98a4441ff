import numpy as np
import pytest
import torch

from lioncub_p2p import ops
from lioncub_p2p.ops import torch_impl

from reference import counts, pack, stream_bits, unpack

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 9, 1003, 70_001]


def _with_zeros(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    x[torch.rand(numel, generator=g) < 0.2] = 0.0
    x[::11] = -0.0
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_pack_signs_matches_numpy_and_zero_stream(dtype, numel):
    x = _with_zeros(numel).to(dtype)
    packed = ops.pack_signs(x, seed=5)
    assert packed.dtype == torch.uint8 and packed.shape == ((numel + 7) // 8,)
    x64 = x.double().numpy()
    zero = x64 == 0
    expected = np.where(zero, stream_bits(ops.zero_sign_key(5), np.arange(numel)), x64 > 0)
    np.testing.assert_array_equal(packed.numpy(), pack(expected))
    # padding bits of the last byte are zero
    assert np.unpackbits(packed.numpy(), bitorder="little")[numel:].sum() == 0


def test_pack_signs_shapes_and_nan():
    x = torch.tensor([[1.0, -1.0, float("nan")], [float("inf"), -float("inf"), 2.0]])
    bits = unpack(ops.pack_signs(x).numpy(), 6)
    np.testing.assert_array_equal(bits, [1, 0, 0, 1, 0, 1])
    assert ops.pack_signs(torch.zeros(0)).numel() == 0


def test_zero_bits_depend_only_on_seed_and_position():
    zeros = torch.zeros(200_000)
    a, b = ops.pack_signs(zeros, seed=1), ops.pack_signs(zeros, seed=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, ops.pack_signs(zeros, seed=2))
    ones = unpack(a.numpy(), 200_000).mean()
    assert abs(ones - 0.5) < 0.01  # unbiased over positions
    # the same zero at the same position gets the same bit whatever the neighbours are
    x = torch.randn(200_000)
    x[1234] = 0.0
    assert unpack(ops.pack_signs(x, seed=1).numpy(), 200_000)[1234] == unpack(a.numpy(), 200_000)[1234]


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_signs_roundtrip(dtype):
    x = torch.randn(1001)
    out = ops.unpack_signs(ops.pack_signs(x), 1001, dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.float().numpy(), np.where(x.numpy() > 0, 1.0, -1.0))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 16, 17, 255, 256, 1024])
def test_vote_counts_matches_numpy(n):
    stack = torch.randint(0, 256, (n, 45), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    got = ops.vote_counts(stack)
    assert got.shape == (45 * 8,)
    assert got.dtype == (torch.uint8 if n < 256 else torch.int16)
    np.testing.assert_array_equal(got.numpy().astype(np.int64), counts(stack.numpy()))


def test_vote_counts_all_ones_extreme():
    stack = torch.full((1024, 9), 255, dtype=torch.uint8)
    assert (ops.vote_counts(stack) == 1024).all()


def test_vote_counts_spans_several_blocks():
    nbytes = ops.bitslice._stack_block(5) * 2 + 13
    stack = torch.randint(0, 256, (5, nbytes), dtype=torch.uint8)
    np.testing.assert_array_equal(ops.vote_counts(stack).numpy(), counts(stack.numpy()))


@pytest.mark.parametrize("n", [1, 3, 5, 15])
def test_majority_vote_odd(n):
    stack = torch.randint(0, 256, (n, 33), dtype=torch.uint8)
    expected = pack(counts(stack.numpy()) * 2 > n)
    np.testing.assert_array_equal(ops.majority_vote(stack).numpy(), expected)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_majority_vote_even_ties(n):
    nbytes = 4096
    stack = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8)
    c = counts(stack.numpy())
    tie = c * 2 == n
    stream = stream_bits(ops.tie_key(9, 3), np.arange(nbytes * 8))
    got = unpack(ops.majority_vote(stack, seed=9, step=3).numpy(), nbytes * 8)
    np.testing.assert_array_equal(got, np.where(tie, stream, c * 2 > n))
    assert abs(got[tie].mean() - 0.5) < 0.05  # ties split evenly
    other_step = unpack(ops.majority_vote(stack, seed=9, step=4).numpy(), nbytes * 8)
    assert (other_step[tie] != got[tie]).mean() > 0.3  # a new draw each step
    np.testing.assert_array_equal(other_step[~tie], got[~tie])
    zero_ties = unpack(ops.majority_vote(stack, ties="zero").numpy(), nbytes * 8)
    np.testing.assert_array_equal(zero_ties, c * 2 > n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lion_direction_pack_matches_formula(dtype):
    g = torch.randn(1003).to(dtype)
    m = torch.randn(1003).to(dtype)
    m[:50] = 0
    g[:50] = 0  # c == 0 exactly there
    m0 = m.clone()
    packed = ops.lion_direction_pack(g, m, 0.9, 0.99, seed=4)
    gd, md = g.double().numpy(), m0.double().numpy()
    c = 0.9 * md + 0.1 * gd
    expected = np.where(c == 0, stream_bits(ops.zero_sign_key(4), np.arange(1003)), c > 0)
    got = unpack(packed.numpy(), 1003)
    near_zero = (np.abs(c) < 1e-2 * np.abs(md).max()) & (c != 0)  # rounding of 16-bit inputs may flip these
    np.testing.assert_array_equal(got[~near_zero], expected[~near_zero])
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(m.double().numpy(), 0.99 * md + 0.01 * gd, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_update_packed_and_float(dtype):
    p = torch.randn(1003).to(dtype)
    p0 = p.double().numpy().copy()
    bits = torch.randint(0, 256, (126,), dtype=torch.uint8)
    ops.apply_update(p, bits, 1e-2, 0.5)
    u = np.where(unpack(bits.numpy(), 1003), 1.0, -1.0)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(p.double().numpy(), p0 * (1 - 1e-2 * 0.5) - 1e-2 * u, atol=tol, rtol=tol)
    uf = torch.rand(1003) * 2 - 1
    p1 = p.double().numpy().copy()
    ops.apply_update(p, uf, 1e-2, 0.0)
    np.testing.assert_allclose(p.double().numpy(), p1 - 1e-2 * uf.double().numpy(), atol=tol, rtol=tol)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="uint8"):
        ops.vote_counts(torch.zeros((3, 4), dtype=torch.int32))
    with pytest.raises(ValueError, match="n = 0"):
        ops.vote_counts(torch.zeros((0, 4), dtype=torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        ops.majority_vote(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="ties"):
        ops.majority_vote(torch.zeros((2, 4), dtype=torch.uint8), ties="coin")
    with pytest.raises(TypeError, match="dtype"):
        ops.pack_signs(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="too short"):
        ops.unpack_signs(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(ValueError, match="too long"):
        ops.unpack_signs(torch.zeros(4, dtype=torch.uint8), 17)
    with pytest.raises(ValueError, match="shape"):
        ops.lion_direction_pack(torch.zeros(8), torch.zeros(9), 0.9, 0.99)
    with pytest.raises(ValueError, match="too short"):
        ops.apply_update(torch.zeros(17), torch.zeros(2, dtype=torch.uint8), 0.1, 0.0)
    with pytest.raises(ValueError, match="float update"):
        ops.apply_update(torch.zeros(17), torch.zeros(16), 0.1, 0.0)
    with pytest.raises(TypeError, match="update"):
        ops.apply_update(torch.zeros(16), torch.zeros(16, dtype=torch.int32), 0.1, 0.0)


def test_random_tie_bits_offset_is_a_window_of_the_stream():
    whole = ops.random_tie_bits(1, 2, 64)
    assert torch.equal(ops.random_tie_bits(1, 2, 24, offset=40), whole[40:])
