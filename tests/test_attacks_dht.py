"""Bounded DHT storage (issue 44, item 4): what strangers store at a node's DHT is bounded per key, per
signer and in total (``swarm/dht_budget.py``). Unit tests of the budget and the validators, then a
flood of throwaway ids' records over a real DHT on 127.0.0.1 (``benchmarks/dht_flood.py`` measures the
same at full size, with the defence on and off)."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time

import msgpack
import pytest
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time, timed_storage

from lioncub_p2p.identity import Identity, Verifier
from lioncub_p2p.swarm.dht_budget import (ENTRY_OVERHEAD, FOREIGN_BYTES, FOREIGN_ENTRIES, FOREIGN_MAX_AHEAD_S,
                                          FOREIGN_VALUE_BYTES, RUN_KEY_BUDGET, BudgetedStorage, StorageBudget,
                                          dht_validators, run_key_ids, storage_usage, total_budget)
from lioncub_p2p.swarm.dht_process import stop_dht
from lioncub_p2p.swarm.manifest import MAX_MANIFESTS
from lioncub_p2p.swarm.membership import MAX_RECORDS
from lioncub_p2p.swarm.records import (LIMITS, REGULAR_VALUE_TAG, RateLimitedLog, RunRecordValidator, canonical,
                                       read_records, seal, signed_bytes)

RUN = "flood"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _record(key: str, subkey, value: bytes, exp: float) -> DHTRecord:
    subkey_bytes = REGULAR_VALUE_TAG if subkey is None else msgpack.packb(subkey)
    return DHTRecord(DHTID.generate(key).to_bytes(), subkey_bytes, value, exp)


def _largest_group_payload() -> dict:
    pad = LIMITS["group"][0] - len(canonical({"epoch": 1, "pad": ""}))
    return {"epoch": 1, "pad": "x" * pad}


# -- the validators ------------------------------------------------------------------------------------

def test_the_record_check_holds_each_kind_to_its_own_size_limit(monkeypatch):
    alice, exp = Identity.load_or_create(None), get_dht_time() + 30
    validator = RunRecordValidator([RUN])
    body = canonical({"pad": "y" * (6 << 10)})  # within the group limit, past the peers one (4 KiB)
    for kind, stored in (("peers", False), ("group", True), ("manifest", True)):
        value = {"r": RUN, "t": kind, "p": body, "k": alice.public_key,
                 "s": alice.sign(signed_bytes(RUN, kind, alice.peer_id, exp, body))}
        assert validator.validate(_record(f"{RUN}.{kind}", alice.peer_id, msgpack.packb(value), exp)) == stored, kind
    # a value past its kind's size is refused before it is hashed or decoded (a peers key: 4 KiB + envelope)
    huge = msgpack.packb({"r": RUN, "t": "peers", "p": b"z" * (200 << 10), "k": b"", "s": b""})
    decoded = []
    unpackb = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: decoded.append(k.get("max_bin_len")) or unpackb(*a, **k))
    assert not validator.validate(_record(f"{RUN}.peers", alice.peer_id, huge, exp))
    assert decoded == []
    assert not validator.validate(_record(f"{RUN}.peers", alice.peer_id, huge[:5000], exp))  # decoded: within 4 KiB
    assert decoded == [LIMITS["peers"][0]]
    assert validator.validate(_record(f"{RUN}.peers", alice.peer_id,
                                      msgpack.packb(seal(alice, RUN, "peers", exp, {"step": 5})), exp))


def test_values_under_keys_outside_the_run_must_be_small_and_short_lived():
    budget, now = StorageBudget([RUN]), get_dht_time()
    assert budget.validate(_record("averager.0b01", b"peer", msgpack.packb(True), now + 15))  # hivemind's averager
    assert budget.validate(_record("something", None, b"v" * 900, now + FOREIGN_MAX_AHEAD_S))
    refused = {
        "a year ahead": _record("something", None, b"v", now + 365 * 86400),
        "too large": _record("something", None, b"v" * (FOREIGN_VALUE_BYTES + 1), now + 10),
        "a large subkey": _record("something", b"s" * FOREIGN_VALUE_BYTES, b"v", now + 10),
        "NaN expiration": _record("something", None, b"v", float("nan")),
    }
    for name, record in refused.items():
        assert not budget.validate(record), name
    # the run's own keys are the record check's (a real record can be 258 KiB and live 300 s)
    assert budget.validate(_record(f"{RUN}.group", "id", b"v" * (200 << 10), now + 290))
    assert [type(v) for v in dht_validators(RUN)] == [RunRecordValidator, StorageBudget]


def test_every_kind_has_a_budget_that_holds_what_readers_look_at():
    assert set(RUN_KEY_BUDGET) == set(LIMITS), "a new kind needs its line in RUN_KEY_BUDGET"
    for kind, (subkeys, size) in RUN_KEY_BUDGET.items():
        assert size >= 8 * (LIMITS[kind][0] + 2048 + ENTRY_OVERHEAD), kind  # room for 8 of the largest
    assert RUN_KEY_BUDGET["peers"][0] >= MAX_RECORDS and RUN_KEY_BUDGET["manifest"][0] >= MAX_MANIFESTS
    assert total_budget([RUN]) == sum(size for _, size in RUN_KEY_BUDGET.values()) + FOREIGN_BYTES < 20 << 20


# -- the storage budget (no network) --------------------------------------------------------------------

@pytest.fixture
def clock(monkeypatch):
    """hivemind's storage clock (and the budget's), moved by hand."""
    now = [get_dht_time()]
    monkeypatch.setattr(timed_storage, "get_dht_time", lambda: now[0])
    return now


def _charged(storage: BudgetedStorage) -> int:
    """What the ledger should charge for what hivemind's storage holds."""
    total = 0
    for _, item in storage.items():
        if isinstance(item.value, DictionaryDHTValue):
            total += sum(ENTRY_OVERHEAD + len(MSGPackSerializer.dumps(s)) + len(v.value) for s, v in item.value.items())
        else:
            total += ENTRY_OVERHEAD + len(item.value)
    return total


