"""Quality metrics (sim/quality.py) against hand-computed values; the comparison's summary, momentum
rules and the experimental vote engine (sim/variants.py) against independent references."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lioncub_p2p.momentum import MomentumSchedule, average_in_process
from lioncub_p2p.sim import quality
from lioncub_p2p.sim.compare_tasks import SpecTask
from lioncub_p2p.sim.inprocess import Method, MethodRuns, Outcome, MomentumSyncs, parse_method, run_method, summarize
from lioncub_p2p.sim.workers import average_momenta
from lioncub_p2p.sim.variants import (_agreement_scales, _ties_to_previous, _weighted_vote, Options,
                                      run_variant)

from reference import from_fp8_blocks, fp8_blocks

LOSSES = [4.0, 2.0, 3.0, 1.0, 0.5]


def test_smoothing_is_a_trailing_mean_over_at_most_window_steps():
    assert quality.smoothed(LOSSES, 2) == [4.0, 3.0, 2.5, 2.0, 0.75]
    assert quality.smoothed(LOSSES, 1) == LOSSES
    assert quality.smoothed_at(LOSSES, 4, 3) == pytest.approx((2 + 3 + 1) / 3)  # steps 2..4
    assert quality.smoothed_at(LOSSES, 1, 3) == 4.0  # fewer than a window at the start
    assert quality.smoothed_at(LOSSES, 5, 10) == pytest.approx(10.5 / 5)
    assert math.isnan(quality.smoothed_at(LOSSES, 6, 3)) and math.isnan(quality.smoothed_at(LOSSES, 0, 3))
    with pytest.raises(ValueError):
        quality.smoothed(LOSSES, 0)


def test_steps_to_reach_counts_from_one_and_waits_for_a_full_window():
    # smoothed over 2: [4, 3, 2.5, 2, 0.75] at steps 1..5
    assert quality.steps_to_reach(LOSSES, 2.5, 2) == 3
    assert quality.steps_to_reach(LOSSES, 4.0, 2) == 2  # step 1 holds a single loss: not counted
    assert quality.steps_to_reach(LOSSES, 4.0, 2, start=1) == 1
    assert quality.steps_to_reach(LOSSES, 0.1, 2) is None


def test_mean_spread_gap_and_formatting():
    mean, sd = quality.mean_spread([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and sd == pytest.approx(math.sqrt(5 / 3))
    assert quality.mean_spread([3.0]) == (3.0, 0.0)
    assert quality.mean_spread([float("nan"), 1.0, None]) == (1.0, 0.0)
    assert quality.relative_gap(1.1, 1.0) == pytest.approx(0.1)
    assert quality.fmt([1.0, 3.0], 2) == f"2.00 ± {math.sqrt(2):.2f}"
    assert quality.fmt([0.05, 0.07], 1, percent=True) == "+6.0% ± 1.4%"
    assert quality.fmt_ratio([1.2, None], 2.0) == "> 2.00 (1/2 seeds never)"
    assert quality.fmt_ratio([1.1, 1.3], 2.0) == f"1.20 ± {np.std([1.1, 1.3], ddof=1):.2f}×"


def test_per_step_mean_over_peers():
    peers = [[(0, 1.0), (1, 3.0), (2, float("nan"))], [(0, 3.0), (2, 5.0)]]
    assert quality.per_step_mean(peers) == [(0, 2.0, 2), (1, 3.0, 1), (2, 5.0, 1)]


def _outcome(name: str, losses: list[float], seed: int) -> Outcome:
    return Outcome(name, len(losses), 4, 0.0, 1.0, 2.0, True, 0.0, list(enumerate(losses)), seed=seed,
                   upload_bits=1.0)


def test_summary_pairs_seeds_against_the_baseline():
    """Baseline losses 10, 9, ..., 1 (steps 1..10); the method is one step behind (11, 10, ..., 2): at
    K = 4 the baseline has 7 and the method 8 (+14.3%), and the method gets to 7 at step 5 (1.25×)."""
    base = [float(11 - k) for k in range(1, 11)]
    late = [float(12 - k) for k in range(1, 11)]
    runs = [MethodRuns(Method("global"), 1e-3, {}, [_outcome("global", base, s) for s in (0, 1)]),
            MethodRuns(Method("vote", "sign"), 1e-3, {}, [_outcome("vote", late, 0), _outcome("vote", base, 1)])]
    rows = summarize(runs, window=1, target=4, points=(2, 10))
    assert rows[0].gap_at_target == [0.0, 0.0] and rows[0].steps_ratio == [1.0, 1.0]
    assert rows[1].gap_at_target == pytest.approx([1 / 7, 0.0])
    assert rows[1].steps_ratio == [5 / 4, 1.0]
    assert rows[1].train_at == {2: [10.0, 9.0], 10: [2.0, 1.0]}
    # never reached: the method stays above the baseline's loss at K
    runs[1].outcomes[1] = _outcome("vote", [9.5] * 10, 1)
    assert summarize(runs, window=1, target=4, points=(10,))[1].steps_ratio == [5 / 4, None]


def test_method_specs():
    m = parse_method("sign/majority+sync20+bf16+lr2e-3")
    assert (m.upload, m.result, m.momentum, m.momentum_rule, m.lr) == (
        "sign", "majority", MomentumSchedule(every=20), "trimmed_mean", 2e-3)
    assert parse_method("l1:3/ternary+geo1.5").momentum == MomentumSchedule(geometric=1.5)
    assert parse_method("sign/majority+ef+stream32").variant == ("ef",)
    assert parse_method("sign/majority+ef+stream32").momentum == MomentumSchedule(slices=32)
    assert (parse_method("sign/majority+stream20+fp8mean").momentum, parse_method("sign/majority+fp8").momentum_rule) \
        == (MomentumSchedule(slices=20, wire="fp8"), "trimmed_mean")
    assert parse_method("global").upload is None
    for bad, message in (("sign", "UPLOAD/RESULT"), ("sign/average", "momentum rule"), ("l1:9/majority", "bits"),
                         ("sign/majority+syncx", "needs a number"), ("sign/majority+bogus", "unknown option")):
        with pytest.raises(ValueError, match=message):
            parse_method(bad)


def _momenta(n: int, seed: int = 0) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[("w", torch.randn(5, 7, generator=g)), ("b", torch.randn(7, generator=g))] for _ in range(n)]


def test_swarm_momentum_rule_is_a_bf16_trimmed_mean():
    """Reference in numpy: round to bf16, drop each element's largest and smallest of 4, average the
    middle two, round to bf16 again."""
    momenta = _momenta(4)
    bf16 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).float().numpy()  # noqa: E731
    expected = {name: bf16(np.sort(np.stack([bf16(dict(m)[name].numpy()) for m in momenta]), 0)[1:3].mean(0))
                for name in ("w", "b")}
    exact = {name: np.stack([dict(m)[name].numpy() for m in momenta]).mean(0) for name in ("w", "b")}
    assert average_momenta(momenta, MomentumSchedule(every=1), "trimmed_mean") == 42
    for peer in momenta:
        for name, m in peer:
            np.testing.assert_array_equal(m.numpy(), expected[name])
            assert not np.allclose(m.numpy(), exact[name], atol=1e-3)  # and it is not the exact mean
    blocks = _momenta(4)
    want = {name: from_fp8_blocks(fp8_blocks(np.sort(np.stack([from_fp8_blocks(fp8_blocks(dict(m)[name].numpy()))[
        : dict(m)[name].numel()] for m in blocks]), 0)[1:3].mean(0, dtype=np.float32)))[: dict(blocks[0])[name].numel()]
        for name in ("w", "b")}  # the same in fp8 blocks (numpy reference), per tensor
    assert average_momenta(blocks, MomentumSchedule(every=1, wire="fp8"), "trimmed_mean") == 42
    for peer in blocks:
        for name, m in peer:
            np.testing.assert_array_equal(m.numpy().ravel(), want[name])
    plain = _momenta(4)
    average_momenta(plain, MomentumSchedule(every=1, params=("b",)), "exact")
    np.testing.assert_allclose(dict(plain[2])["b"].numpy(), exact["b"], rtol=1e-6)
    assert not torch.equal(dict(plain[2])["w"], dict(plain[3])["w"])  # not selected: left alone


@pytest.mark.parametrize("rule", ["exact", "trimmed_mean"])
def test_streamed_momentum_averages_every_element_once_per_cycle(rule):
    momenta = _momenta(3, seed=1)
    reference = _momenta(3, seed=1)
    average_momenta(reference, MomentumSchedule(every=1), rule)  # the whole buffer at once
    schedule = MomentumSchedule(slices=3)
    assert average_momenta(momenta, schedule, rule, 1) + average_momenta(momenta, schedule, rule, 2) < 42
    assert not torch.allclose(momenta[0][0][1], momenta[1][0][1])  # two of three slices so far
    assert average_momenta(momenta, schedule, rule, 3) > 0
    for peer, want in zip(momenta, reference):
        for (_, m), (_, w) in zip(peer, want):
            torch.testing.assert_close(m, w, rtol=0, atol=0)


def test_in_process_streamed_syncs_are_applied_a_step_later_as_a_correction():
    """As a swarm does it: the slice averaged after step 1 changes nothing then; after step 2 each
    momentum is what it is now plus (the average of step 1 minus what it was at step 1)."""
    momenta = _momenta(3, seed=2)
    schedule = MomentumSchedule(slices=2)
    syncs = MomentumSyncs(schedule, "exact")
    sent = [[(n, m.clone()) for n, m in peer] for peer in momenta]
    syncs.after_step(momenta, 1)
    assert all(torch.equal(m, s) for peer, was in zip(momenta, sent) for (_, m), (_, s) in zip(peer, was))
    with torch.no_grad():
        for peer in momenta:  # the next step moves every momentum
            for _, m in peer:
                m.mul_(0.5).add_(1.0)
    now = [[(n, m.clone()) for n, m in peer] for peer in momenta]
    averaged = [[(n, m.clone()) for n, m in peer] for peer in sent]
    average_in_process(averaged, schedule, 1)
    syncs.after_step(momenta, 2)
    for peer, n_, s_, a_ in zip(momenta, now, sent, averaged):
        for (_, m), (_, n), (_, s), (_, a) in zip(peer, n_, s_, a_):
            torch.testing.assert_close(m, n + (a - s), rtol=0, atol=0)
    assert syncs.synced == sum(hi - lo for _, m in momenta[0] for lo, hi in [schedule.slice_of(1, m.numel())]) \
        + sum(hi - lo for _, m in momenta[0] for lo, hi in [schedule.slice_of(2, m.numel())])


def test_tie_rules_weights_and_agreement_against_hand_counts():
    # 4 voters on 3 elements: 3-1 for +, 2-2 tie, 0-4 for −
    dirs = [[torch.tensor([1.0, 1.0, -1.0])], [torch.tensor([1.0, 1.0, -2.0])],
            [torch.tensor([1.0, -1.0, -1.0])], [torch.tensor([-1.0, -3.0, -1.0])]]
    u = [torch.tensor([1.0, 1.0, -1.0])]  # the tie drew +1
    # the tie follows the sign of the previous result (or of its EMA), unless that is 0
    assert _ties_to_previous(u, dirs, [torch.tensor([5.0, -0.5, 5.0])])[0].tolist() == [1.0, -1.0, -1.0]
    assert _ties_to_previous(u, dirs, [torch.tensor([-5.0, 0.0, 5.0])])[0].tolist() == [1.0, 1.0, -1.0]
    assert _ties_to_previous(u, dirs, [None])[0].tolist() == u[0].tolist()
    # agreement per element |2·plus − 4|/4: 0.5, 0, 1 -> 0.5 for this tensor; a second, unanimous one -> 1
    both = [d + [torch.ones(3)] for d in dirs]
    scales = _agreement_scales(u + u, both, [3, 3])
    assert scales == pytest.approx([0.5 / 0.75, 1 / 0.75])
    # weights mean|c|: 1, 4/3, 1, 5/3 -> element 1: 1 + 4/3 − 1 − 5/3 < 0 (the tie goes to the heavier side)
    assert _weighted_vote(dirs, seed=0, step=0)[0].tolist() == [1.0, -1.0, -1.0]


def _tiny_task(tmp_path, monkeypatch) -> SpecTask:
    (tmp_path / "tinytask.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make_task(seed, hidden=None):\n"
        "    torch.manual_seed(seed)\n"
        "    model = nn.Sequential(nn.Linear(8, hidden or 16), nn.Tanh(), nn.Linear(hidden or 16, 1))\n"
        "    w = torch.arange(8.0) / 8\n"
        "    def sample(batch, gen):\n"
        "        x = torch.randn(batch, 8, generator=gen)\n"
        "        return x, x @ w\n"
        "    def loss(model, batch):\n"
        "        x, y = batch\n"
        "        return nn.functional.mse_loss(model(x).squeeze(1), y)\n"
        "    return model, sample, loss, lambda model: loss(model, sample(256, torch.Generator().manual_seed(9)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return SpecTask("tinytask:make_task", hidden=12, batch=8)


@pytest.mark.parametrize("spec", ["sign/majority", "sign/ternary+sync3", "l1:3/mean", "sign/majority+sync2+bf16"])
def test_variant_engine_without_options_is_the_optimizer_bit_for_bit(tmp_path, monkeypatch, spec):
    """A second implementation of the vote (one model, per-tensor codecs) against LionCub's fused
    kernels on 4 replicas: the same losses at every step, the same final test loss and bit count."""
    task = _tiny_task(tmp_path, monkeypatch)
    method = parse_method(spec)
    ours = run_variant(method, task, workers=4, steps=12, batch=8, lr=3e-2, weight_decay=0.1, seed=2)
    real = run_method(method, task, workers=4, steps=12, batch=8, lr=3e-2, weight_decay=0.1, seed=2)
    assert real.replicas_identical and real.losses[-1] < real.losses[0]
    assert ours.losses == real.losses and ours.test_loss == real.test_loss
    assert ours.bits_per_element_per_step == real.bits_per_element_per_step
    assert ours.upload_bits == real.upload_bits


def test_variants_change_the_run_and_count_their_bits(tmp_path, monkeypatch):
    task = _tiny_task(tmp_path, monkeypatch)
    plain = run_variant(parse_method("sign/majority"), task, workers=4, steps=10, batch=8, lr=3e-2, weight_decay=0.1,
                        seed=0)
    for spec, extra_up, extra_total in (("sign/majority+ef", 0, 0), ("sign/majority+efvote", 0, 0),
                                        ("sign/majority+tieprev", 0, 0), ("sign/majority+tieema0.9", 0, 0),
                                        ("sign/majority+weighted", 32 * 4 / 121, 32 * 4 / 121),
                                        ("sign/majority+agree", 0, 16 * 4 / 121), ("sign/majority+abstain2", 0.5, 0.5),
                                        ("sign/majority+stream4+ef", 4.0, 8.0), ("sign/majority+beta0.95", 0, 0)):
        run = run_method(parse_method(spec), task, workers=4, steps=10, batch=8, lr=3e-2, weight_decay=0.1, seed=0)
        assert run.losses[0] == plain.losses[0] and run.losses[1:] != plain.losses[1:], spec
        # 121 parameters in 4 tensors; stream4: a 1-element tensor is in one of the 4 slices, synced at steps 4 and 8 of 10, not 2.5 times
        assert run.upload_bits == pytest.approx(1.0 + extra_up, rel=0.01) and \
            run.bits_per_element_per_step == pytest.approx(2.0 + extra_total, rel=0.01), spec
    assert Options.of(["efvote", "efdecay0.5"]) == Options(ef="efvote", ef_decay=0.5)


def test_a_delayed_vote_is_applied_d_steps_later(tmp_path, monkeypatch):
    """delayD (pipelined rounds): nothing is applied for D steps, then step t applies the vote of step
    t - D. Without weight decay, 1 delayed step leaves the model as it was (an lr of 0), and 2 delayed
    steps leave it where 1 plain step does (step 0's vote; step 1's is still in flight)."""
    task = _tiny_task(tmp_path, monkeypatch)
    kw = dict(workers=4, batch=8, weight_decay=0.0, seed=1)
    plain = parse_method("sign/majority")
    delayed = parse_method("sign/majority+delay1")
    untouched = run_variant(plain, task, steps=1, lr=0.0, **kw).test_loss
    one_plain = run_variant(plain, task, steps=1, lr=3e-2, **kw).test_loss
    assert one_plain != untouched
    assert run_variant(delayed, task, steps=1, lr=3e-2, **kw).test_loss == untouched
    assert run_variant(delayed, task, steps=2, lr=3e-2, **kw).test_loss == one_plain
    ten = run_variant(delayed, task, steps=10, lr=3e-2, **kw)
    assert ten.bits_per_element_per_step == run_variant(plain, task, steps=10, lr=3e-2, **kw).bits_per_element_per_step
    zero = run_variant(parse_method("sign/majority+delay0"), task, steps=10, lr=3e-2, **kw)
    assert zero.losses == run_variant(plain, task, steps=10, lr=3e-2, **kw).losses


def test_compare_end_to_end_with_a_user_task(tmp_path, monkeypatch, capsys):
    from lioncub_p2p.sim.inprocess import run as compare

    _tiny_task(tmp_path, monkeypatch)
    out, cache = tmp_path / "r.json", tmp_path / "cache.jsonl"
    argv = ["--task", "tinytask:make_task", "--hidden", "12", "--steps", "12", "--batch", "8", "--seeds", "2",
            "--window", "3", "--eval-at", "4,12", "--target-step", "6", "--lr-sweep", "1e-2,3e-2",
            "--methods", "global", "sign/majority+sync4", "--cache", str(cache), "--out", str(out)]
    rows = compare(argv)
    printed = capsys.readouterr().out
    assert "| global | " in printed and "steps to global's loss @6" in printed
    import json

    report = json.loads(out.read_text())
    assert [r["method"] for r in report["runs"]] == ["global", "sign/majority+sync4"]
    for r in report["runs"]:
        assert r["lr"] == float(min(r["sweep"], key=r["sweep"].get)) and set(r["sweep"]) == {"0.01", "0.03"}
        assert [o["seed"] for o in r["outcomes"]] == [0, 1]
        assert all([e[0] for e in o["evals"]] == [4, 12] for o in r["outcomes"])
    assert rows[1].bits == pytest.approx(2.0 + 32 * 3 / 12) and rows[0].bits == 64.0
    assert rows[0].steps_ratio and all(r is not None and r <= 1.0 for r in rows[0].steps_ratio)
    assert len(cache.read_text().splitlines()) == 2 * (2 + 2)  # sweep seed + 2 seeds, 2 methods... all cached
    again = compare(argv)  # served from the cache: the same numbers
    assert [r.train_at for r in again] == [r.train_at for r in rows]
    assert len(cache.read_text().splitlines()) == 8


def test_compare_refuses_bad_input_with_one_line(capsys):
    from lioncub_p2p.sim.inprocess import run as compare

    for argv, needle in ((["--task", "nosuchmodule:f"], "no module named"), (["--methods", "sign/bogus"], "unknown result"),
                         (["--lr-sweep", "fast"], "comma-separated"), (["--steps", "10", "--target-step", "20"], "1..")):
        with pytest.raises(SystemExit) as e:
            compare(argv)
        assert needle in str(e.value) and "\n" not in str(e.value), e.value


def test_link_model_against_hand_computed_rounds():
    """Two 10 Mbit/s peers, half the parameters each: each sends and receives half the votes and half
    the results, 0.5·P·(b + r) / 10⁷ s. The simulator's 100/50/20/10 links (parts ∝ upload rate): the
    10 Mbit/s peer uploads its votes for, and downloads the results of, 170/180 of the parameters."""
    from lioncub_p2p.sim.frontier import round_seconds, step_seconds, traffic
    from lioncub_p2p.sim.links import parse_links

    assert round_seconds(10**6, 1, 1, parse_links("10,10")) == pytest.approx(0.5 * 2e6 / 1e7)
    assert round_seconds(10**6, 1, 1, parse_links("100,50,20,10")) == pytest.approx(170 / 180 * 2e6 / 1e7)
    assert round_seconds(10**6, 4, 1, parse_links("100/10,100/10")) == pytest.approx(0.5e6 * 4 / 1e7 + 0.5e6 / 1e7)
    t = traffic("sign/majority+sync20", workers=4, steps=400)
    assert (t.vote_up, t.vote_down, t.sync_rounds_per_step) == (1.0, 1.0, 0.05)
    assert traffic("l1:4/mean", 4, 400).vote_down == 6.0  # tally of 4 voters × codes up to 14: 6 planes
    assert traffic("sign/majority+stream32", 4, 400).sync_rounds_per_step == 1 / 32
    links = parse_links("100,50,20,10")
    assert step_seconds(t, 10**6, 0.25, links) == pytest.approx(0.25 + 170 / 180 * (2e6 + 0.05 * 32e6) / 1e7)
    assert step_seconds(traffic("global", 4, 400), 10**6, 0.0, links) == pytest.approx(170 / 180 * 64e6 / 1e7)


def test_abstaining_votes_against_hand_counts():
    from lioncub_p2p.sim.variants import _abstain_vote

    # mean |c| per voter: 1, 4/3, 1, 5/3. Step 0, every 2: elements 0 and 2 may abstain, element 1 may not.
    dirs = [[torch.tensor([1.0, 1.0, -1.0])], [torch.tensor([1.0, 1.0, -2.0])],
            [torch.tensor([1.0, -1.0, -1.0])], [torch.tensor([-1.0, -3.0, -1.0])]]
    # element 0: voter 1 (|1| < 4/3) and voter 3 (|−1| < 5/3) abstain: +1 +1 -> +; element 1: 2-2 tie -> random
    # element 2: voter 3 abstains, voter 1 (|−2| >= 4/3) does not: −3 -> −
    u = _abstain_vote(dirs, seed=0, step=0, every=2)[0]
    assert u[0] == 1.0 and u[2] == -1.0 and abs(u[1]) == 1.0
    # step 1: only element 1 may abstain: voter 1 does (|1| < 4/3), voters 0, 2, 3 do not: +1 −1 −1 -> −
    assert _abstain_vote(dirs, seed=0, step=1, every=2)[0][1] == -1.0


def test_lr_search_walks_the_grid_to_the_best_point():
    from lioncub_p2p.sim.inprocess import search_lr

    grid = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
    best = {1e-3: 5.0, 2e-3: 4.0, 4e-3: 3.5, 8e-3: 3.0, 1.6e-2: float("nan")}  # diverged at the top
    calls = []
    lr, tried = search_lr(grid, 2e-3, lambda x: calls.append(x) or best[x])
    assert lr == 8e-3 and sorted(calls) == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2] and len(calls) == 5
    assert tried[1.6e-2] == math.inf and tried[8e-3] == 3.0
    calls.clear()
    lr, tried = search_lr(grid, 4e-3, lambda x: calls.append(x) or {1e-3: 9, 2e-3: 2, 4e-3: 1, 8e-3: 3, 1.6e-2: 9}[x])
    assert lr == 4e-3 and sorted(calls) == [2e-3, 4e-3, 8e-3]  # a minimum in the middle: 3 runs
    assert search_lr([1e-3], 1.0, lambda x: 1.0) == (1e-3, {1e-3: 1.0})


def test_a_two_level_majority_of_majorities_against_numpy(tmp_path, monkeypatch):
    """groupsG: one step of 9 workers in groups of 3 applies numpy's majority of the groups' majorities
    of the workers' gradient signs (momentum 0, no weight decay); it differs from the flat vote here."""
    task = _tiny_task(tmp_path, monkeypatch)
    workers, lr, seed = 9, 3e-2, 4
    model = task.make_model(seed)
    sources = task.batches(workers, 8, [torch.Generator().manual_seed(seed * 1000 + i) for i in range(workers)])
    signs = []
    for source in sources:
        model.zero_grad()
        task.loss(model, source()).backward()
        signs.append(np.concatenate([p.grad.reshape(-1).numpy() > 0 for p in model.parameters()]))
    signs = np.array(signs, dtype=int)
    groups = signs.reshape(3, 3, -1).sum(axis=1) >= 2
    expected = {"flat": signs.sum(axis=0) >= 5, "groups": groups.sum(axis=0) >= 2}
    assert (expected["flat"] != expected["groups"]).any()
    for name, bits in expected.items():
        stepped, offset = task.make_model(seed), 0
        with torch.no_grad():
            for p in stepped.parameters():
                p.add_(torch.from_numpy(bits[offset:offset + p.numel()] * 2.0 - 1).view_as(p).float(), alpha=-lr)
                offset += p.numel()
        expected[name] = task.evaluate(stepped)["loss"]
    kw = dict(workers=workers, steps=1, batch=8, lr=lr, weight_decay=0.0, seed=seed)
    assert run_variant(parse_method("sign/majority+groups3"), task, **kw).test_loss == pytest.approx(expected["groups"])
    assert run_variant(parse_method("sign/majority"), task, **kw).test_loss == pytest.approx(expected["flat"])
    assert expected["groups"] != pytest.approx(expected["flat"])
