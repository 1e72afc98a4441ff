"""The vote round under attack (issue 12): forged recovery, split quorums, lying reducers, stream and
memory exhaustion, noisy leaves. Each attack runs against real hivemind daemons on 127.0.0.1
(LocalSwarm) and asserts that honest peers end with identical updates, equal to the numpy reference
where one exists, within the round's deadlines."""
import asyncio
import dataclasses
import gc
import hashlib
import logging
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hivemind.p2p import PeerID

from lioncub_p2p import ops
from lioncub_p2p.allreduce import AllReduceConfig, PeerSpec, RoundSpec
from lioncub_p2p.allreduce.admission import Admission
from lioncub_p2p.allreduce.audit import check_evidence, judge, make_evidence, recount
from lioncub_p2p.allreduce.commit import (MAX_LEAF_BYTES, MAX_LEAVES, MerkleTree, build_header, leaf_bytes,
                                          leaf_count, leaf_of, parse_header, result_signed_bytes, verify_path)
from lioncub_p2p.allreduce.node import FETCH_PROTOCOL
from lioncub_p2p.allreduce.reducer import PartReduction
from lioncub_p2p.codecs import result_codec, upload_codec
from lioncub_p2p.identity import Identity, Verifier
from lioncub_p2p.testing import (FAST_CONFIG, HugeMomentumReduction, LocalSwarm, PeakRss, cancel, cpu_load,
                                 fd_exhaustion, forge_fetch_answers, hold_streams, lie_to, lying_reduction, rss_mib,
                                 start_outsider, trickler)
from lioncub_p2p.wire import PROTOCOL_VERSION, pb, write_frame

from reference import from_fp8_blocks, fp8_blocks
from test_allreduce import _codes, as_values, numpy_vote


def _spec(n: int, nbytes: int, upload: str = "sign", result: str = "majority", step: int = 3, seed: int = 5):
    return RoundSpec(b"unit-round", step, tuple(PeerSpec(f"peer{i}") for i in range(n)), nbytes,
                     upload_codec(upload), result_codec(result), seed)


# -- commitments and recounts, without daemons -----------------------------------------------------


