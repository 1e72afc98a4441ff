import pytest

from lioncub_p2p.allreduce.partition import ALIGN, MAX_OVER_MEDIAN, PeerSpec, part_bounds


@pytest.mark.parametrize("nbytes", [0, 1, 8, 100, 4096, 1_000_003])
@pytest.mark.parametrize("weights,clients", [([1, 1, 1, 1], ()), ([60, 50, 20, 10], ()), ([1, 1, 1], (1,)),
                                             ([0, 3, 1, 1], (3,))])
def test_bounds_cover_align_and_follow_weights(nbytes, weights, clients):
    group = [PeerSpec(f"p{i}", w, i in clients) for i, w in enumerate(weights)]
    bounds = part_bounds(nbytes, group)
    assert len(bounds) == len(group)
    assert bounds[0][0] == 0 and bounds[-1][1] == nbytes
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c and a <= b
    reducing = [w if not p.client_mode else 0 for p, w in zip(group, weights)]
    total = sum(reducing)
    for (a, b), w, p in zip(bounds, reducing, group):
        if w == 0:
            assert a == b
        else:
            assert a % ALIGN == 0
            assert abs((b - a) - nbytes * w / total) <= 2 * ALIGN


def test_no_reducer_is_an_error():
    with pytest.raises(ValueError, match="no reducer"):
        part_bounds(10, [PeerSpec("a", client_mode=True)])
    with pytest.raises(ValueError, match="weight"):
        PeerSpec("a", weight=-1)


def _shares(weights: list[float], nbytes: int = 1 << 20) -> list[float]:
    return [(b - a) / nbytes for a, b in part_bounds(nbytes, [PeerSpec(f"p{i}", w) for i, w in enumerate(weights)])]


@pytest.mark.parametrize("n,share", [(3, 2 / 4), (4, 3 / 6), (5, 4 / 8), (8, 4 / 11)])
def test_an_inflated_weight_never_takes_most_of_the_buffer(n, share):
    """One member announcing the largest weight allowed (1e6) among honest weights of 1 reduces at most
    4 times an honest part (MAX_OVER_MEDIAN), and never most of the buffer (before: the whole of it)."""
    assert MAX_OVER_MEDIAN == 4.0
    shares = _shares([1e6] + [1.0] * (n - 1))
    assert shares[0] <= 0.5 + 1e-3
    assert shares[0] == pytest.approx(share, abs=1e-3)
    assert all(s == pytest.approx(shares[1], abs=1e-4) for s in shares[1:])


def test_a_pair_keeps_a_bounded_difference_and_honest_spreads_keep_their_proportions():
    assert _shares([1e6, 1.0])[0] == pytest.approx(4 / 5, abs=1e-4)
    assert _shares([100.0, 50.0, 40.0, 30.0]) == pytest.approx([100 / 220, 50 / 220, 40 / 220, 30 / 220], abs=1e-4)
    # the sim's uneven links (100/50/20/10 Mbit/s): the fastest is held to 4x the lower median (20)
    assert _shares([100.0, 50.0, 20.0, 10.0])[0] == pytest.approx(80 / 160, abs=1e-4)
