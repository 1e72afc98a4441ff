"""MomentumSchedule against hand-computed step and name sets; in-process averaging against numpy."""
import math
import numpy as np
import pytest
import torch
from torch import nn

from lioncub_p2p import LionCub
from lioncub_p2p.momentum import MomentumSchedule, average_in_process


def _due(schedule: MomentumSchedule, last: int) -> list[int]:
    return [s for s in range(0, last + 1) if schedule.due(s)]


@pytest.mark.parametrize("schedule, last, expected", [
    (MomentumSchedule(every=4), 12, [4, 8, 12]),
    (MomentumSchedule(every=1), 5, [1, 2, 3, 4, 5]),  # step 0 (nothing completed yet) never syncs
    (MomentumSchedule(every=3, until=10), 20, [3, 6, 9]),
    (MomentumSchedule(every=3, until=0), 20, []),
    (MomentumSchedule(geometric=2.0, start=3), 50, [3, 6, 12, 24, 48]),
    # 1, 1.5, 2.25, 3.375, 5.06, 7.59, 11.39, 17.09, 25.63, 38.44, each rounded up
    (MomentumSchedule(geometric=1.5), 40, [1, 2, 3, 4, 6, 8, 12, 18, 26, 39]),
    (MomentumSchedule(every=10, geometric=2.0, until=20), 40, [1, 2, 4, 8, 10, 16, 20]),
    (MomentumSchedule.never(), 100, []),
])
def test_due_steps(schedule, last, expected):
    assert _due(schedule, last) == expected
    assert schedule.syncs_per_step(last) == len([s for s in expected if s >= 1]) / last


def test_bad_schedules_are_refused():
    for kwargs, words in (({"every": -1}, "every"), ({"geometric": 1.0}, "geometric"), ({"start": 0}, "start"),
                          ({"until": -2}, "until"), ({"slices": -1}, "slices"), ({"slices": 4, "every": 2}, "replaces"),
                          ({"slices": 4, "geometric": 2.0}, "replaces")):
        with pytest.raises(ValueError, match=words):
            MomentumSchedule(**kwargs)


def test_a_ratio_a_hair_above_one_is_refused_and_due_stays_cheap_far_out():
    """geometric=1.0000000000000002 (from anyone's manifest in an open run) made ``due`` loop for ever:
    s * r == s once s >= 2. Ratios below 1.01 are refused; at 1.01, step 2**52 is answered at once."""
    import time

    for ratio in (1.0000000000000002, 1.001, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="geometric"):
            MomentumSchedule(geometric=ratio)
    schedule = MomentumSchedule(geometric=1.01)
    started = time.perf_counter()
    assert not schedule.due(2**52 + 1) and schedule.due(1) and schedule.due(2)
    assert time.perf_counter() - started < 0.5
    assert _due(schedule, 300) == sorted({math.ceil(1.01**k - 1e-9) for k in range(600) if 1.01**k <= 300})