@pytest.mark.parametrize("nbytes,planes", [(8, 1), (1003, 1), (100_000, 4), (3 << 20, 1), (1 << 20, 8)])
def test_merkle_openings_bind_each_leaf(nbytes, planes):
    codes = np.random.default_rng(nbytes).integers(0, 256, (planes, nbytes), dtype=np.uint8)
    leaf = leaf_bytes(nbytes, planes)
    count = leaf_count(nbytes, leaf)
    assert leaf % 8 == 0 and leaf * planes <= max(MAX_LEAF_BYTES, 8 * planes)
    assert count <= MAX_LEAVES or leaf * planes > MAX_LEAF_BYTES // 2  # many leaves only when leaves are capped
    tree = MerkleTree(codes, leaf)
    for k in sorted({0, count // 2, count - 1}):
        data = leaf_of(codes, leaf, k)
        assert len(data) == planes * (min((k + 1) * leaf, nbytes) - k * leaf)
        assert verify_path(tree.root, data, k, count, tree.path(k))
        forged = bytearray(data)
        forged[-1] ^= 1
        assert not verify_path(tree.root, bytes(forged), k, count, tree.path(k))  # other codes
        if count > 1:
            assert not verify_path(tree.root, data, (k + 1) % count, count, tree.path(k))  # another leaf
        assert not verify_path(tree.root, data, k, 2 * count + 1, tree.path(k))  # a deeper tree


CASES = [("sign", "majority"), ("sign", "ternary"), ("l1:4", "mean"), ("l1:3", "majority"),
         ("bf16", "average"), ("bf16", "trimmed_mean"), ("fp8", "average"), ("fp8", "trimmed_mean")]


@pytest.mark.parametrize("upload,result", CASES)
def test_recount_of_each_leaf_equals_the_numpy_reference(upload, result):
    """What an auditor recomputes from one leaf's opened votes is the numpy vote at those positions."""
    n, part = 5, 2
    momentum = upload in ("bf16", "fp8")
    numel = 8 * 40_000 if not momentum else 40_000
    if momentum:
        g = torch.Generator().manual_seed(1)
        values = [torch.randn(numel, generator=g) for _ in range(n)]
        values[3][::7] = 1e30
        codes = [upload_codec(upload).encode(v) for v in values]
        nbytes = codes[0].shape[1]
    else:
        codes = _codes(upload, n, numel, seed=2)
        nbytes = codes[0].shape[1]
    spec = _spec(n, nbytes, upload, result)
    a, b = spec.bounds[part]
    counted = [0, 1, 3, 4]  # voter 2 left out, as after a failure
    leaf = leaf_bytes(b - a, spec.upload.planes)
    roots = [MerkleTree(codes[v][:, a:b].numpy(), leaf).root for v in counted]
    header = parse_header(build_header(spec, part, counted, roots, b"", 0, b""))
    if momentum:
        decode = (lambda c: c.view(torch.bfloat16).double().numpy()) if upload == "bf16" else \
            (lambda c: from_fp8_blocks(c.numpy()).astype(np.float64))
        rows = np.stack([decode(codes[v][0]) for v in counted])
        whole = rows.mean(0) if result == "average" else np.sort(rows, 0)[1:-1].mean(0)  # 4 rows: trim 1 each end
        if upload == "fp8":  # the result is fp8 blocks too
            whole = from_fp8_blocks(fp8_blocks(whole)).astype(np.float64)
    else:
        whole = numpy_vote([codes[v] for v in counted], upload, result, 8 * nbytes, spec.seed, spec.step)
    for k in (0, leaf_count(b - a, leaf) - 1):
        got = recount(header, spec.upload, spec.result, k, [leaf_of(codes[v][:, a:b].numpy(), leaf, k) for v in counted])
        lo, hi = a + k * leaf, min(a + (k + 1) * leaf, b)
        want = whole[spec.upload.value_span(lo, hi)] if momentum else whole[8 * lo: 8 * hi]
        np.testing.assert_allclose(got.double().numpy(), want, rtol=2 ** -7, atol=1e-6)


def test_evidence_proves_a_lie_to_anyone_and_nothing_else(tmp_path):
    reducer, other = Identity.load_or_create(tmp_path / "r.key"), Identity.load_or_create(tmp_path / "o.key")
    n, part = 4, 1
    codes = _codes("sign", n, 8 * 3000, seed=3)
    group = tuple(PeerSpec(reducer.peer_id if i == part else f"peer{i}") for i in range(n))
    spec = RoundSpec(b"evidence", 2, group, codes[0].shape[1], seed=1)
    red = asyncio.run(_reduce(spec, part, codes))
    honest = red.close()
    a, b = spec.bounds[part]
    header = parse_header(honest.header)
    k = 0
    answers = [pb.AuditAnswer(version=PROTOCOL_VERSION, leaf=k, voter=v, codes=leaf_of(red.votes[v], header.leaf_bytes, k),
                              path=red.trees[v].path(k)) for v in header.counted]
    np.testing.assert_array_equal(as_values(torch.frombuffer(bytearray(honest.wire), dtype=torch.uint8), 8 * (b - a)),
                                  numpy_vote([c[:, a:b] for c in codes], "sign", "majority", 8 * (b - a), 1, 2)
                                  if a == 0 else _part_vote(codes, a, b, 1, 2))
    assert judge(header, honest.wire, k, answers) is None  # the honest result survives its audit

    def signed(wire: bytes, signer: Identity = reducer) -> tuple[bytes, bytes]:
        raw = build_header(spec, part, header.counted, header.roots, header.tag, header.tag_votes, wire)
        return raw, signer.sign(result_signed_bytes(raw))

    lie = bytes(x ^ 0xFF for x in honest.wire)
    raw, signature = signed(lie)
    assert judge(parse_header(raw), lie, k, answers)
    evidence = make_evidence(raw, signature, reducer.public_key, lie, k, answers)
    convicted = check_evidence(evidence, Verifier())
    assert convicted is not None and convicted[:3] == (reducer.peer_id, spec.round_id, part)
    # tampered or incomplete evidence proves nothing
    assert check_evidence(make_evidence(raw, signature, reducer.public_key, honest.wire, k, answers)) is None  # digest
    raw_h, sig_h = signed(honest.wire)
    assert check_evidence(make_evidence(raw_h, sig_h, reducer.public_key, honest.wire, k, answers)) is None  # honest
    raw_o, sig_o = signed(lie, other)
    assert check_evidence(make_evidence(raw_o, sig_o, reducer.public_key, lie, k, answers)) is None  # signer
    forged = [pb.AuditAnswer(version=PROTOCOL_VERSION, leaf=k, voter=x.voter, codes=bytes(len(x.codes)), path=x.path)
              for x in answers]
    assert check_evidence(make_evidence(raw, signature, reducer.public_key, lie, k, forged)) is None  # votes
    assert check_evidence(b"\x0a\xff" + bytes(100)) is None


def test_an_fp8_momentum_result_off_by_more_than_a_step_is_convicted():
    """An fp8 momentum part's recount may round to the neighbouring e4m3 value (another summation
    order), so one step is tolerated; a value three steps off is a lie an audit proves."""
    n, part = 4, 1
    g = torch.Generator().manual_seed(4)
    codes = [upload_codec("fp8").encode(torch.randn(7 * 4000, generator=g)) for _ in range(n)]
    spec = _spec(n, codes[0].shape[1], "fp8", "average")
    red = asyncio.run(_reduce(spec, part, codes))
    honest = red.close()
    header = parse_header(honest.header)
    answers = [pb.AuditAnswer(version=PROTOCOL_VERSION, leaf=0, voter=v, codes=leaf_of(red.votes[v], header.leaf_bytes, 0),
                              path=red.trees[v].path(0)) for v in header.counted]

    wire = honest.wire
    at = next(i for i in range(len(wire)) if i % 8 and 0x20 <= wire[i] & 0x7F < 0x60)  # a normal e4m3 value

    def moved(steps: int) -> tuple[pb.ResultHeader, bytes]:  # its magnitude that many e4m3 steps up
        lie = bytearray(wire)
        lie[at] += steps  # sign and magnitude: the next byte is the next larger magnitude
        raw = build_header(spec, part, header.counted, header.roots, header.tag, header.tag_votes, bytes(lie))
        return parse_header(raw), bytes(lie)

    assert judge(header, honest.wire, 0, answers) is None
    assert judge(*moved(1), 0, answers) is None
    assert "differs from the recount" in judge(*moved(3), 0, answers)


def _part_vote(codes, a, b, seed, step):
    whole = numpy_vote(codes, "sign", "majority", 8 * codes[0].shape[1], seed, step)
    return whole[8 * a: 8 * b]


async def _reduce(spec: RoundSpec, part: int, codes: list[torch.Tensor]) -> PartReduction:
    red = PartReduction(spec, part)
    a, b = spec.bounds[part]
    for v, c in enumerate(codes):
        red.add(v, 0, c[:, a:b].clone(), last=True)
    return red


# -- results bound to their reducer ---------------------------------------------------------------


def _expected(codes, reports, numel, seed=0, step=0, zero=()):
    """Each part: the numpy vote over exactly the voters it counted; parts in ``zero``: 0."""
    expected = np.zeros(numel)
    for part in reports.parts:
        if part.status not in ("ok", "recovered") or part.index in zero:
            continue
        expected[8 * part.start: 8 * part.stop] = _part_vote([codes[i] for i in part.counted], part.start, part.stop,
                                                             seed, step)
    return expected


@pytest.mark.slow
def test_forged_results_for_a_dead_reducers_part_are_ignored():
    """Reducer 1 dies before answering; member 4 answers every recovery request with forged bytes
    (signed with its own key, with the reducer's key and a bad signature, unsigned): every honest
    survivor refuses them and applies zero there, identically, and the numpy vote elsewhere."""
    numel, dead, rogue = 8 * 6000, 1, 4
    codes = _codes("sign", 5, numel, seed=21)
    with LocalSwarm(5) as swarm:
        swarm.kill(dead, on="finalize")
        for step, variant in enumerate(["own key", "reducer's key", "unsigned"]):
            forge_fetch_answers(swarm, rogue, variant)
            started = time.monotonic()
            results = swarm.allreduce(codes, step=step)
            assert time.monotonic() - started < FAST_CONFIG.result_timeout + FAST_CONFIG.recovery_timeout + 2
            honest = [0, 2, 3]
            for i in honest:
                assert swarm.reports[i].parts[dead].status == "missing", variant
                np.testing.assert_array_equal(as_values(results[i], numel),
                                              _expected(codes, swarm.reports[0], numel, step=step))
            assert all(torch.equal(results[i], results[0]) for i in honest)


@pytest.mark.slow
def test_recovery_must_fail_when_nobody_received_the_result():
    """The reducer dies before answering anyone (recovery must succeed: test_allreduce.py,
    test_reducer_killed_mid_answer_survivors_agree): nobody holds its signed result, so every
    survivor applies zero there and the numpy vote elsewhere."""
    numel, reducer = 8 * 6000, 2
    codes = _codes("sign", 4, numel, seed=23)
    with LocalSwarm(4) as swarm:
        swarm.kill(reducer, on="finalize")
        results = swarm.allreduce(codes)
        for i in (0, 1, 3):
            assert swarm.reports[i].parts[reducer].status == "missing"
            np.testing.assert_array_equal(as_values(results[i], numel), _expected(codes, swarm.reports[0], numel))
        part = swarm.reports[0].parts[reducer]
        assert not as_values(results[0], numel)[8 * part.start: 8 * part.stop].any()


# -- quorum ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_reducer_left_with_its_own_vote_applies_nothing_like_everyone_else():
    """The split slot exhaustion caused: reducer 1 counts only its own vote (every other voter is
    refused). Its result is below the quorum, so it applies zero there like the others."""
    numel, lonely = 8 * 6000, 1
    codes = _codes("sign", 4, numel, seed=24)
    with LocalSwarm(4) as swarm:
        node = swarm.nodes[lonely]
        node.admission = Admission(allow=frozenset({node.peer_id}))
        results = swarm.allreduce(codes)
        part = swarm.reports[0].parts[lonely]
        for i in range(4):
            assert swarm.reports[i].parts[lonely].status == "missing"
            assert not as_values(results[i], numel)[8 * part.start: 8 * part.stop].any()
            np.testing.assert_array_equal(as_values(results[i], numel), _expected(codes, swarm.reports[0], numel))
        assert "quorum" in swarm.reports[lonely].parts[lonely].note


# -- audits a reducer cannot predict ----------------------------------------------------------------


def _seed_audits(swarm: LocalSwarm, seed: int) -> None:
    for i, node in enumerate(swarm.nodes):
        node.audit_rng = random.Random(1000 * seed + i)


def _caught_by(swarm: LocalSwarm, peers) -> dict[int, object]:
    return {i: swarm.nodes[i].caught[swarm.nodes[liar].peer_id] for i in peers
            for liar in range(swarm.n) if swarm.nodes[liar].peer_id in swarm.nodes[i].caught}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("probability", [1.0, 0.5])
def test_a_lying_reducer_is_caught_within_a_few_rounds(seed, probability):
    """Reducer 1 flips its result (every round, or on a coin of its own). Every voter audits one other
    part per round, chosen after the results are in, so the liar cannot know when to tell the truth:
    in a group of 4 each lying round is caught with probability 1 - (2/3)^3 = 0.70. Caught within
    12 rounds (fixed seeds), with evidence anyone can check; honest reducers are never accused, and
    until then all peers apply the same (lied) update."""
    numel, liar, honest = 8 * 8000, 1, (0, 2, 3)
    codes = _codes("sign", 4, numel, seed=30 + seed)
    lying = lying_reduction(probability, seed=seed)
    with LocalSwarm(4) as swarm:
        _seed_audits(swarm, seed)
        swarm.nodes[liar].reduction_factory = lying
        liar_id = swarm.nodes[liar].peer_id
        for step in range(12):
            results = swarm.allreduce(codes, step=step)
            assert all(torch.equal(results[i], results[0]) for i in range(4))
            swarm.settle_audits()
            catchers = [i for i in honest if liar_id in swarm.nodes[i].caught]
            if catchers:
                break
        assert catchers, f"not caught in 12 rounds; it lied in {len(lying.lies)}"
        caught = swarm.nodes[catchers[0]].caught[liar_id]
        assert caught.kind == "lie" and caught.round_id in lying.lies
        verdict = check_evidence(caught.evidence, Verifier())
        assert verdict is not None and verdict[:3] == (liar_id, caught.round_id, liar)
        for i in honest:  # no honest reducer is ever accused
            assert set(swarm.nodes[i].caught) <= {liar_id}
        swarm.allreduce(codes, step=100)  # the catch is reported in the catcher's next round
        assert any(c.peer_id == liar_id for c in swarm.reports[catchers[0]].caught)


@pytest.mark.slow
def test_lying_to_one_voter_is_caught_by_that_voter():
    """Reducer 1 sends voter 3 a different (validly signed) result than everyone else. Voter 3
    applies it (a split the swarm's digest repair fixes) but catches the liar with evidence within
    12 rounds: it audits that part with probability 1/3 each round."""
    numel, liar, victim = 8 * 8000, 1, 3
    codes = _codes("sign", 4, numel, seed=40)
    with LocalSwarm(4) as swarm:
        _seed_audits(swarm, 4)
        lied = lie_to(swarm.nodes[liar], victim)
        liar_id = swarm.nodes[liar].peer_id
        for step in range(12):
            results = swarm.allreduce(codes, step=step)
            assert torch.equal(results[0], results[2]) and not torch.equal(results[0], results[victim])
            swarm.settle_audits()
            if liar_id in swarm.nodes[victim].caught:
                break
        caught = swarm.nodes[victim].caught[liar_id]
        assert caught.kind == "lie" and caught.round_id in lied
        assert check_evidence(caught.evidence)[0] == liar_id
        assert all(liar_id not in swarm.nodes[i].caught for i in (0, 2))  # they got the truth


@pytest.mark.slow
@pytest.mark.parametrize("upload", ["bf16", "fp8"])
@pytest.mark.parametrize("rule", ["average", "trimmed_mean"])
def test_a_reducer_cannot_push_huge_momenta(rule, upload):
    """Reducer 1 returns 1e30 momenta. Every receiver bounds a momentum result by the maxima the
    counted voters signed (after trimming), so all refuse it and keep their own momenta there (NaN in
    the update); the other parts are the numpy mean / trimmed mean."""
    numel, liar = 4 * 3001, 1
    g = torch.Generator().manual_seed(50)
    values = [torch.randn(numel, generator=g) for _ in range(4)]
    codec = upload_codec(upload)
    uploads = [codec.encode(v) for v in values]
    rows = np.stack([codec.decode(u).double().numpy()[:numel] for u in uploads])
    want = rows.mean(0) if rule == "average" else np.sort(rows, 0)[1:-1].mean(0)
    if upload == "fp8":  # results are fp8 blocks too
        want = from_fp8_blocks(fp8_blocks(want))[:numel].astype(np.float64)
    with LocalSwarm(4) as swarm:
        swarm.nodes[liar].reduction_factory = HugeMomentumReduction
        results = swarm.allreduce(uploads, upload=upload, result=rule)
        results = [r[:numel] for r in results]
        span = codec.value_span(swarm.reports[0].parts[liar].start, swarm.reports[0].parts[liar].stop)
        a, b = span.start, min(span.stop, numel)
        for i in (0, 2, 3):
            got = results[i].double().numpy()
            assert swarm.reports[i].parts[liar].status == "missing"
            assert np.isnan(got[a:b]).all()
            keep = np.ones(numel, bool)
            keep[a:b] = False
            np.testing.assert_allclose(got[keep], want[keep], rtol=1e-2, atol=1e-2)
            assert np.nanmax(np.abs(got)) < 10
        assert all(torch.equal(results[i].nan_to_num(), results[0].nan_to_num()) for i in (0, 2, 3))
        for step in range(1, 4):  # honest momentum parts survive the audits (recounts re-encoded): no false alarm
            swarm.allreduce(uploads, upload=upload, result=rule, step=step)
        swarm.settle_audits()
        assert not any(swarm.nodes[i].catches for i in (0, 2, 3))
        assert all(swarm.reports[i].audit[2] == "ok" for i in (0, 2, 3))  # each audited an honest momentum part


# -- honest reducers are never accused ------------------------------------------------------------


def _stash_audits(node) -> list:
    """Hold back ``node``'s audits: (state, outcomes) per round, to start later with ``_release``."""
    stashed: list = []
    node._start_audits = lambda state, outcomes: stashed.append((state, outcomes))
    return stashed


def _release(swarm: LocalSwarm, node, stashed: list, part: int) -> None:
    """Start every held-back audit at once, each of ``part`` (one reducer), then wait for them."""
    del node._start_audits  # the class's own again

    async def start() -> None:
        for state, outcomes in stashed:
            node._start_audits(state, {part: outcomes[part]})

    swarm.run(start())
    swarm.settle_audits()


@pytest.mark.slow
def test_audits_asked_late_and_all_at_once_are_answered():
    """Voter 0 holds back its audits for 8 rounds, then asks reducer 1 about all of them at once:
    rounds 0-3 have left reducer 1's table of live rounds (``keep_rounds`` = 4) but not the window it
    promised (archive), and 8 audits at once exceed its audit stream cap for one peer (2), so the
    auditor asks one at a time. Every audit is answered and agrees: no accusation (before: 4
    "unknown or forgotten round" and the streams over the cap closed early, all counted as unanswered)."""
    numel, n, rounds = 8 * 4000, 3, 8
    with LocalSwarm(n) as swarm:
        auditor, reducer = swarm.nodes[0], swarm.nodes[1]
        stashed = _stash_audits(auditor)
        for step in range(rounds):
            results = swarm.allreduce(_codes("sign", n, numel, seed=60 + step), step=step)
            assert all(torch.equal(r, results[0]) for r in results)
        first = stashed[0][0].spec.round_id
        assert first not in reducer._rounds  # forgotten by the table of live rounds
        _release(swarm, auditor, stashed, part=1)
        assert [state.report.audit for state, _ in stashed] == [(1, 1, "ok")] * rounds
        assert not auditor.catches and auditor.audits_expired == 0
        assert reducer.gates["lioncub/audit/1"].refused == 0 and first in reducer.archive


@pytest.mark.slow
def test_a_reducer_that_claims_it_forgot_within_its_window_is_caught():
    """The window cannot be used to dodge: reducer 1 answers every audit "unknown or forgotten round".
    Voter 0 asked right after the reducer sent it the result, within the window: unanswered."""
    numel, n = 8 * 4000, 3
    with LocalSwarm(n) as swarm:
        auditor, dodger = swarm.nodes[0], swarm.nodes[1]
        dodger._audited = lambda round_id: None
        stashed = _stash_audits(auditor)
        swarm.allreduce(_codes("sign", n, numel, seed=70))
        _release(swarm, auditor, stashed, part=1)
        caught = auditor.caught[dodger.peer_id]
        assert caught.kind == "unanswered" and "forgotten" in caught.reason
        assert set(auditor.caught) == {dodger.peer_id}


@pytest.mark.slow
def test_an_audit_not_asked_within_half_the_window_is_dropped_not_counted():
    """An auditor whose audits wait longer than half of ``audit_window_s`` (a slow queue) drops them:
    the reducer may rightly have forgotten the round by the time the request arrives."""
    numel, n = 8 * 4000, 3
    with LocalSwarm(n) as swarm:
        auditor = swarm.nodes[0]
        auditor.config = dataclasses.replace(auditor.config, audit_window_s=0.4)
        for node in swarm.nodes[1:]:
            node._audited = lambda round_id: None  # every reducer has forgotten everything
        stashed = _stash_audits(auditor)
        swarm.allreduce(_codes("sign", n, numel, seed=71))
        time.sleep(0.5)
        _release(swarm, auditor, stashed, part=1)
        assert stashed[0][0].report.audit == (1, 1, "expired") and auditor.audits_expired == 1
        assert not auditor.catches


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "quic"])
def test_honest_peers_under_load_and_a_slow_peer_never_accuse_each_other(transport):
    """60 rounds of 4 honest peers, peer 2 slowed (its daemon frozen 30 ms of every 60 ms, and starting
    each round 50 ms late) on a machine with two extra busy processes: no catch of any kind, every
    round's updates identical, and most audits actually ran ("ok"). Over QUIC, before the fix, 153
    audits of 240 ended "audit stream closed early" (the reducer closed its stream right after its
    last answer, and the daemon dropped that tail), the message the compose check showed."""
    numel, rounds, slow = 8 * 20_000, 60, 2
    g = torch.Generator().manual_seed(80)
    reports = []
    with LocalSwarm(4, transport=transport) as swarm, cpu_load(2):
        with swarm.throttled(slow, stopped=0.03, running=0.03):
            for step in range(rounds):
                codes = [ops.pack_signs(torch.randn(numel, generator=g)) for _ in range(4)]
                results = swarm.allreduce(codes, step=step, delays={slow: 0.05})
                assert all(r is not None and torch.equal(r, results[0]) for r in results), step
                reports += swarm.reports
        swarm.settle_audits()
        catches = [(c.kind, c.reason) for node in swarm.nodes for c in node.catches]
        assert catches == []
    verdicts = [r.audit[2] if r.audit else "none" for r in reports]
    assert verdicts.count("ok") >= 0.9 * len(verdicts), sorted(set(verdicts))


