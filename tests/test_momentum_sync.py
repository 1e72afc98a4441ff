"""A peer's momentum rounds without a network: what it uploads, what it keeps, against numpy."""
import numpy as np
import torch

from lioncub_p2p.allreduce import PeerSpec
from lioncub_p2p.allreduce.round import PartReport, RoundReport
from lioncub_p2p.momentum import MomentumSchedule
from lioncub_p2p.swarm.momentum_sync import MomentumSync

from reference import from_fp8_blocks, fp8_blocks


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def test_a_streamed_sync_uploads_the_slice_and_keeps_what_no_reducer_returned():
    """Slices of the selected buffers travel in bf16; the returned values replace them, except where
    the round returned NaN (a missing part), which keeps the peer's own; nothing else moves."""
    g = torch.Generator().manual_seed(0)
    buffers = [("enc.w", torch.randn(4, 6, generator=g)), ("enc.b", torch.randn(5, generator=g)),
               ("head.w", torch.randn(3, 3, generator=g))]
    before = {name: m.clone().numpy() for name, m in buffers}
    schedule = MomentumSchedule(slices=2, params=("enc.*",))
    sync = MomentumSync(schedule, "trimmed_mean", lambda: buffers, seed=0)
    step = 2  # the second slice: elements [n/2, n) of each selected buffer
    spec = sync.spec(b"r" * 16, step, (PeerSpec("a", 1.0), PeerSpec("b", 1.0)))
    assert spec.nbytes == 2 * (12 + 3) and spec.result.name == "trimmed_mean"
    sent = np.concatenate([before["enc.w"].ravel()[12:], before["enc.b"].ravel()[2:]])
    seen = {}

    def run_round(spec_, upload):
        seen["upload"] = upload.view(torch.bfloat16).float().numpy().ravel()
        back = torch.from_numpy(seen["upload"] * 2 + 1)
        back[10:] = float("nan")  # the part holding the last 5 values did not come back
        parts = [PartReport(0, 0, 0, 20, "ok"), PartReport(1, 1, 20, 30, "missing")]
        return back, RoundReport("r", step, 0, parts)

    assert sync.due(1) and sync.due(step)
    assert sync.average(spec, run_round) is False  # a part is missing
    np.testing.assert_array_equal(seen["upload"], _bf16(sent))
    want = np.where(np.arange(15) < 10, _bf16(sent) * 2 + 1, sent).astype(np.float32)
    after = {name: m.numpy() for name, m in buffers}
    np.testing.assert_array_equal(after["enc.w"].ravel()[:12], before["enc.w"].ravel()[:12])
    np.testing.assert_array_equal(after["enc.w"].ravel()[12:], want[:12])
    np.testing.assert_array_equal(after["enc.b"].ravel()[:2], before["enc.b"].ravel()[:2])
    np.testing.assert_array_equal(after["enc.b"].ravel()[2:], want[12:])
    np.testing.assert_array_equal(after["head.w"], before["head.w"])  # not selected


def test_a_whole_buffer_sync_with_every_part_back_reports_success():
    buffers = [("w", torch.arange(8, dtype=torch.float32))]
    sync = MomentumSync(MomentumSchedule(every=4), "average", lambda: buffers, seed=0)
    assert not sync.due(3) and sync.due(4)
    spec = sync.spec(b"s" * 16, 4, (PeerSpec("a", 1.0),))

    def run_round(spec_, upload):
        return torch.full((8,), 0.5), RoundReport("s", 4, 0, [PartReport(0, 0, 0, 16, "ok")])

    assert sync.average(spec, run_round) is True and spec.result.name == "average"
    assert torch.equal(buffers[0][1], torch.full((8,), 0.5))


