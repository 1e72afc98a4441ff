import numpy as np
import pytest
import torch

from lioncub_p2p import ops
from lioncub_p2p.ops import dispatch, multi_tensor, numba_impl, torch_impl
from lioncub_p2p.ops.randbits import derive_key, derive_keys_numpy

from reference import counts, pack, stream_bits, unpack

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 9, 1003, 70_001]


def _gen(seed: int) -> torch.Generator:
    """Every random input comes from a seeded generator, so a failure reproduces."""
    return torch.Generator().manual_seed(seed)


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
    x = torch.randn(200_000, generator=_gen(11))
    x[1234] = 0.0
    assert unpack(ops.pack_signs(x, seed=1).numpy(), 200_000)[1234] == unpack(a.numpy(), 200_000)[1234]


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_signs_roundtrip(dtype):
    x = torch.randn(1001, generator=_gen(12))
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
    stack = torch.randint(0, 256, (5, nbytes), dtype=torch.uint8, generator=_gen(13))
    np.testing.assert_array_equal(ops.vote_counts(stack).numpy(), counts(stack.numpy()))


@pytest.mark.parametrize("n", [1, 3, 5, 15])
def test_majority_vote_odd(n):
    stack = torch.randint(0, 256, (n, 33), dtype=torch.uint8, generator=_gen(14 + n))
    expected = pack(counts(stack.numpy()) * 2 > n)
    np.testing.assert_array_equal(ops.majority_vote(stack).numpy(), expected)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_majority_vote_even_ties(n):
    nbytes = 4096
    stack = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=_gen(40 + n))
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
    gen = _gen(15)
    g = torch.randn(1003, generator=gen).to(dtype)
    m = torch.randn(1003, generator=gen).to(dtype)
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
    gen = _gen(16)
    p = torch.randn(1003, generator=gen).to(dtype)
    p0 = p.double().numpy().copy()
    bits = torch.randint(0, 256, (126,), dtype=torch.uint8, generator=gen)
    ops.apply_update(p, bits, 1e-2, 0.5)
    u = np.where(unpack(bits.numpy(), 1003), 1.0, -1.0)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(p.double().numpy(), p0 * (1 - 1e-2 * 0.5) - 1e-2 * u, atol=tol, rtol=tol)
    uf = torch.rand(1003, generator=gen) * 2 - 1
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


# -- the one-pass kernels: numba on CPU, many tensors per call (LionKernels) ---------------------------


def _np_direction(g: np.ndarray, m: np.ndarray, beta1: float, beta2: float) -> tuple[np.ndarray, np.ndarray]:
    """Independent reference in float64: c = (1−β1)·g + f32(β1·m) with β1, 1−β1 rounded to float32 as
    torch rounds scalars. A product of two float32 is exact in float64, so c's sign (and c == 0) is the
    fused multiply-add's; the new momentum is rounded twice, so it may differ by one ulp."""
    b1, a1, b2, a2 = (np.float32(v) for v in (beta1, 1 - beta1, beta2, 1 - beta2))
    g32, m32 = g.astype(np.float32), m.astype(np.float32)
    c = g32.astype(np.float64) * np.float64(a1) + (m32 * b1).astype(np.float64)
    m_new = (g32.astype(np.float64) * np.float64(a2) + (m32 * b2).astype(np.float64)).astype(np.float32)
    return c, m_new


def _cancel(g: torch.Tensor, m: torch.Tensor, beta1: float, every: int = 13) -> None:
    """Make (1−β1)·g ≈ −β1·m at every ``every``-th element: there the sign of c depends on c being
    computed with one rounding (fused multiply-add), as torch does, not two."""
    b1, a1 = np.float32(beta1), np.float32(1 - beta1)
    gv, mv = g.view(-1)[::every], m.view(-1)[::every].float().numpy()
    gv.copy_(torch.from_numpy(-(mv * b1) / a1).to(g.dtype))


def _np_bits(c: np.ndarray, key: int) -> np.ndarray:
    return np.where(c == 0, stream_bits(key, np.arange(c.size)), c > 0)


def _np_apply_packed(p: np.ndarray, bits: np.ndarray, lr: float, wd: float) -> np.ndarray:
    """θ·f32(1 − lr·λ) then ∓ f32(lr), all in float32: the rounding torch's mul_ and add_(±1, alpha) give."""
    scale, lr32 = np.float32(1 - lr * wd), np.float32(lr)
    p = p.astype(np.float32) * scale if wd else p.astype(np.float32)
    return p + np.where(bits, -lr32, lr32)