def test_selects_by_fnmatch_pattern():
    names = ["embed.weight", "encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "head.weight", "head.bias"]
    every = MomentumSchedule(every=1)
    assert [n for n in names if every.selects(n)] == names  # no patterns: everything
    encoder = MomentumSchedule(every=1, params=["encoder.*", "head.bias"])
    assert encoder.params == ("encoder.*", "head.bias")
    assert [n for n in names if encoder.selects(n)] == ["encoder.0.weight", "encoder.0.bias", "encoder.1.weight",
                                                        "head.bias"]
    weights = MomentumSchedule(every=1, params=("*.weight",))
    assert [n for n in names if weights.selects(n)] == ["embed.weight", "encoder.0.weight", "encoder.1.weight",
                                                        "head.weight"]
    assert not MomentumSchedule(every=1, params=("Encoder.*",)).selects("encoder.0.weight")  # case matters


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_check_names_with_real_names_and_the_readme_form():
    named = LionCub(_model(0).named_parameters())
    names = [n for n, _ in named.momentum_buffers()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert MomentumSchedule(every=5, params=("0.*",)).check_names(names) == ["0.weight", "0.bias"]
    assert MomentumSchedule(every=5).check_names(names) == names
    # model.parameters(): names are group0.paramK, a pattern over real names selects nothing
    unnamed = [n for n, _ in LionCub(_model(0).parameters()).momentum_buffers()]
    with pytest.raises(ValueError, match=r"selects none.*LionCub\(model\.named_parameters\(\)"):
        MomentumSchedule(every=5, params=("0.*",)).check_names(unnamed)
    with pytest.raises(ValueError, match=r"selects none of the optimizer's 4 parameters \(0\.weight") as caught:
        MomentumSchedule(every=5, params=("encoder.*",)).check_names(names)
    assert "named_parameters" not in str(caught.value)  # named already: the hint would mislead


def _optimizers(n: int, named: bool = True) -> list[LionCub]:
    """n peers, same model, each with its own seeded random momenta."""
    opts = []
    for i in range(n):
        model = _model(0)
        opt = LionCub(model.named_parameters() if named else model.parameters())
        gen = torch.Generator().manual_seed(100 + i)
        for _, m in opt.momentum_buffers():
            m.copy_(torch.randn(m.shape, generator=gen))
        opts.append(opt)
    return opts


@pytest.mark.parametrize("patterns", [(), ("0.*",), ("*.bias",)])
def test_average_in_process_is_the_numpy_mean_of_the_selected_buffers(patterns):
    opts = _optimizers(3)
    before = [[m.numpy().astype(np.float64).copy() for _, m in o.momentum_buffers()] for o in opts]
    schedule = MomentumSchedule(every=1, params=patterns)
    synced = average_in_process([o.momentum_buffers() for o in opts], schedule)
    names = [n for n, _ in opts[0].momentum_buffers()]
    selected = [k for k, n in enumerate(names) if schedule.selects(n)]
    assert selected and synced == sum(before[0][k].size for k in selected)
    for k in range(len(names)):
        mean = np.mean([b[k] for b in before], axis=0)
        for o, b in zip(opts, before):
            now = o.momentum_buffers()[k][1].numpy()
            if k in selected:
                np.testing.assert_allclose(now, mean, rtol=0, atol=1e-6)
            else:
                np.testing.assert_array_equal(now, b[k])


def test_average_in_process_refuses_a_selection_of_nothing():
    """The issue-14 crash: params patterns with an optimizer built from model.parameters()."""
    opts = _optimizers(2, named=False)
    before = [[m.clone() for _, m in o.momentum_buffers()] for o in opts]
    with pytest.raises(ValueError, match="named_parameters"):
        average_in_process([o.momentum_buffers() for o in opts], MomentumSchedule(every=1, params=("0.*",)))
    assert all(torch.equal(a, m) for o, b in zip(opts, before) for a, (_, m) in zip(b, o.momentum_buffers()))


def test_average_in_process_refuses_peers_with_other_names():
    a, b = _optimizers(1)[0], LionCub(_model(0).parameters())
    with pytest.raises(ValueError, match="disagree"):
        average_in_process([a.momentum_buffers(), b.momentum_buffers()], MomentumSchedule(every=1))


@pytest.mark.parametrize("numel, slices", [(10, 4), (3, 5), (1000, 25), (7, 1)])
def test_streamed_slices_cover_every_element_once_per_period(numel, slices):
    """With slices=K every step syncs, each of K consecutive steps takes a disjoint slice and together
    they cover every element exactly once; the accounting says 1/K of a whole sync per step."""
    schedule = MomentumSchedule(slices=slices)
    assert _due(schedule, 2 * slices) == list(range(1, 2 * slices + 1))
    for start in (1, slices + 1, 3 * slices + 1):
        hits = np.zeros(numel, dtype=int)
        for step in range(start, start + slices):
            lo, hi = schedule.slice_of(step, numel)
            hits[lo:hi] += 1
        assert (hits == 1).all()
    assert schedule.syncs_per_step(4 * slices) == pytest.approx(1 / slices)
    assert MomentumSchedule(every=5).slice_of(3, numel) == (0, numel)


def test_streamed_averaging_over_one_period_is_the_numpy_mean():
    """Momenta that do not change meanwhile: K streamed steps leave every element at the peers' mean,
    and each step changes only its slice (numpy reference)."""
    rng = np.random.default_rng(3)
    shapes, peers, slices = [(5, 7), (11,)], 3, 4
    values = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(peers)]
    momenta = [[(f"t{k}", torch.from_numpy(v.copy())) for k, v in enumerate(vs)] for vs in values]
    schedule = MomentumSchedule(slices=slices)
    for step in range(1, slices + 1):
        before = [[m.clone() for _, m in peer] for peer in momenta]
        synced = average_in_process(momenta, schedule, step)
        assert synced == sum(hi - lo for lo, hi in (schedule.slice_of(step, int(np.prod(s))) for s in shapes))
        for peer, old in zip(momenta, before):
            for (_, m), m0 in zip(peer, old):
                lo, hi = schedule.slice_of(step, m.numel())
                outside = np.ones(m.numel(), dtype=bool)
                outside[lo:hi] = False
                assert torch.equal(m.view(-1)[outside], m0.view(-1)[outside])
    for k in range(len(shapes)):
        mean = np.mean([values[i][k] for i in range(peers)], axis=0)
        for peer in momenta:
            np.testing.assert_allclose(peer[k][1].numpy(), mean, rtol=1e-6, atol=1e-7)
