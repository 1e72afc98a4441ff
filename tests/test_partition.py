import pytest

from lioncub_p2p.allreduce.partition import ALIGN, PeerSpec, part_bounds


@pytest.mark.parametrize("nbytes", [0, 1, 8, 100, 4096, 1_000_003])
@pytest.mark.parametrize("weights,clients", [([1, 1, 1, 1], ()), ([100, 50, 20, 10], ()), ([1, 1, 1], (1,)),
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