# -- admission before resources ---------------------------------------------------------------------


@pytest.mark.slow
def test_an_outsider_holding_hundreds_of_idle_streams_cannot_stop_rounds():
    """An outsider keeps 280 idle streams open at reducer 1 on the vote, fetch and audit handlers
    (re-dialing each as it is closed) through 3 rounds where every voter dials afresh: it gets 2 per
    handler, each for the first-frame deadline; members are never refused and every round is the
    exact numpy vote."""
    from lioncub_p2p.allreduce.node import AUDIT_PROTOCOL, VOTE_PROTOCOL

    numel, victim = 8 * 8000, 1
    codes = _codes("sign", 4, numel, seed=60)
    fresh = AllReduceConfig(upload_timeout=3.0, result_timeout=6.0, join_timeout=2.0, recovery_timeout=2.0,
                            keep_streams_s=0.0)  # every vote dials a fresh stream: what the flood aims at
    with LocalSwarm(4, config=fresh) as swarm:
        swarm.allreduce(codes, step=0)
        outsider = swarm.run(start_outsider(swarm))
        stop = asyncio.Event()
        victim_id = swarm.nodes[victim].peer_id
        futures = [asyncio.run_coroutine_threadsafe(hold_streams(outsider, victim_id, proto, 280, stop, redial=2.0),
                                                    swarm._loop.loop)
                   for proto in (VOTE_PROTOCOL, FETCH_PROTOCOL, AUDIT_PROTOCOL)]
        gates = swarm.nodes[victim].gates
        try:  # the flood is on once every handler refused dials (2 per handler held); slower under load
            deadline = time.monotonic() + 30
            while not all(gates[p].refused > 0 for p in gates) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert all(gates[p].refused > 0 for p in gates), {p: gates[p].refused for p in gates}
            for step in range(1, 4):
                started = time.monotonic()
                results = swarm.allreduce(codes, step=step)
                bound = fresh.result_timeout + fresh.recovery_timeout  # a round's deadline
                assert time.monotonic() - started < bound, [r.timings for r in swarm.reports]
                # exact: each part is the numpy vote of the members its reducer counted, the same on
                # every peer, never short of a quorum. (Counted are all 4 unless a member's vote came
                # after the deadline: once in a CI run with the other xdist worker loading both cores.)
                got = [as_values(results[i], numel) for i in range(4)]
                for j, part in enumerate(swarm.reports[0].parts):
                    counted = part.counted
                    assert part.status == "ok" and len(counted) >= 3, (j, part.status, part.note, counted)
                    assert all(swarm.reports[i].parts[j].counted == counted for i in range(4))
                    want = numpy_vote([codes[c] for c in counted], "sign", "majority", numel, 0, step)
                    span = slice(8 * part.start, 8 * part.stop)
                    for i in range(4):
                        np.testing.assert_array_equal(got[i][span], want[span])
        finally:
            swarm._loop.loop.call_soon_threadsafe(stop.set)
            dialed = [f.result(60) for f in futures]
            swarm.run(outsider.shutdown())
        assert min(dialed) >= 280


