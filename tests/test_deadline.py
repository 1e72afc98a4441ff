from lioncub_p2p.allreduce.deadline import AdaptiveDeadline


def test_grace_learns_from_spreads_and_is_clamped():
    policy = AdaptiveDeadline(min_grace=0.05, max_grace=2.0, initial_grace=1.0, margin=2.0)
    assert policy.grace() == 1.0  # too few rounds observed
    for spread in [0.010, 0.020, 0.015, 0.030, 0.012] * 4:
        policy.observe(spread)
    assert 0.05 <= policy.grace() <= 2 * 0.030 + 1e-9
    for _ in range(40):
        policy.observe(0.0)
    assert policy.grace() == 0.05  # never below the floor
    for _ in range(40):
        policy.observe(5.0)
    assert policy.grace() == 2.0  # never above the cap
    policy.observe(None)  # a round where someone never arrived does not teach anything
    assert policy.grace() == 2.0
    assert AdaptiveDeadline.quorum(4) == 3 and AdaptiveDeadline.quorum(3) == 2