def test_zero_sign_keys_match_derive_key():
    for parts in [(0, 0), (7, 123), (-5, 2**40 + 3), (2**63 - 1, 1)]:
        expected = [ops.zero_sign_key(derive_key(*parts, i)) for i in range(300)]
        np.testing.assert_array_equal(ops.zero_sign_keys(parts, 300), expected)
        np.testing.assert_array_equal(derive_keys_numpy(parts, 300, outer=(1,)), expected)
        np.testing.assert_array_equal(numba_impl.derive_keys(parts, 300, outer=(1,)), expected)


@pytest.mark.parametrize("numel", SIZES)
def test_numba_kernels_match_torch_path_and_numpy(numel):
    gen = _gen(100 + numel)
    g, m = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    zeros = torch.rand(numel, generator=gen) < 0.1
    g[zeros], m[zeros] = 0.0, 0.0
    m[::7] = -0.0
    _cancel(g, m, 0.9)
    key = ops.zero_sign_key(9)
    c, m_ref = _np_direction(g.numpy(), m.numpy(), 0.9, 0.99)
    m_torch = m.clone()
    packed = numba_impl.lion_direction_pack(g, m, 0.9, 0.99, key)
    np.testing.assert_array_equal(packed.numpy(), pack(_np_bits(c, key)))
    assert torch.equal(packed, torch_impl.lion_direction_pack(g, m_torch, 0.9, 0.99, key))
    assert torch.equal(m, m_torch)  # bitwise, -0.0 included
    np.testing.assert_allclose(m.numpy(), m_ref, rtol=2**-23, atol=0)
    # pack_signs: NaN -> 0, ±inf, ±0 from the stream
    x = torch.randn(numel, generator=gen)
    x[zeros] = 0.0
    x[1::5] = -0.0
    x[2::9], x[3::11], x[4::13] = float("nan"), float("inf"), -float("inf")
    x64 = x.double().numpy()
    expected = np.where(x64 == 0, stream_bits(key, np.arange(numel)), x64 > 0)
    np.testing.assert_array_equal(numba_impl.pack_signs(x, key).numpy(), pack(expected))
    # apply: packed and float updates, with and without decay, bitwise equal to the torch path
    for wd in (0.0, 0.3):
        p = torch.randn(numel, generator=gen)
        p_torch = p.clone()
        expected = _np_apply_packed(p.numpy(), unpack(packed.numpy(), numel), 1e-2, wd)
        numba_impl.apply_update(p, packed, 1e-2, wd)
        torch_impl.apply_update(p_torch, packed, 1e-2, wd)
        assert torch.equal(p, p_torch)
        np.testing.assert_array_equal(p.numpy(), expected)
        u = torch.rand(numel, generator=gen) * 2 - 1
        p0 = p.numpy().astype(np.float64)
        numba_impl.apply_update(p, u, 3e-3, wd)
        torch_impl.apply_update(p_torch, u, 3e-3, wd)
        assert torch.equal(p, p_torch)
        np.testing.assert_allclose(p.numpy(), p0 * (1 - 3e-3 * wd) - 3e-3 * u.numpy(), rtol=1e-6, atol=1e-9)
    assert torch.equal(numba_impl.unpack_signs(packed, numel, torch.float32),
                       torch.from_numpy(np.where(unpack(packed.numpy(), numel), 1.0, -1.0).astype(np.float32)))