def test_fetch_and_audit_streams_answer_members_and_refuse_peers_without_the_run_secret():
    """Both members hold the run secret. Once a round ended, member 1 asking reducer 0 for that round's
    result and an audit gets them; an outsider asking the same with a token of another secret, or with
    none, is refused "not admitted" and gets no codes (a second-level round's results go to any
    admitted peer, so membership alone is not the gate)."""
    from lioncub_p2p.allreduce.node import AUDIT_PROTOCOL
    from lioncub_p2p.wire import read_frame

    numel = 8 * 4000
    codes = _codes("sign", 2, numel, seed=62)
    with LocalSwarm(2) as swarm:
        reducer, member = swarm.nodes
        run = Admission(run_id="r", secret=b"s3cret")
        for node in swarm.nodes:
            node.admission = run
        swarm.allreduce(codes)
        round_id = bytes.fromhex(swarm.reports[0].round_id)
        outsider = swarm.run(start_outsider(swarm))
        outsider_id = outsider.peer_id.to_base58()

        async def ask(p2p, protocol: str, request, reply_type):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(reducer.peer_id), protocol)
            try:
                await write_frame(writer, request)
                reply, _ = await asyncio.wait_for(read_frame(reader, reply_type), 10)
                return reply
            finally:
                writer.close()

        def fetch(p2p, token: bytes):
            return swarm.run(ask(p2p, FETCH_PROTOCOL, pb.FetchResult(version=PROTOCOL_VERSION, round_id=round_id,
                                                                     part=0, token=token), pb.ResultChunk))

        def audit(p2p, token: bytes):
            return swarm.run(ask(p2p, AUDIT_PROTOCOL, pb.AuditRequest(version=PROTOCOL_VERSION, round_id=round_id,
                                                                      part=0, leaves=[0], token=token), pb.AuditAnswer))

        try:
            mine = run.token(member.peer_id)
            result, opened = fetch(member.p2p, mine), audit(member.p2p, mine)
            assert not result.error and result.header and result.signature, result.error
            assert not opened.error and opened.codes, opened.error
            for token in (Admission(run_id="r", secret=b"guess").token(outsider_id), b""):
                refused, unopened = fetch(outsider, token), audit(outsider, token)
                assert refused.error == "not admitted: wrong or missing run secret" and not refused.data
                assert unopened.error == "not admitted: wrong or missing run secret" and not unopened.codes
        finally:
            swarm.run(outsider.shutdown())