def test_a_run_key_takes_a_bounded_number_of_subkeys_and_incumbents_keep_refreshing(clock):
    storage, group = BudgetedStorage(run_key_ids([RUN])), DHTID.generate(f"{RUN}.group")
    most = RUN_KEY_BUDGET["group"][0]
    for i in range(most):
        assert storage.store_subkey(group, f"id{i}", b"r" * 100, clock[0] + 60)
    assert not storage.store_subkey(group, "newcomer", b"r" * 100, clock[0] + 60)
    assert storage.store_subkey(group, "id3", b"r" * 100, clock[0] + 90), "an incumbent refreshes its record"
    assert not storage.store_subkey(group, "id3", b"r" * 100, clock[0] + 80), "an older one is refused"
    assert not storage.store(group, b"plain", clock[0] + 60), "a run key takes signed subkeys only"
    assert not storage.store_subkey(group, "id0", b"r" * 100, clock[0] + 400), "past the kind's expiration"
    clock[0] += 61  # all but id3 expire: room again
    assert storage.store_subkey(group, "newcomer", b"r" * 100, clock[0] + 60)
    assert sorted(storage.get(group).value.data) == ["id3", "newcomer"]
    assert storage.used == _charged(storage) and storage.refused["group subkeys full"] == 1


def test_large_records_give_way_to_smaller_ones_when_bytes_run_short(clock):
    storage, group = BudgetedStorage(run_key_ids([RUN])), DHTID.generate(f"{RUN}.group")
    largest = LIMITS["group"][0] + 2000
    stored = sum(storage.store_subkey(group, f"big{i}", b"B" * largest, clock[0] + 60) for i in range(40))
    assert 8 <= stored < 40 and storage.key_bytes[group] <= RUN_KEY_BUDGET["group"][1]
    assert not storage.store_subkey(group, "same-size", b"B" * largest, clock[0] + 60), "no room, nothing smaller"
    for i in range(10):  # smaller records evict the largest to get in
        assert storage.store_subkey(group, f"mid{i}", b"M" * 100_000, clock[0] + 60), i
    assert storage.store_subkey(group, "leader", b"L" * 4000, clock[0] + 60)
    held_ids = set(storage.get(group).value.data)
    assert {"leader", *(f"mid{i}" for i in range(10))} <= held_ids
    assert len([i for i in held_ids if i.startswith("big")]) <= stored - 3
    assert storage.refused["evicted for a smaller record"] >= 3
    assert storage.key_bytes[group] <= RUN_KEY_BUDGET["group"][1] and storage.used == _charged(storage)