def test_an_fp8_sync_uploads_blocks_and_drops_the_padding_of_the_last():
    """``wire="fp8"``: the selected values travel as fp8 blocks (numpy reference), 8 bytes per 7
    values with the last block padded; what comes back replaces them, without the padding."""
    buffers = [("w", torch.linspace(-3, 3, 10)), ("b", torch.tensor([1e-6, -2e-6, 3e-6]))]
    sync = MomentumSync(MomentumSchedule(every=2, wire="fp8"), "average", lambda: buffers, seed=0)
    spec = sync.spec(b"q" * 16, 2, (PeerSpec("a", 1.0),))
    assert spec.nbytes == 8 * 2 and spec.upload.name == "fp8"  # 13 values: two blocks
    sent = np.concatenate([buffers[0][1].numpy(), buffers[1][1].numpy()])
    seen = {}

    def run_round(spec_, upload):
        seen["upload"] = upload.numpy().ravel()
        return torch.from_numpy(from_fp8_blocks(seen["upload"])) * 2, RoundReport("q", 2, 0, [
            PartReport(0, 0, 0, 16, "ok")])

    assert sync.average(spec, run_round) is True
    np.testing.assert_array_equal(seen["upload"], fp8_blocks(sent))
    got = np.concatenate([m.numpy() for _, m in buffers])
    np.testing.assert_array_equal(got, 2 * from_fp8_blocks(fp8_blocks(sent))[:13])