@pytest.mark.slow
def test_fake_rounds_cannot_fill_the_table_of_rounds_not_started_yet():
    """A member and an outsider announce votes for 20 rounds that do not exist while reducer 0 starts
    the real round 0.8 s late: each may wait for 2 unknown rounds at most, so the members' votes for
    the real round are held and counted, and the round is the exact numpy vote."""
    from lioncub_p2p.allreduce.node import VOTE_PROTOCOL

    numel, late = 8 * 8000, 0
    codes = _codes("sign", 4, numel, seed=61)
    with LocalSwarm(4) as swarm:
        swarm.allreduce(codes, step=0)  # member 3 is a known member from here on: 8 streams, not 2
        outsider = swarm.run(start_outsider(swarm))
        late_id = swarm.nodes[late].peer_id

        def fake_first_chunk(k: int) -> bytes:
            body = pb.VoteChunk(version=PROTOCOL_VERSION, round_id=b"fake-%d" % k, part=late, length=8, offset=0,
                                upload=pb.UPLOAD_SIGN, upload_bits=1, result=pb.RESULT_MAJORITY, codes=bytes(8),
                                last=False).SerializeToString()
            return len(body).to_bytes(4, "big") + body

        async def flood(p2p, until):
            await asyncio.gather(*(hold_streams(p2p, late_id, VOTE_PROTOCOL, 1, until, fake_first_chunk(k))
                                   for k in range(20)))

        stop = asyncio.Event()  # member 3 and the outsider flood fake rounds from before the round on
        floods = [asyncio.run_coroutine_threadsafe(flood(p2p, stop), swarm._loop.loop)
                  for p2p in (outsider, swarm.nodes[3].p2p)]
        try:
            time.sleep(1.5)
            results = swarm.allreduce(codes, step=1, delays={late: 0.8}, prepare=False)
        finally:
            swarm._loop.loop.call_soon_threadsafe(stop.set)
            for f in floods:
                f.result(60)
            swarm.run(outsider.shutdown())
        for i in range(4):  # the flooding member may lose its own vote there; the others are counted
            assert {0, 1, 2} <= set(swarm.reports[i].parts[late].counted)
            statuses = {"ok"} if i < 3 else {"ok", "recovered"}  # the flooder gets its result from peers
            assert all(p.status in statuses for p in swarm.reports[i].parts), [p.note for p in swarm.reports[i].parts]
            np.testing.assert_array_equal(as_values(results[i], numel),
                                          _expected(codes, swarm.reports[0], numel, step=1))
            assert torch.equal(results[i], results[0])