def test_keys_outside_the_run_share_one_small_short_lived_budget(clock):
    storage = BudgetedStorage(run_key_ids([RUN]))
    assert not storage.store(DHTID.generate("year"), b"v", clock[0] + 365 * 86400)
    assert not storage.store(DHTID.generate("big"), b"v" * (FOREIGN_VALUE_BYTES + 1), clock[0] + 10)
    accepted = sum(storage.store(DHTID.generate(f"k{i}"), b"v" * 1000, clock[0] + 60)
                   for i in range(2 * FOREIGN_ENTRIES))
    assert accepted < FOREIGN_ENTRIES and storage.foreign_used <= FOREIGN_BYTES
    assert storage.refused["foreign bytes full"] > 0
    subkeys = sum(storage.store_subkey(DHTID.generate("dict"), i, b"v", clock[0] + 60) for i in range(100))
    assert subkeys <= 2 and FOREIGN_BYTES - storage.foreign_used < ENTRY_OVERHEAD + 8, "full for subkeys too"
    clock[0] += FOREIGN_MAX_AHEAD_S  # all expired: the budget is free again
    assert storage.store_subkey(DHTID.generate("dict"), 1, b"v", clock[0] + 60)
    assert storage.used == _charged(storage) == storage.foreign_used


def test_the_ledger_matches_what_hivemind_holds_through_any_sequence_of_stores(clock):
    """Random stores, refreshes, whole dictionaries (the cache's), deletions and time passing: what the
    ledger charges is exactly what the storage holds, and never past its budget."""
    rng = random.Random(7)
    storage = BudgetedStorage(run_key_ids([RUN]))
    keys = [DHTID.generate(f"{RUN}.{kind}") for kind in LIMITS] + [DHTID.generate(f"other{i}") for i in range(4)]
    for step in range(3000):
        key, op = rng.choice(keys), rng.random()
        expires = clock[0] + rng.uniform(-1, 30)
        if op < 0.6:
            storage.store_subkey(key, f"s{rng.randrange(80)}", os.urandom(rng.choice([10, 500, 5000, 70_000])), expires)
        elif op < 0.7:
            storage.store(key, b"plain" * rng.randrange(1, 100), expires)
        elif op < 0.8:
            whole = DictionaryDHTValue()
            for i in range(rng.randrange(1, 20)):
                whole.store(f"w{i}", b"w" * rng.randrange(1, 3000), clock[0] + rng.uniform(0, 30))
            # the sender's key expiration: the subkeys' latest (hivemind's), or a lie either way
            storage.store(key, whole, whole.latest_expiration_time + rng.choice([0, 0, -20, 20]))
        elif op < 0.82 and key in storage:
            del storage[key]
        else:
            clock[0] += rng.uniform(0, 3)
        assert storage.used == _charged(storage), step
        assert storage.used <= storage.total_budget
        for kind_key, kind in storage.kinds.items():
            assert storage.key_bytes[kind_key] <= RUN_KEY_BUDGET[kind][1]
            item = storage.data.get(kind_key)
            assert item is None or len(item.value.data) <= RUN_KEY_BUDGET[kind][0]
    assert sum(storage.refused.values()) > 0
    clock[0] += 400
    assert storage.store(DHTID.generate("other0"), b"x", clock[0] + 1) and storage.used == _charged(storage)


def test_a_record_refreshed_many_times_leaves_no_pile_of_stale_heap_entries(clock):
    storage, peers = BudgetedStorage(run_key_ids([RUN])), DHTID.generate(f"{RUN}.peers")
    for i in range(20_000):
        assert storage.store_subkey(peers, "flapper", b"p" * 100, clock[0] + 200 + i * 1e-3)
    dictionary = storage.get(peers).value
    assert len(dictionary.expiration_heap) < 200 and len(storage.expiration_heap) < 200
    assert len(storage._expiry) < 2000


# -- a flood over a real DHT on 127.0.0.1 ---------------------------------------------------------------

async def _flood(_dht, node, peer: str, keys_path: str, group: range, in_cache: bool = False,
                 foreign: int = 0, foreign_bytes: int = 0, foreign_ahead: float = 0.0) -> int:
    """In the rogue's DHT process (its pipe takes no large arguments): sign the largest group record
    for each of the throwaway ids ``group`` in ``keys_path``, and make ``foreign`` values under unrelated
    keys; store them all straight at ``peer``, a few per call. Returns how many it accepted."""
    from hivemind.p2p import PeerID
    with open(keys_path, "rb") as f:
        ders = msgpack.unpackb(f.read())
    exp, now = get_dht_time() + 280, get_dht_time()
    items = []
    for i in group:
        t = Identity.in_memory(ders[i])
        value = msgpack.packb(seal(t, RUN, "group", exp, _largest_group_payload()))
        items.append((f"{RUN}.group", t.peer_id, value, exp))
    items += [(f"junk-{random.random()}", None, os.urandom(foreign_bytes), now + foreign_ahead) for _ in range(foreign)]
    target, accepted = PeerID.from_base58(peer), 0
    for start in range(0, len(items), 4):  # ~1 MiB per call: hivemind's unary calls take 2 MiB
        batch = items[start:start + 4]
        answer = await node.protocol.call_store(target, [DHTID.generate(k) for k, _, _, _ in batch],
                                                [v for _, _, v, _ in batch], [e for _, _, _, e in batch],
                                                subkeys=[s for _, s, _, _ in batch], in_cache=in_cache)
        accepted += sum(bool(ok) for ok in (answer or []))
    return accepted


