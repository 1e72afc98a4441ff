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


def test_grace_is_capped_by_the_groups_own_pace_but_not_below_the_floor():
    """A voter always 3 s late teaches the spreads 3 s; the group steps every second without it:
    the grace stays at half a step, so it stops setting everybody's pace. In a group stepping every
    0.1 s the cap stays at the floor: 0.3 s late is waited for (a busy host, not a slow link)."""
    def grace(late: float, interval: float, **kw) -> float:
        policy = AdaptiveDeadline(min_grace=0.01, max_grace=10.0, margin=2.0, pace_share=0.5, **kw)
        t = 100.0
        for _ in range(10):
            policy.observe(late, quorum_at=t)
            t += interval
        return policy.grace()

    assert abs(grace(3.0, 1.0) - 0.5) < 1e-9  # half the median interval, not 2 x 3 s
    assert abs(grace(0.3, 0.1) - 0.2) < 1e-9  # the floor, not half of 0.1 s
    assert abs(grace(0.3, 0.1, pace_floor=0.0) - 0.05) < 1e-9
    assert abs(grace(0.05, 1.0) - 0.1) < 1e-9  # below the cap: the learned 2 x spread
    uncapped = AdaptiveDeadline(min_grace=0.01, max_grace=10.0, margin=2.0)
    for _ in range(10):
        uncapped.observe(3.0)  # no quorum times: no pace to cap by
    assert abs(uncapped.grace() - 6.0) < 1e-9