# -- quiet leaves ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_leaving_mid_round_logs_no_error_and_no_traceback(caplog, capfd):
    """Rounds leave kept streams open at every reducer; then the swarm leaves while a round is in
    flight (tasks cancelled first, daemons closed after, as a leaving Swarm does): nothing is logged
    at ERROR and no traceback is printed."""
    import threading

    codes = _codes("sign", 4, 8 * 8000, seed=70)
    with caplog.at_level(logging.DEBUG):
        swarm = LocalSwarm(4).__enter__()
        try:
            for step in range(3):
                swarm.allreduce(codes, step=step)
            inflight = threading.Thread(target=lambda: _ignore(swarm.allreduce, codes, step=3, delays={3: 30}))
            inflight.start()
            deadline = time.monotonic() + 10
            while not any(r.first_in.is_set() for n in swarm.nodes for s in n._rounds.values()
                          for r in [s.reduction] if r is not None and s.spec.step == 3):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            swarm.__exit__(None, None, None)
        inflight.join(30)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    printed = capfd.readouterr()
    text = printed.out + printed.err + "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback" not in text and "CancelledError" not in text


def test_a_daemon_connection_closed_before_its_stream_info_is_not_an_error(caplog):
    """The shutdown race above has a second shape: the daemon closes a connection before its stream info
    arrived, and hivemind's handler raises IncompleteReadError with nothing of the message read. That is
    DEBUG. A cut in the message itself, the same error raised elsewhere (this project's handlers) and any
    other error still reach asyncio's handler at ERROR."""
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    from lioncub_p2p.aio import _quiet_cancelled_connections

    loop = asyncio.new_event_loop()
    try:
        def raised(data: bytes, handler=ControlClient._handler) -> BaseException:
            reader = asyncio.StreamReader(loop=loop)
            reader.feed_data(data)
            reader.feed_eof()
            try:
                loop.run_until_complete(handler(SimpleNamespace(handlers={}), reader, None))
            except Exception as e:
                return e
            raise AssertionError("no error raised")

        async def own_handler(self, reader, writer):
            await reader.readexactly(4)

        def report(error):
            caplog.clear()
            with caplog.at_level(logging.DEBUG):
                _quiet_cancelled_connections(loop, {"message": "Unhandled exception in client_connected_cb",
                                                    "exception": error})
            return [r.levelno for r in caplog.records]
        assert report(raised(b"")) == [logging.DEBUG]
        assert report(raised(b"\x80")) == [logging.DEBUG]  # cut inside the length prefix: nothing of the message
        assert logging.ERROR in report(raised(b"\x05ab"))  # cut in the message itself
        assert logging.ERROR in report(raised(b"", handler=own_handler))
        assert logging.ERROR in report(asyncio.IncompleteReadError(b"", 4))  # no traceback: not the daemon's
        assert logging.ERROR in report(ValueError("a real bug"))
    finally:
        loop.close()