def _honest_dht(validators) -> DHT:
    from lioncub_p2p.swarm.dht_process import start_dht
    return start_dht(host_maddrs=LOOPBACK, nat_port_map=False, auto_nat=False, record_validators=validators)


def test_the_budget_is_installed_in_the_dht_that_validates_with_it_and_no_other():
    """The storage is swapped in the DHT's own process (an after-fork hook): a DHT started meanwhile by
    the same process without the budget (the baselines' hivemind averager) keeps hivemind's."""
    budgeted = _honest_dht(dht_validators(RUN))
    plain = None
    try:
        plain = _honest_dht([RunRecordValidator([RUN])])
        for dht, expected in ((budgeted, True), (plain, False)):
            usage = dht.run_coroutine(storage_usage, return_future=True).result(30)
            assert usage["storage"]["budgeted"] is usage["cache"]["budgeted"] is expected
    finally:
        if plain is not None:
            stop_dht(plain)
        stop_dht(budgeted)


@pytest.mark.slow  # ~6 s: 40 RSA keys, two DHTs, 20 MiB of flood
def test_a_flood_from_throwaway_ids_leaves_the_nodes_storage_bounded_and_its_group_read_fast(tmp_path):
    keys_path = tmp_path / "keys.msgpack"
    keys_path.write_bytes(msgpack.packb([Identity.in_memory().der() for _ in range(40)]))
    honest = _honest_dht(dht_validators(RUN))
    rogue = None
    try:
        rogue = DHT(start=True, initial_peers=[str(m) for m in honest.get_visible_maddrs()], host_maddrs=LOOPBACK,
                    nat_port_map=False, auto_nat=False)
        leader, exp = Identity.load_or_create(None), get_dht_time() + 280
        value = seal(leader, RUN, "group", exp, {"epoch": 1, "members": [leader.peer_id]})
        assert honest.store(f"{RUN}.group", value, exp, subkey=leader.peer_id, return_future=True).result(30)

        def flood(**kwargs) -> int:
            job = functools.partial(_flood, peer=honest.peer_id.to_base58(), keys_path=str(keys_path), **kwargs)
            return rogue.run_coroutine(job, return_future=True).result(60)

        stored = flood(group=range(30))  # 30 of the largest group records (258 KiB), 12 more into the cache
        cached = flood(group=range(28, 40), in_cache=True)
        year = 365 * 86400.0  # 12 MiB under unrelated keys for a year, into the storage and the cache
        junk = flood(group=range(0), foreign=160, foreign_bytes=64 << 10, foreign_ahead=year)
        junk += flood(group=range(0), foreign=32, foreign_bytes=64 << 10, foreign_ahead=year, in_cache=True)
        small = flood(group=range(0), foreign=5, foreign_bytes=40, foreign_ahead=30.0)  # as hivemind's averager
        usage = honest.run_coroutine(functools.partial(storage_usage, keys=[f"{RUN}.group"]), return_future=True)
        usage = usage.result(30)
        storage, cache = usage["storage"], usage["cache"]
        # what stays is at most the group key's budget (15 of the largest records) and no junk
        budget = RUN_KEY_BUDGET["group"][1]
        assert storage["budgeted"] and cache["budgeted"]
        assert storage["bytes"] <= budget and cache["bytes"] <= budget, usage
        assert storage["charged"] <= storage["budget"] and cache["charged"] <= cache["budget"]
        assert stored < 20 and junk == 0 and small == 5, (stored, junk, small)
        assert leader.peer_id in storage["keys"][f"{RUN}.group"], "the honest leader's record was kept"
        started = time.monotonic()
        found = asyncio.run(read_records(honest, RUN, "group", Verifier(), RateLimitedLog(logging.getLogger(__name__)),
                                         timeout=20, limit=MAX_RECORDS))
        elapsed = time.monotonic() - started
        authors = {author for author, _, _ in found}
        assert leader.peer_id in authors and len(authors) <= 1 + stored + cached
        assert elapsed < 3.0, elapsed
    finally:
        if rogue is not None:
            stop_dht(rogue)
        stop_dht(honest)
