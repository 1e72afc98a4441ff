"""Every codec decode against an independent numpy vote, odd and even n, sizes not multiples of 8."""
import numpy as np
import pytest
import torch

from lioncub_p2p import ops
from lioncub_p2p.codecs import (Fp8Upload, L1Upload, MajorityResult, MeanResult, SignUpload, Tally, TernaryResult, reduce_votes,
                                result_codec, upload_codec, wire_bits_per_element)

from reference import from_fp8_blocks, stream_bits, unpack
from reference import fp8_blocks as ref_fp8_blocks

NUMELS = [13, 1001]


def _directions(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        c = torch.randn(numel, generator=g)
        c[torch.rand(numel, generator=g) < 0.05] = 0.0
        out.append(c)
    return out


def _numpy_votes(codec, cs: list[torch.Tensor]) -> np.ndarray:
    """Each voter's signed vote value per element, computed from the spec with numpy."""
    votes = []
    for i, c in enumerate(cs):
        x = c.double().numpy()
        if isinstance(codec, SignUpload):
            zero_bits = stream_bits(ops.zero_sign_key(i), np.arange(len(x)))
            votes.append(np.where(x == 0, np.where(zero_bits, 1, -1), np.sign(x)))
        else:
            s = 2 ** (codec.bits - 1) - 1
            scale = np.abs(x).mean()
            votes.append(np.clip(np.round(x / scale * s / 2), -s, s))
    return np.stack(votes)


@pytest.mark.parametrize("upload", ["sign", "l1:2", "l1:4", "l1:8"])
@pytest.mark.parametrize("result", ["majority", "ternary", "mean"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", NUMELS)
def test_reduce_and_decode_match_numpy(upload, result, n, numel):
    up, res = upload_codec(upload), result_codec(result)
    cs = _directions(n, numel, seed=n * 31 + numel)
    uploads = [up.encode(c, seed=i) for i, c in enumerate(cs)]
    assert uploads[0].shape == (up.planes, (numel + 7) // 8)
    wire = reduce_votes(uploads, up, res, numel=numel, seed=3, step=5)
    total = n * up.max_code
    assert wire.numel() == res.wire_size(numel, total)
    decoded = res.decode(wire, numel, total)

    vote_sum = _numpy_votes(up, cs).sum(0)  # Σ q; the tally is T = Σ q + n·s, total = 2·n·s
    scale = 1 if isinstance(up, SignUpload) else up.scale_steps
    if result == "mean":
        np.testing.assert_allclose(decoded.numpy(), vote_sum / (n * scale), rtol=0, atol=1e-6)
        return
    sign = np.sign(vote_sum)
    if result == "ternary":
        np.testing.assert_array_equal(decoded.numpy(), sign)
        return
    tie_bits = stream_bits(ops.tie_key(3, 5), np.arange(numel))
    expected = np.where(sign == 0, tie_bits, sign > 0)
    np.testing.assert_array_equal(unpack(decoded.numpy(), numel), expected)


def test_l1_sums_exactly_beyond_int8_headroom():
    """n = 200 voters of 8-bit codes: Σ codes reaches 200·254 = 50,800, far past int8; exact."""
    up = L1Upload(8)
    codes = torch.randint(0, up.max_code + 1, (200, 40), generator=torch.Generator().manual_seed(0))
    from lioncub_p2p.codecs import pack_planes, tally_of, unpack_planes
    planes = tally_of(up, [pack_planes(c, 8) for c in codes])
    np.testing.assert_array_equal(unpack_planes(planes, 40).numpy().astype(np.int64), codes.sum(0).numpy())


def test_tally_add_subtract_chunks_and_clip():
    up = L1Upload(3)  # s = 3, codes 0..6, code 7 is invalid and clipped to 6
    from lioncub_p2p.codecs import pack_planes, unpack_planes
    numel = 130
    codes = [torch.randint(0, 8, (numel,), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    tally = Tally(up, (numel + 7) // 8, max_voters=5)
    for c in codes:
        planes = pack_planes(c, 3)
        tally.add(planes[:, :8], 0)
        tally.add(planes[:, 8:], 8)
    tally.subtract(pack_planes(codes[2], 3))
    expected = sum(c.clamp(max=6) for i, c in enumerate(codes) if i != 2)
    np.testing.assert_array_equal(unpack_planes(tally.planes(), numel).numpy(), expected.numpy())
    with pytest.raises(ValueError, match="8-aligned"):
        tally.add(pack_planes(codes[0][:16], 3), 4)


def test_bits_per_element():
    assert wire_bits_per_element(SignUpload(), MajorityResult(), 16) == 2.0
    assert TernaryResult().bits_per_element(4) == 1.6
    assert MeanResult().bits_per_element(4) == 3  # counts 0..4
    assert MeanResult().bits_per_element(7) == 3
    assert L1Upload(4).bits_per_element == 4
    assert TernaryResult().wire_size(11, 4) == 3  # ceil(11/5)


def test_decode_rejects_bad_wire():
    with pytest.raises(ValueError, match="bytes"):
        MajorityResult().decode(torch.zeros(3, dtype=torch.uint8), 40, 4)
    with pytest.raises(ValueError, match="243"):
        TernaryResult().decode(torch.full((2,), 250, dtype=torch.uint8), 10, 4)
    with pytest.raises(ValueError, match="above its total"):
        MeanResult().decode(torch.full((6,), 255, dtype=torch.uint8), 16, 4)
    with pytest.raises(ValueError, match="unknown upload"):
        upload_codec("fp4")
    with pytest.raises(ValueError, match="unknown result"):
        result_codec("median")
    with pytest.raises(ValueError, match="bits"):
        L1Upload(1)


def test_majority_parts_agree_with_whole():
    """Reducing a buffer in 8-byte-aligned parts gives the same bits as one reducer (ties included)."""
    up, res = SignUpload(), MajorityResult()
    stacks = [up.encode(c) for c in _directions(4, 800, seed=1)]
    whole = reduce_votes(stacks, up, res, numel=800, seed=2, step=9)
    from lioncub_p2p.codecs import tally_of
    parts = []
    for start, stop in ((0, 48), (48, 100)):
        planes = tally_of(up, [s[:, start:stop] for s in stacks])
        parts.append(res.encode(planes, 4, (stop - start) * 8, seed=2, step=9, offset=start))
    assert torch.equal(torch.cat(parts), whole)


def test_fp8_blocks_match_the_numpy_reference_and_keep_each_value_precise():
    """fp8 block bytes equal the reference written from the spec (its own e4m3 rounding); each value
    is within 1/16 of itself, or 2**-17 of its block's largest when tiny, so a block of tiny values next
    to a block of huge ones keeps its precision, and values down to 2**-15 of a block's largest keep 4
    significant bits;
    the last block is padded with zeros; decoded values survive a second trip unchanged."""
    codec = Fp8Upload()
    g = np.random.default_rng(3)
    values = (g.standard_normal(1000) * np.repeat(10.0 ** g.integers(-30, 30, 143), 7)[:1000]).astype(np.float32)
    values[7:14] = 0.0  # an all-zero block
    values[14:21] = [448.0, -1e-3, 1e-4, 17.0, 18.0, -0.0, 3e-7]  # small values beside a large one
    wire = codec.encode(torch.from_numpy(values))
    assert wire.shape == (1, codec.nbytes_for(1000)) == (1, 8 * 143) and codec.values_in(8 * 143) == 1001
    np.testing.assert_array_equal(wire[0].numpy(), ref_fp8_blocks(values))
    decoded = codec.decode(wire[0])
    np.testing.assert_array_equal(decoded.numpy(), from_fp8_blocks(ref_fp8_blocks(values)))
    assert decoded[1000] == 0  # padding
    # beside 448 the step is 1 from 256 up (16 rounds to even: 17 -> 16) and 2**-9 below 2**-6 (subnormals)
    assert decoded[14:21].tolist() == [448.0, -2.0 ** -9, 0.0, 16.0, 18.0, -0.0, 0.0]
    block_max = np.repeat(np.abs(np.append(values, 0)).reshape(-1, 7).max(1), 7)[:1000]
    error = np.abs(decoded[:1000].numpy() - values)
    assert np.all(error <= np.maximum(np.abs(values) / 16, block_max * 2.0 ** -17) * (1 + 1e-6))
    assert torch.equal(codec.decode(codec.encode(decoded)), decoded)
    assert codec.bits_per_element == 64 / 7 and codec.value_span(16, 40) == slice(14, 35)
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(torch.tensor([1.0, float("inf")]))


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_a_trimmed_mean_of_two_is_clipped_to_the_smaller_signed_maximum_leaf_by_leaf(wire):
    """A trimmed mean has nothing to drop of two rows (a group of two, a quorum of two in a group of
    three): it was their plain mean, so one voter's 1e34 reached everyone at half strength. Both rows are
    now clipped to the smaller of the maxima the two signed, a number every party holds: the reducer's
    result is bounded by the receivers' ``value_bound``, and the auditors' recount of each Merkle leaf
    on its own agrees with it (a clip to the rows' own maxima, tried first, did not: 249 of 256 leaves
    differed, and honest reducers were convicted)."""
    from lioncub_p2p.allreduce.audit import agrees, leaf_count, leaf_span, recount, value_bound
    from lioncub_p2p.allreduce.commit import build_header
    from lioncub_p2p.allreduce.round import RoundSpec
    from lioncub_p2p.allreduce.partition import PeerSpec
    from lioncub_p2p.codecs import AverageResult, upload_codec
    from lioncub_p2p.wire import pb

    codec, rule, numel = upload_codec(wire), AverageResult(trimmed=True), 7 * 2048
    g = torch.Generator().manual_seed(3)
    honest = [torch.randn(numel, generator=g) * s for s in (0.5, 2.0)]  # different ranges: a clip bites
    hostile = torch.full((numel,), 1e34)
    for rows in (honest, [honest[0], hostile]):
        uploads = [codec.encode(r) for r in rows]
        nbytes = uploads[0].numel()
        tally = codec.tally(nbytes, 2)
        for voter, u in enumerate(uploads):
            tally.add(voter, u.view(1, -1) if u.dim() == 1 else u, 0)
        bounds = [float(codec.decode(u).abs().max()) for u in uploads]
        wire_bytes = tally.encode(rule, [0, 1], seed=0, step=0, offset=0, bounds=bounds)
        result = codec.decode(wire_bytes)
        spec = RoundSpec(b"r" * 16, 1, (PeerSpec("a"), PeerSpec("b")), nbytes, codec, rule, 0, family="momentum")
        statements = [pb.VoterStatement(root=b"x" * 32, max_abs=b) for b in bounds]
        header = pb.ResultHeader()
        header.ParseFromString(build_header(spec, 0, [0, 1], (b"x" * 32, b"x" * 32), b"", 0,
                                            wire_bytes.numpy().tobytes(), statements))
        assert float(result.abs().max()) <= value_bound(header, rule, codec)
        assert float(result.abs().max()) <= 1.05 * min(bounds)
        leaves = leaf_count(header.stop - header.start, header.leaf_bytes)
        assert leaves > 4
        for k in range(leaves):
            a, b = leaf_span(header, k)
            votes = [u.view(-1)[a:b].numpy().tobytes() for u in uploads]
            got = recount(header, codec, rule, k, votes)
            want = codec.decode(wire_bytes.view(-1)[a:b].contiguous())
            assert agrees(codec, got, want), (wire, k)