def _ignore(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except BaseException:
        pass


# -- bounded memory --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_trickling_member_cannot_grow_a_peer():
    """Member 4 (client mode) trickles 8-byte chunks to every reducer every 0.5 s, on a new stream
    each round, for 30 rounds of 1 MiB per plane. Every stream ends at its round's serve deadline
    (join + upload + result timeout) and a peer keeps ``keep_rounds`` rounds: the process (4 honest
    peers) stays flat, RSS growth from round 10 to 30 under 64 MiB (measured -7 MiB alone, +55 MiB
    once in a loaded xdist worker; with the
    deadline, the release of forgotten rounds and the per-peer stream cap all removed: +151 MiB,
    ~8 MiB per round); at most 8 trickling streams per reducer at once. What the honest rounds leave
    in each peer's archive for the audit window (their votes and results, ~2 MiB per peer and round
    here, at most ``audit_keep_bytes``) is by design and is taken out of the growth."""
    from lioncub_p2p.allreduce.node import VOTE_PROTOCOL

    numel, rounds = 8 << 20, 30
    codes = _codes("sign", 5, numel, seed=80)
    behave, tasks = trickler(0.5)
    with LocalSwarm(5, client_mode=(4,)) as swarm:
        rss = {}
        for step in range(rounds):
            started = time.monotonic()
            results = swarm.allreduce(codes, step=step, behaviors={4: behave})
            assert time.monotonic() - started < FAST_CONFIG.result_timeout
            assert all(torch.equal(results[i], results[0]) for i in range(4))
            if step in (0, rounds - 1):
                want = numpy_vote(codes[:4], "sign", "majority", numel, 0, step)
                np.testing.assert_array_equal(as_values(results[0], numel), want)
            for node in swarm.nodes[:4]:
                assert len(node._rounds) <= node.config.keep_rounds
                assert node.gates[VOTE_PROTOCOL].open_by_peer[swarm.nodes[4].peer_id] <= 8
            archived = sum(node.archive.nbytes for node in swarm.nodes)
            assert all(node.archive.nbytes <= node.config.audit_keep_bytes for node in swarm.nodes)
            if step in (10, rounds - 1):
                gc.collect()  # what Python can free is not growth
            rss[step] = rss_mib() - archived / 2 ** 20
        swarm.run(cancel(tasks))
    growth = rss[rounds - 1] - rss[10]
    print(f"RSS less the archives at rounds 0/10/{rounds - 1}: {rss[0]:.0f}/{rss[10]:.0f}/{rss[rounds - 1]:.0f} MiB")
    # 64 MiB: in an xdist worker that ran other tests first, allocator noise reached +55 MiB once;
    # the attack with its defences removed grows the process by +151 MiB over the same rounds
    assert growth < 64, rss


@pytest.mark.slow
def test_probe_floods_cannot_grow_a_peer():
    """An outsider opens 48 probe streams at once, each announcing and sending 8 MiB: the member
    serves one probe per peer (four in all), reads them block by block, and refuses the rest before
    reading; its peak memory grows by less than 32 MiB (announced: 384 MiB), and a member's own
    probe is still answered."""
    from lioncub_p2p.swarm.probe import BLOCK, MAX_PROBE_BYTES, PROBE_PROTOCOL, measure, serve_probe

    with LocalSwarm(2) as swarm:
        victim = swarm.nodes[0]
        gate = swarm.run(serve_probe(victim.p2p))
        outsider = swarm.run(start_outsider(swarm))

        async def probe_flood() -> None:
            async def one() -> None:
                try:
                    _, reader, writer = await outsider.call_binary_stream_handler(PeerID.from_base58(victim.peer_id),
                                                                                  PROBE_PROTOCOL)
                    await write_frame(writer, pb.ProbeRequest(version=PROTOCOL_VERSION, upload_bytes=MAX_PROBE_BYTES,
                                                              download_bytes=MAX_PROBE_BYTES))
                    block = bytes(BLOCK)
                    for _ in range(MAX_PROBE_BYTES // BLOCK):
                        writer.write(block)
                        await writer.drain()
                    while await asyncio.wait_for(reader.read(BLOCK), 30):
                        pass
                except Exception:
                    pass

            await asyncio.gather(*(one() for _ in range(48)))

        before = rss_mib()
        with PeakRss() as peak:
            flood = asyncio.run_coroutine_threadsafe(probe_flood(), swarm._loop.loop)
            up, down = swarm.run(measure(swarm.nodes[1].p2p, victim.peer_id, nbytes=1 << 20))
            flood.result(120)
        growth = peak.mib - before
        swarm.run(outsider.shutdown())
    print(f"probe flood: peak RSS +{growth:.0f} MiB, {gate.refused} streams refused, member probe "
          f"{up:.0f}/{down:.0f} Mbit/s")
    assert up > 0 and down > 0
    assert gate.refused >= 40 and growth < 32


def test_probes_of_many_peer_ids_spend_one_byte_budget_then_get_busy():
    """Strangers make peer ids for free: probe after probe from new ids would keep a member's uplink busy.
    All probes share one budget of bytes: a probe past it is answered BUSY before a byte is read or
    sent (the caller asks another member), and the budget refills with time."""
    from lioncub_p2p.swarm.probe import PROBE_PROTOCOL, ProbeBudget, ProbeBusy, measure, serve_probe

    mib = 1 << 20
    with LocalSwarm(3) as swarm:
        member = swarm.nodes[0]
        budget = ProbeBudget(capacity=5 * mib, rate=0.0)  # two 1 MiB probes (2 MiB each), no refill yet
        swarm.run(serve_probe(member.p2p, budget=budget))
        outsiders = [swarm.run(start_outsider(swarm)) for _ in range(2)]
        try:
            outcomes = []
            for caller in [outsiders[0], outsiders[1], swarm.nodes[1].p2p]:
                try:
                    up, down = swarm.run(measure(caller, member.peer_id, nbytes=mib))
                    outcomes.append("ok" if up > 0 and down > 0 else "zero")
                except ProbeBusy:
                    outcomes.append("busy")
            assert outcomes == ["ok", "ok", "busy"], outcomes
            assert budget.left == mib  # a busy answer spends nothing

            async def read_go_and_leave() -> bytes:
                _, reader, writer = await outsiders[0].call_binary_stream_handler(PeerID.from_base58(member.peer_id),
                                                                                   PROBE_PROTOCOL)
                await write_frame(writer, pb.ProbeRequest(version=PROTOCOL_VERSION, upload_bytes=mib // 2,
                                                          download_bytes=mib // 2))
                status = await reader.readexactly(1)
                writer.close()
                return status
            assert swarm.run(read_go_and_leave()) == b"\x00"  # GO: the budget had 1 MiB for it
            for _ in range(100):  # the member sees the close, and gives back what never moved
                if budget.left == mib:
                    break
                time.sleep(0.05)
            assert budget.left == mib, budget.left
            budget.rate = 4 * mib
            time.sleep(0.5)  # refilled past one probe's 2 MiB
            up, down = swarm.run(measure(swarm.nodes[2].p2p, member.peer_id, nbytes=mib))
            assert up > 0 and down > 0
        finally:
            for outsider in outsiders:
                swarm.run(outsider.shutdown())


@pytest.mark.slow
def test_idle_streams_do_not_take_a_donors_download_slots():
    """20 idle state streams from an outsider (it never sends its request): the donor's one download
    slot stays free for a member, who gets the state at once."""
    from lioncub_p2p.swarm.state_transfer import STATE_PROTOCOL, StateServer, download_state

    blob = bytes(range(256)) * 4096
    digest = hashlib.blake2b(blob, digest_size=16).digest()  # 16 bytes, as a snapshot's
    with LocalSwarm(2) as swarm:
        donor = swarm.nodes[0]
        server = StateServer(donor.p2p, "run", max_uploads=1, provider=lambda min_step: (7, blob, digest))
        swarm.run(server.start())
        outsider = swarm.run(start_outsider(swarm))
        stop = asyncio.Event()
        idle = asyncio.run_coroutine_threadsafe(hold_streams(outsider, donor.peer_id, STATE_PROTOCOL, 20, stop),
                                                swarm._loop.loop)
        try:
            time.sleep(1.0)
            started = time.monotonic()
            step, got, got_digest = swarm.run(download_state(swarm.nodes[1].p2p, [donor.peer_id], "run", min_step=1,
                                                             max_bytes=len(blob), timeout=30, attempts=1))
            assert time.monotonic() - started < 3  # no "busy", no back-off
        finally:
            swarm._loop.loop.call_soon_threadsafe(stop.set)
            idle.result(60)
            swarm.run(outsider.shutdown())
        assert (step, got, got_digest) == (7, blob, digest)
        assert server.gate.refused > 0 and server._uploads == 0


@pytest.mark.slow
def test_too_many_open_files_cannot_be_provoked_at_ulimit_1024(tmp_path):
    """A trainer process limited to 1024 file descriptors; an outsider keeps 700 streams open at each
    of its vote, fetch and audit handlers (2100 at once, re-dialing each as it is closed) through five
    rounds: no "Too many open files", and every round is the exact majority (with the stream caps and
    the first-frame deadline taken out, the victim logs "[Errno 24] Too many open files")."""
    outcome = fd_exhaustion(str(tmp_path), limit=1024, streams=700, rounds=5)
    assert outcome["returncode"] == 0 and outcome["exact"] == [True] * 5, (outcome["why"], outcome["log_tail"])
    assert outcome["dialed"] >= 2100
    assert not outcome["too_many_open_files"], outcome["log_tail"]


def test_a_reducer_lying_in_its_last_leaf_only_is_caught_by_audits_of_random_leaves():
    """Audits open leaves drawn with the auditor's private randomness, not fixed ones: a reducer that
    flips only its last leaf (8 of its part's 32 bytes: 4 leaves, 2 opened per audit) is caught within
    16 rounds (fixed seeds), with evidence; an audit that always opened the same leaves (the first
    ones) would never see it. Small enough for the fast set."""
    numel, liar = 3 * 32 * 8, 1
    codes = _codes("sign", 3, numel, seed=7)
    lying = lying_reduction(1.0, seed=0, last_bytes=8)
    with LocalSwarm(3) as swarm:
        _seed_audits(swarm, 5)
        swarm.nodes[liar].reduction_factory = lying
        liar_id = swarm.nodes[liar].peer_id
        catchers = []
        for step in range(16):
            swarm.allreduce(codes, step=step)
            swarm.settle_audits()
            catchers = [i for i in (0, 2) if liar_id in swarm.nodes[i].caught]
            if catchers:
                break
        assert catchers, f"a liar in the last leaf was not caught in 16 rounds ({len(lying.lies)} lies)"
        caught = swarm.nodes[catchers[0]].caught[liar_id]
        assert caught.kind == "lie" and check_evidence(caught.evidence, Verifier())[0] == liar_id