def _model_tensors(seed: int, dtypes=(torch.float32,), with_zeros: float = 0.05):
    """Random shapes (odd sizes, 0, 1, 2-D), gradients with exact zeros where the momentum is zero too,
    some gradients missing; offsets laid out as the optimizer does."""
    gen = _gen(seed)
    shapes = [(1,), (0,), (7,), (9,), (3, 5), (1003,), (64, 33), (8,), (2, 2, 3)]
    shapes += [(int(n),) for n in torch.randint(1, 300, (40,), generator=gen)]
    params, moms, grads = [], [], []
    for i, shape in enumerate(shapes):
        dtype = dtypes[i % len(dtypes)]
        p, m, g = (torch.randn(shape, generator=gen) for _ in range(3))
        zero = torch.rand(shape, generator=gen) < with_zeros
        m[zero], g[zero] = 0.0, 0.0
        _cancel(g, m, 0.9 if i % 2 == 0 else 0.8)  # the betas of the group LionKernels tests put tensor i in
        params.append(p.to(dtype))
        moms.append(m.to(dtype))
        grads.append(None if i % 11 == 3 else g.to(dtype))
    nbytes = [(p.numel() + 7) // 8 for p in params]
    offsets = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    return params, moms, grads, offsets, sum(nbytes)


def _reference_pack(params, moms, grads, offsets, nbytes, betas, group_index, keys):
    out = torch.zeros(nbytes, dtype=torch.uint8)
    moms = [m.clone() for m in moms]
    for i, (p, m, g) in enumerate(zip(params, moms, grads)):
        b1, b2 = betas[group_index[i]]
        bits = torch_impl.lion_direction_pack(g if g is not None else torch.zeros_like(p), m, b1, b2, int(keys[i]))
        out[offsets[i] : offsets[i] + bits.numel()] = bits
    return out, moms


def _reference_apply(params, update, offsets, lrs, wds, group_index):
    params = [p.clone() for p in params]
    for i, p in enumerate(params):
        lr, wd = lrs[group_index[i]], wds[group_index[i]]
        start = int(offsets[i])
        u = update[start : start + (p.numel() + 7) // 8] if update.dtype == torch.uint8 else \
            update[8 * start : 8 * start + p.numel()]
        flat = p.contiguous().view(-1)
        torch_impl.apply_update(flat, u, lr, wd)
        p.copy_(flat.view(p.shape))
    return params


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("seed", [1, 2])
def test_lion_kernels_match_the_per_tensor_path_and_numpy(dtypes, seed):
    params, moms, grads, offsets, nbytes = _model_tensors(seed, dtypes)
    for i in (4, 6):  # non-contiguous parameters (and gradients), contiguous momenta as the optimizer makes them
        params[i], moms[i] = params[i].t(), moms[i].t().contiguous()
        grads[i] = grads[i].t() if grads[i] is not None else None
    group_index = [i % 2 for i in range(len(params))]
    betas, lrs, wds = [(0.9, 0.99), (0.8, 0.95)], [1e-2, 3e-3], [0.0, 0.5]
    keys = ops.step_zero_keys(seed, 17 + seed, len(params))  # seed 2: an odd step, its zero signs inverted
    expected, expected_moms = _reference_pack(params, moms, grads, offsets, nbytes, betas, group_index, keys)

    kernel_moms = [m.clone() for m in moms]
    kernels = ops.LionKernels(params, kernel_moms, offsets, group_index)
    assert len(kernels.batches) == 1 and 0 < len(kernels.rest) < len(params)  # one numba call + the rest
    out = torch.empty(nbytes, dtype=torch.uint8)
    kernels.direction_pack(grads, betas, keys, out)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(kernel_moms, expected_moms))
    for i, (p, m, g) in enumerate(zip(params, moms, grads)):  # independent check of the float32 tensors
        if p.dtype == torch.float32:
            b1, b2 = betas[group_index[i]]
            gg = g.reshape(-1).numpy() if g is not None else np.zeros(p.numel(), np.float32)
            c, _ = _np_direction(gg, m.reshape(-1).numpy(), b1, b2)
            got = unpack(out[offsets[i] : offsets[i] + (p.numel() + 7) // 8].numpy(), p.numel())
            np.testing.assert_array_equal(got, _np_bits(c, int(keys[i])))

    for update in (out, torch.rand(8 * nbytes, generator=_gen(seed)) * 2 - 1):
        expected_params = _reference_apply(params, update, offsets, lrs, wds, group_index)
        kernels.apply(update, lrs, wds)
        assert all(torch.equal(a, b) for a, b in zip(params, expected_params))


def test_lion_kernels_many_small_tensors_and_zero_heavy_buffers():
    """200 small tensors and a 1M-element one of which 1% are exact zeros, some in runs."""
    gen = _gen(5)
    params = [torch.randn(int(n), generator=gen) for n in torch.randint(1, 2000, (200,), generator=gen)]
    params.append(torch.randn(1 << 20, generator=gen))
    moms = [torch.randn(p.shape, generator=gen) for p in params]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for m, g in zip(moms, grads):
        zero = torch.rand(m.shape, generator=gen) < 0.01
        m[zero], g[zero] = 0.0, 0.0
    moms[-1][5000:9000], grads[-1][5000:9000] = 0.0, 0.0
    nbytes = [(p.numel() + 7) // 8 for p in params]
    offsets = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    keys = ops.zero_sign_keys((3, 4), len(params))
    out = torch.empty(sum(nbytes), dtype=torch.uint8)
    m0 = [m.clone() for m in moms]
    ops.LionKernels(params, moms, offsets).direction_pack(grads, [(0.9, 0.99)], keys, out)
    expected = np.concatenate([pack(_np_bits(_np_direction(g.numpy(), m.numpy(), 0.9, 0.99)[0], int(k)))
                               for g, m, k in zip(grads, m0, keys)])
    np.testing.assert_array_equal(out.numpy(), expected)


def test_lion_kernels_follow_a_replaced_parameter_storage():
    p = torch.nn.Parameter(torch.ones(20))
    kernels = ops.LionKernels([p], [torch.zeros(20)], [0])
    old = p.data
    p.data = torch.full((20,), 2.0)
    kernels.apply(torch.full((3,), 255, dtype=torch.uint8), [0.5], [0.0])
    assert torch.equal(p.data, torch.full((20,), 1.5))  # the new storage took the step
    assert torch.equal(old, torch.ones(20))  # the old one was left alone


def test_lion_kernels_without_numba_use_the_reference_path(monkeypatch):
    """The torch fallback (no numba, or LIONCUB_KERNELS=torch) gives the same bytes, tensor by tensor."""
    params, moms, grads, offsets, nbytes = _model_tensors(9)
    keys = ops.zero_sign_keys((1, 2), len(params))
    expected, expected_moms = _reference_pack(params, moms, grads, offsets, nbytes, [(0.9, 0.99)],
                                              [0] * len(params), keys)
    monkeypatch.setattr(multi_tensor, "numba_impl", lambda: None)
    monkeypatch.setattr(dispatch, "numba_impl", lambda: None)
    kernels = ops.LionKernels(params, moms, offsets)
    assert not kernels.batches and len(kernels.rest) == len(params)
    out = torch.empty(nbytes, dtype=torch.uint8)
    kernels.direction_pack(grads, [(0.9, 0.99)], keys, out)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(moms, expected_moms))


def test_lion_kernels_bad_arguments():
    """Anything that would make a kernel read or write outside a tensor is refused first."""
    with pytest.raises(ValueError, match="one momentum"):
        ops.LionKernels([torch.zeros(3)], [], [0])
    with pytest.raises(ValueError, match="momentum of shape"):
        ops.LionKernels([torch.zeros(3)], [torch.zeros(4)], [0])
    kernels = ops.LionKernels([torch.zeros(3), torch.zeros(17)], [torch.zeros(3), torch.zeros(17)], [0, 1])
    keys = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="uint8"):
        kernels.direction_pack([None, None], [(0.9, 0.99)], keys, torch.zeros(4))
    with pytest.raises(ValueError, match=">= 4 bytes"):
        kernels.direction_pack([None, None], [(0.9, 0.99)], keys, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one gradient"):
        kernels.direction_pack([None], [(0.9, 0.99)], keys, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one key"):
        kernels.direction_pack([None, None], [(0.9, 0.99)], keys[:1], torch.zeros(4, dtype=torch.uint8))
    for grads in ([None, torch.zeros(16)], [torch.zeros(3), torch.zeros(16)]):  # with and without a missing one
        with pytest.raises(ValueError, match="does not fit"):
            kernels.direction_pack(grads, [(0.9, 0.99)], keys, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.direction_pack([None, torch.zeros(17, dtype=torch.float64)], [(0.9, 0.99)], keys,
                               torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float32"):
        kernels.apply(torch.zeros(32, dtype=torch.int32), [0.1], [0.0])
    with pytest.raises(ValueError, match="at least 4"):
        kernels.apply(torch.zeros(3, dtype=torch.uint8), [0.1], [0.0])
    with pytest.raises(ValueError, match="at least 25"):
        kernels.apply(torch.zeros(24), [0.1], [0.0])


def test_lion_kernels_copy_a_non_contiguous_gradient_first():
    gen = _gen(21)
    params = [torch.randn(6, 5, generator=gen), torch.randn(9, generator=gen)]
    moms = [torch.randn(6, 5, generator=gen), torch.randn(9, generator=gen)]
    grads = [torch.randn(5, 6, generator=gen).t(), torch.randn(9, generator=gen)]  # every gradient present
    keys = ops.zero_sign_keys((0, 1), 2)
    expected, expected_moms = _reference_pack(params, moms, grads, [0, 4], 6, [(0.9, 0.99)], [0, 0], keys)
    out = torch.empty(6, dtype=torch.uint8)
    ops.LionKernels(params, moms, [0, 4]).direction_pack(grads, [(0.9, 0.99)], keys, out)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(moms, expected_moms))


def test_lioncub_kernels_torch_forces_the_reference_path(monkeypatch):
    try:
        monkeypatch.setenv("LIONCUB_KERNELS", "torch")
        dispatch.numba_impl.cache_clear()
        dispatch.triton_impl.cache_clear()
        assert dispatch.impl_for(torch.zeros(3)) is torch_impl
        monkeypatch.delenv("LIONCUB_KERNELS")
        dispatch.numba_impl.cache_clear()
        assert dispatch.impl_for(torch.zeros(3)) is numba_impl
    finally:
        monkeypatch.delenv("LIONCUB_KERNELS", raising=False)
        dispatch.numba_impl.cache_clear()
        dispatch.triton_impl.cache_clear()