def test_a_streamed_round_finished_a_step_later_corrects_by_what_came_back_minus_what_was_sent():
    """A streamed slice travels in the background while the next step runs; when it is finished its
    average replaces only what was sent: m = average + (m now - m sent), where a part came back, and
    m now elsewhere (numpy reference)."""
    import concurrent.futures

    g = torch.Generator().manual_seed(1)
    buffers = [("w", torch.randn(10, generator=g))]
    sync = MomentumSync(MomentumSchedule(slices=2), "average", lambda: buffers, seed=0)
    spec = sync.spec(b"t" * 16, 1, (PeerSpec("a", 1.0),))  # step 1: the first slice, elements [0, 5)
    sent_values = buffers[0][1].numpy().copy()
    future = concurrent.futures.Future()
    uploads = []
    sent = sync.start(spec, lambda spec_, upload: uploads.append(upload) or future)
    assert sent.future is future and len(uploads) == 1
    np.testing.assert_array_equal(uploads[0].view(torch.bfloat16).float().numpy().ravel(), _bf16(sent_values[:5]))
    with torch.no_grad():  # the next step moves the momentum while the round travels
        buffers[0][1].mul_(0.9).add_(0.25)
    now = buffers[0][1].numpy().copy()
    average = np.array([1.0, -1.0, 0.5, np.nan, 2.0], dtype=np.float32)  # part of element 3 missing
    future.set_result((torch.from_numpy(average.copy()), RoundReport("t", 1, 0, [PartReport(0, 0, 0, 10, "ok")])))
    assert sent.finish(timeout=1.0) is True
    want = now.copy()
    ok = ~np.isnan(average)
    want[:5][ok] = now[:5][ok] + (average[ok] - sent_values[:5][ok])
    np.testing.assert_allclose(buffers[0][1].numpy(), want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(buffers[0][1].numpy()[5:], now[5:])  # not in this slice


def _rounds(buffers, schedule: MomentumSchedule, *, member=lambda step: True, run=None):
    """MomentumRounds over ``buffers`` with a fake network: ``started`` holds (step, future) of each
    background round, ``loads`` the state downloads so far."""
    import concurrent.futures
    import logging

    from lioncub_p2p.swarm.momentum_sync import MomentumRounds
    from lioncub_p2p.swarm.records import RateLimitedLog

    sync = MomentumSync(schedule, "average", lambda: buffers, seed=0)
    started, loads = [], [0]

    def start(spec, upload):
        future = concurrent.futures.Future()
        started.append((spec.step, future, upload))
        return future

    def spec_for(step):
        return sync.spec(b"m" * 16, step, (PeerSpec("a", 1.0),)) if member(step) else None

    rounds = MomentumRounds(sync, spec_for, run or (lambda spec, upload: None), start, lambda: loads[0],
                            RateLimitedLog(logging.getLogger("lioncub_p2p.test"), period=0.0))
    return rounds, started, loads


def _back(future, upload, value: float, step: int) -> None:
    """The round's result: every element ``value`` (all parts back)."""
    n = upload.view(torch.bfloat16).numel()
    future.set_result((torch.full((n,), value), RoundReport("m", step, 0, [PartReport(0, 0, 0, 2 * n, "ok")])))


def test_streamed_rounds_are_kept_once_ended_and_the_oldest_is_given_up_past_the_in_flight_cap(caplog):
    """A slice's round starts after its step and is kept after the first later step that finds it
    ended; no step waits for one: with MOMENTUM_IN_FLIGHT rounds running, the oldest still running is
    given up (its slice keeps this peer's values, even if its result comes later)."""
    from lioncub_p2p.swarm.momentum_sync import MOMENTUM_IN_FLIGHT

    buffers = [("w", torch.zeros(40))]
    rounds, started, _ = _rounds(buffers, MomentumSchedule(slices=4))  # step s: elements 10·((s-1) % 4) + [0, 10)
    assert rounds.after_step(1) is None and [s for s, *_ in started] == [1]  # started, nothing to keep yet
    _back(started[0][1], started[0][2], 1.0, 1)
    assert rounds.after_step(2) is True  # step 1's slice kept as a correction: 0 + (1 - 0)
    assert buffers[0][1][:10].eq(1.0).all() and buffers[0][1][10:].eq(0.0).all()
    # step 2's round never ends: it is waited for while fewer than MOMENTUM_IN_FLIGHT run
    for step in range(3, 2 + MOMENTUM_IN_FLIGHT):
        assert rounds.after_step(step) is None
        assert [s.step for s in rounds.in_flight] == list(range(2, step + 1))
    with caplog.at_level("WARNING"):
        assert rounds.after_step(2 + MOMENTUM_IN_FLIGHT) is None
    assert [s.step for s in rounds.in_flight] == list(range(3, 3 + MOMENTUM_IN_FLIGHT))
    assert any("momentum round of step 2 is still running after 8 steps" in r.getMessage() for r in caplog.records)
    _back(started[1][1], started[1][2], 5.0, 2)  # step 2's result, too late: not kept
    _back(started[2][1], started[2][2], 3.0, 3)
    assert rounds.after_step(3 + MOMENTUM_IN_FLIGHT) is True
    assert buffers[0][1][10:20].eq(0.0).all()  # step 2's slice (elements 10..20): its own values
    assert buffers[0][1][20:30].eq(3.0).all()  # step 3's
    assert len(rounds.in_flight) == MOMENTUM_IN_FLIGHT


def test_a_state_download_voids_the_slices_sent_before_it_and_a_non_member_sends_none():
    buffers = [("w", torch.zeros(20))]
    rounds, started, loads = _rounds(buffers, MomentumSchedule(slices=2), member=lambda step: step != 3)
    rounds.after_step(1)
    loads[0] += 1  # the momenta were replaced by a download meanwhile
    _back(started[0][1], started[0][2], 7.0, 1)
    assert rounds.after_step(2) is None and buffers[0][1].eq(0.0).all()  # step 1's round ended: not kept
    assert [s.step for s in rounds.in_flight] == [2]
    _back(started[1][1], started[1][2], 2.0, 2)
    assert rounds.after_step(3) is True and [s for s, *_ in started] == [1, 2]  # no group at step 3: no round
    assert buffers[0][1][10:].eq(2.0).all() and not rounds.in_flight


def test_a_whole_buffer_round_that_fails_or_has_no_group_is_a_skipped_sync():
    buffers = [("w", torch.ones(8))]
    ran = []

    def run(spec, upload):
        ran.append(spec.step)
        raise ConnectionError("reducer gone")

    rounds, started, _ = _rounds(buffers, MomentumSchedule(every=2), member=lambda step: step != 4, run=run)
    assert rounds.after_step(1) is None and not ran  # not due
    assert rounds.after_step(2) is False and ran == [2]  # failed: logged, skipped
    assert rounds.after_step(4) is False and ran == [2]  # no group: no round
    assert buffers[0][1].eq(1.0).all() and not started
