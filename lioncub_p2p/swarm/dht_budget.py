"""Bounded DHT storage: what a node's DHT keeps for others is bounded per key, per signer and in total.

hivemind's DHT stores whatever any peer asks it to, for as long as the peer names: measured, 24
throwaway ids storing signed 250 KiB group records grew a peer's DHT process by 104 MiB and slowed
its first group read from 0.13 to 3.0 s, and 1024 values of 128 KiB under unrelated keys with a
one-year expiration added 131 MiB at each node (issue 44, item 4). Two parts bound it:

* ``StorageBudget``, a hivemind record validator (given with ``RunRecordValidator`` by
  ``dht_validators``). Its check is stateless, so it answers a store and a read alike (a refused read
  makes the reader ignore that node's answer for the key): under keys outside the run, only small
  values that expire soon. The run's own keys are ``RunRecordValidator``'s (the full record check).
* ``BudgetedStorage``, hivemind's ``DHTLocalStorage`` keeping a ledger of what it holds, which
  refuses a store past the budgets below. hivemind has no hook for it, so ``StorageBudget`` installs
  it in its DHT's own process, right after the fork and before the node exists (a ``multiprocessing``
  after-fork hook that sets ``hivemind.dht.protocol.DHTLocalStorage`` in that process only): the
  node's storage and its cache are both budgeted, from its first store on.

Per signer: under the run's keys the subkey is the signer's peer id (the record check), so a signer
holds at most one record per run key, its kind's size. Throwaway ids are free, so the per-key subkey
counts and byte budgets below are what bounds many signers together; keys outside the run share one
small budget. A full key refuses new subkeys (its incumbents keep refreshing theirs), except that a
newcomer may displace records larger than itself, largest first, when bytes are what is short: a
flood of large records cannot keep out the small records honest runs write. A flood of small ones
from enough throwaway ids keeps new subkeys out of that node for as long as it keeps re-signing them:
bounded memory does not stop Sybil squatting (docs/reliability.md).
"""
from __future__ import annotations

import heapq
import itertools
import math
import multiprocessing
import multiprocessing.util
from collections import Counter
from typing import Any, Iterable, Mapping

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from hivemind.utils import timed_storage
from hivemind.utils.timed_storage import TimedStorage

from .records import _ENVELOPE_SLACK, CLOCK_SKEW_S, LIMITS, RunRecordValidator, dht_key

# Per kind of run key: (most subkeys, most bytes charged under the key). Each budget holds at least
# ~8 of the kind's largest records (LIMITS + envelope), and far more than honest use needs.
RUN_KEY_BUDGET = {
    # one record per member (membership.MAX_MEMBERS = 1024), joiner and observer; readers look at the
    # first MAX_RECORDS = 4096. An honest record is ~0.8 KiB, ~1.4 KiB charged: 8 MiB holds ~5900;
    # a flood of the largest (6 KiB) fills it with ~1300
    "peers": (4096, 8 << 20),
    # the group records of the last GROUP_TTL (60 s): the leader's, a rival's, founders' -- a handful.
    # 4 MiB holds 15 of the largest (a 1024-member group and its previous one, 258 KiB)
    "group": (64, 4 << 20),
    # leaders' and coordinators' manifests of the last MANIFEST_TTL; readers look at MAX_MANIFESTS = 256
    "manifest": (256, 2 << 20),
    # the run's authority's list of withdrawn tickets (one per coordinator holding the authority key)
    "revoked": (16, 2 << 20),
}
# Keys outside the run: hivemind's averager (the baselines' --method hivemind-*, bootstrapped through a
# coordinator) stores a few dozen bytes under its matchmaking keys for seconds and declares itself for
# 30 s; nothing of lioncub's lives there. So: small values, short lives, and one small budget for all.
FOREIGN_VALUE_BYTES = 1024  # subkey and value, serialized
FOREIGN_MAX_AHEAD_S = 120.0  # expiration at most this far ahead (a year-long one is refused outright)
FOREIGN_ENTRIES = 1024  # (key, subkey) pairs under all foreign keys together
FOREIGN_BYTES = 1 << 20  # bytes charged under all foreign keys together
# Charged per entry on top of its value's and subkey's bytes: the Python objects kept per stored value
# (hivemind's wrapper, heap entry and dictionary slots, ~350 bytes by tracemalloc; this ledger's entry,
# ~150), so a flood of tiny values costs its real memory against the budget.
ENTRY_OVERHEAD = 512

_REGULAR = object()  # the ledger's subkey of a value stored without one
_RECONCILE_S = 1.0  # at most this often, a refusal first drops ledger entries hivemind dropped on its own


def run_key_ids(run_ids: Iterable[str]) -> dict[DHTID, str]:
    """The DHT ids of the runs' keys, each with its kind."""
    return {DHTID.generate(dht_key(run, kind)): kind for run in run_ids for kind in LIMITS}


def budget_of(kind: str) -> tuple[int, int]:
    """(most subkeys, most bytes) under a run key of ``kind``; a kind added to ``LIMITS`` without a line
    above gets room for 8 of its largest records from 16 signers."""
    return RUN_KEY_BUDGET.get(kind) or (16, 8 * (ENTRY_OVERHEAD + LIMITS[kind][0] + _ENVELOPE_SLACK))


def total_budget(run_ids: Iterable[str]) -> int:
    """The most bytes one ``BudgetedStorage`` charges, everything together."""
    return sum(budget_of(kind)[1] for kind in run_key_ids(run_ids).values()) + FOREIGN_BYTES


class BudgetedStorage(DHTLocalStorage):
    """hivemind's ``DHTLocalStorage`` that refuses what would exceed its budgets (module docstring).

    A ledger mirrors what it holds, (bytes charged, expiration) per key and subkey, and expires with
    it. hivemind also drops entries on its own (expired ones, as it meets them); those the ledger
    counts until it expires them too, at the same time: it may over-count for an instant, never under.
    """

    def __init__(self, kinds: Mapping[DHTID, str], maxsize: int | None = None):
        # hivemind's maxsize counts a dictionary of 4096 subkeys as one entry and evicts behind the ledger's
        # back: the budgets here bound the number of entries instead
        super().__init__(maxsize=None)
        self.kinds = dict(kinds)
        self.total_budget = sum(budget_of(kind)[1] for kind in self.kinds.values()) + FOREIGN_BYTES
        self.ledger: dict[DHTID, dict[Any, tuple[int, float]]] = {}
        self.key_bytes: Counter[DHTID] = Counter()
        self._used = 0  # bytes charged, everything together (``used``)
        self.foreign_used = 0
        self.foreign_entries = 0
        self.entries = 0  # (key, subkey) pairs held
        self.refused: Counter[str] = Counter()  # why stores were refused (a handful of reasons)
        self._expiry: list[tuple[float, int, DHTID, Any]] = []
        self._seq = itertools.count()
        self._reconciled = -math.inf

    @property
    def used(self) -> int:
        """Bytes charged for everything held now."""
        self._expire()
        return self._used

    # -- hivemind's entry points ------------------------------------------------------------------

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        self._expire()
        now = timed_storage.get_dht_time()
        held = TimedStorage.get(self, key)
        if expiration_time < now or (held is not None and held.expiration_time >= expiration_time):
            return False  # hivemind would refuse it (and, for an older one, misfile its expiration)
        if isinstance(value, DictionaryDHTValue):  # the cache, keeping a whole dictionary it found
            # its maxsize and expirations are the sender's word: a maxsize would evict behind the ledger's
            # back, and a key expiring before its subkeys would drop them before the ledger does
            items = [(sub, self._charge_of(sub, item.value), item.expiration_time) for sub, item in value.items()]
            value.maxsize = math.inf
            value.latest_expiration_time = max((expires for _, _, expires in items), default=-math.inf)
            expiration_time = max(expiration_time, value.latest_expiration_time)
        else:
            items = [(_REGULAR, self._charge_of(_REGULAR, value), expiration_time)]
        if not self._fits_whole(key, items, now):
            return False
        if not TimedStorage.store(self, key, value, expiration_time):
            return False
        self._drop_key(key)
        for sub, charge, expires in items:
            self._add(key, sub, charge, expires)
        self._compact(self)
        return True

    def store_subkey(self, key: DHTID, subkey: Any, value: Any, expiration_time: float) -> bool:
        self._expire()
        now = timed_storage.get_dht_time()
        if expiration_time < now:
            return False
        held = TimedStorage.get(self, key)
        if held is None:
            self._drop_key(key)  # hivemind dropped it on its own: so does the ledger
        elif not isinstance(held.value, DictionaryDHTValue):
            if held.expiration_time >= expiration_time:
                return False
        else:
            previous = held.value.get(subkey)
            if previous is not None and previous.expiration_time >= expiration_time:
                return False
        charge = self._charge_of(subkey, value)
        if not self._fits(key, subkey, charge, expiration_time, now):
            return False
        if not super().store_subkey(key, subkey, value, expiration_time):
            return False
        if held is not None and not isinstance(held.value, DictionaryDHTValue):
            self._drop(key, _REGULAR)  # the plain value made way for a dictionary
        self._add(key, subkey, charge, expiration_time)
        stored = TimedStorage.get(self, key)
        if stored is not None and isinstance(stored.value, DictionaryDHTValue):
            self._compact(stored.value)
        self._compact(self)
        return True

    def __delitem__(self, key: DHTID) -> None:
        super().__delitem__(key)
        self._drop_key(key)

    def clear(self) -> None:
        super().clear()
        for key in list(self.ledger):
            self._drop_key(key)
        self._expiry.clear()

    # -- the budget ----------------------------------------------------------------------------------

    def _charge_of(self, subkey: Any, value: Any) -> int:
        try:
            sub = 0 if subkey is _REGULAR else len(MSGPackSerializer.dumps(subkey))
            return ENTRY_OVERHEAD + sub + len(value)
        except Exception:  # not something hivemind stores: charge it out of reach
            return 1 << 62

    def _fits(self, key: DHTID, subkey: Any, charge: int, expiration: float, now: float) -> bool:
        """Whether (key, subkey) may take ``charge`` bytes; may make room by evicting larger records."""
        verdict = self._check(key, subkey, charge, expiration, now)
        if verdict is not None and self._reconcile(now):
            verdict = self._check(key, subkey, charge, expiration, now)
        if verdict is None:
            return True
        self.refused[verdict] += 1
        return False

    def _check(self, key: DHTID, subkey: Any, charge: int, expiration: float, now: float) -> str | None:
        """None if it fits (after evicting larger records where bytes are short), else why not."""
        kind = self.kinds.get(key)
        entries = self.ledger.get(key, {})
        old = entries[subkey][0] if subkey in entries else 0
        new_entry = subkey not in entries
        if kind is None:
            if charge - ENTRY_OVERHEAD > FOREIGN_VALUE_BYTES:
                return "foreign value too large"
            if expiration > now + FOREIGN_MAX_AHEAD_S + CLOCK_SKEW_S:
                return "foreign expiration too far"
            if self.foreign_entries + new_entry > FOREIGN_ENTRIES:
                return "foreign entries full"
            if self.foreign_used - old + charge > FOREIGN_BYTES:
                return "foreign bytes full"
        else:
            most_subkeys, most_bytes = budget_of(kind)
            if subkey is _REGULAR:
                return "plain value under a run key"
            if charge > ENTRY_OVERHEAD + LIMITS[kind][0] + _ENVELOPE_SLACK:
                return f"{kind} record too large"
            if expiration > now + LIMITS[kind][1] + CLOCK_SKEW_S:
                return f"{kind} expiration too far"
            if len(entries) + new_entry > most_subkeys:
                return f"{kind} subkeys full"
            excess = self.key_bytes[key] - old + charge - most_bytes
            if excess > 0 and not self._evict_larger(key, subkey, charge, excess):
                return f"{kind} bytes full"
        if self._used - old + charge > self.total_budget:
            return "total full"
        return None

    def _evict_larger(self, key: DHTID, subkey: Any, charge: int, excess: int) -> bool:
        """Evict records under ``key`` larger than ``charge``, largest first, to free ``excess`` bytes;
        evicts nothing if that cannot be done."""
        larger = sorted(((c, sub) for sub, (c, _) in self.ledger.get(key, {}).items() if c > charge and sub != subkey),
                        key=lambda item: item[0], reverse=True)
        victims, freed = [], 0
        for c, sub in larger:
            if freed >= excess:
                break
            victims.append(sub)
            freed += c
        if freed < excess:
            return False
        held = TimedStorage.get(self, key)
        for sub in victims:
            if held is not None and isinstance(held.value, DictionaryDHTValue) and sub in held.value.data:
                del held.value[sub]
            self._drop(key, sub)
            self.refused["evicted for a smaller record"] += 1
        return True

    def _fits_whole(self, key: DHTID, items: list[tuple[Any, int, float]], now: float) -> bool:
        """Whether a whole dictionary (or one plain value) may replace what ``key`` holds."""
        kind = self.kinds.get(key)
        mine = self.key_bytes[key]
        count, size = len(items), sum(charge for _, charge, _ in items)
        verdict = None
        for sub, charge, expires in items:
            if kind is None and (charge - ENTRY_OVERHEAD > FOREIGN_VALUE_BYTES
                                 or expires > now + FOREIGN_MAX_AHEAD_S + CLOCK_SKEW_S):
                verdict = "foreign value too large or too long"
            elif kind is not None and (sub is _REGULAR or charge > ENTRY_OVERHEAD + LIMITS[kind][0] + _ENVELOPE_SLACK
                                       or expires > now + LIMITS[kind][1] + CLOCK_SKEW_S):
                verdict = f"{kind} entry out of bounds"
            if verdict:
                break
        if verdict is None and kind is not None and (count > budget_of(kind)[0] or size > budget_of(kind)[1]):
            verdict = f"{kind} dictionary over budget"
        if verdict is None and kind is None and \
                self.foreign_entries - len(self.ledger.get(key, ())) + count > FOREIGN_ENTRIES:
            verdict = "foreign entries full"
        if verdict is None and kind is None and self.foreign_used - mine + size > FOREIGN_BYTES:
            verdict = "foreign bytes full"
        if verdict is None and self._used - mine + size > self.total_budget:
            verdict = "total full"
        if verdict:
            self.refused[verdict] += 1
            return False
        return True

    # -- the ledger ---------------------------------------------------------------------------------

    def _add(self, key: DHTID, subkey: Any, charge: int, expiration: float) -> None:
        entries = self.ledger.setdefault(key, {})
        if subkey in entries:
            self._account(key, -entries[subkey][0], 0)
        else:
            self._account(key, 0, 1)
        entries[subkey] = (charge, expiration)
        self._account(key, charge, 0)
        heapq.heappush(self._expiry, (expiration, next(self._seq), key, subkey))

    def _drop(self, key: DHTID, subkey: Any) -> None:
        entries = self.ledger.get(key)
        if entries is None or subkey not in entries:
            return
        charge, _ = entries.pop(subkey)
        self._account(key, -charge, -1)
        if not entries:
            del self.ledger[key]
            self.key_bytes.pop(key, None)

    def _drop_key(self, key: DHTID) -> None:
        for subkey in list(self.ledger.get(key, ())):
            self._drop(key, subkey)

    def _account(self, key: DHTID, charge: int, entries: int) -> None:
        self.key_bytes[key] += charge
        self._used += charge
        self.entries += entries
        if key not in self.kinds:
            self.foreign_used += charge
            self.foreign_entries += entries

    def _expire(self) -> None:
        """Drop what expired from the ledger, and from hivemind's storage with it."""
        now = timed_storage.get_dht_time()
        while self._expiry and self._expiry[0][0] < now:
            expiration, _, key, subkey = heapq.heappop(self._expiry)
            entry = self.ledger.get(key, {}).get(subkey)
            if entry is not None and entry[1] == expiration:
                self._drop(key, subkey)
                held = TimedStorage.get(self, key)  # hivemind drops an expired key as it looks at it
                if held is not None and isinstance(held.value, DictionaryDHTValue):
                    len(held.value)  # ... and an expired subkey the same way
        if len(self._expiry) > 2 * self.entries + 1024:  # refreshed entries leave old ones
            self._expiry = [(exp, next(self._seq), key, sub) for key, entries in self.ledger.items()
                            for sub, (_, exp) in entries.items()]
            heapq.heapify(self._expiry)

    def _reconcile(self, now: float) -> bool:
        """Before refusing, at most every ``_RECONCILE_S``: forget what hivemind dropped on its own (a key whose
        dictionary expired as a whole before the ledger's subkeys did). True if anything was forgotten."""
        if now - self._reconciled < _RECONCILE_S:
            return False
        self._reconciled, before = now, self._used
        for key in list(self.ledger):
            held = TimedStorage.get(self, key)
            if held is None:
                self._drop_key(key)
            elif isinstance(held.value, DictionaryDHTValue):
                for subkey in [s for s in self.ledger[key] if s is not _REGULAR and s not in held.value.data]:
                    self._drop(key, subkey)
        return self._used < before

    @staticmethod
    def _compact(storage: TimedStorage) -> None:
        """hivemind leaves a heap entry behind for every refreshed value until that one's expiration: a
        value refreshed many times a second with a far expiration would grow the heap without bound."""
        if len(storage.expiration_heap) > 2 * len(storage.data) + 64:
            storage.expiration_heap = list(storage.key_to_heap.values())
            heapq.heapify(storage.expiration_heap)


class StorageBudget(RecordValidatorBase):
    """The budget's record validator (module docstring): refuses values under keys outside ``run_ids``
    that are large or long-lived, and installs ``BudgetedStorage`` in the DHT process it validates for."""

    def __init__(self, run_ids: Iterable[str]):
        self.kinds = run_key_ids(run_ids)
        self._run_keys = {key.to_bytes() for key in self.kinds}
        multiprocessing.util.register_after_fork(self, StorageBudget._install)

    @property
    def priority(self) -> int:
        return 1  # validate first: a refusal here is cheaper than RunRecordValidator's hash and decode

    def validate(self, record: DHTRecord) -> bool:
        if record.key in self._run_keys:
            return True  # the run's keys: RunRecordValidator's full check, and the storage's counts
        return (len(record.subkey) + len(record.value) <= FOREIGN_VALUE_BYTES
                and record.expiration_time <= timed_storage.get_dht_time() + FOREIGN_MAX_AHEAD_S + CLOCK_SKEW_S)

    def storage(self, maxsize: int | None = None) -> BudgetedStorage:
        """Made by ``DHTProtocol.create`` in the DHT process, in place of ``DHTLocalStorage``."""
        return BudgetedStorage(self.kinds, maxsize)

    def _install(self) -> None:
        """After every fork in this process: in the process of a hivemind DHT that validates with this
        budget (``multiprocessing`` runs this before ``DHT.run`` makes the node), make its storage and its
        cache budgeted. Any other forked process is left as it is."""
        from hivemind import DHT
        from hivemind.dht import protocol

        process = multiprocessing.current_process()
        validators = getattr(getattr(process, "_record_validator", None), "_validators", ())
        if isinstance(process, DHT) and any(v is self for v in validators):
            protocol.DHTLocalStorage = self.storage


def dht_validators(run_id: str, authority: str | None = None) -> list[RecordValidatorBase]:
    """The record validators of a run's DHT (peer and coordinator): the record check and the budget;
    ``authority``: an invited run's, the only signer of its revocation list this node stores."""
    return [RunRecordValidator([run_id], authorities={run_id: authority} if authority else None),
            StorageBudget([run_id])]


def held(storage: TimedStorage) -> tuple[int, int]:
    """(entries, bytes of values and subkeys) that a hivemind storage holds, budgeted or not."""
    entries = size = 0
    for _, item in list(storage.items()):
        if isinstance(item.value, DictionaryDHTValue):
            for subkey, sub in list(item.value.items()):
                entries += 1
                size += len(sub.value) + len(MSGPackSerializer.dumps(subkey))
        else:
            entries += 1
            size += len(item.value)
    return entries, size


async def storage_usage(_dht: Any, node: Any, keys: Iterable[str] = ()) -> dict:
    """What the node's storage and cache hold (``dht.run_coroutine(storage_usage)``, in the DHT process):
    per part, entries and bytes held, bytes charged (None if not budgeted), refusals by reason, and
    per key of ``keys`` the subkeys held."""
    out = {}
    for name in ("storage", "cache"):
        storage = getattr(node.protocol, name)
        entries, size = held(storage)
        budgeted = isinstance(storage, BudgetedStorage)
        per_key = {}
        for key in keys:
            item = storage.get(DHTID.generate(key))
            value = item.value if item is not None else None
            per_key[key] = sorted(map(str, value.data)) if isinstance(value, DictionaryDHTValue) else \
                ([] if value is None else [None])
        out[name] = {"entries": entries, "bytes": size, "budgeted": budgeted,
                     "charged": storage.used if budgeted else None,
                     "budget": storage.total_budget if budgeted else None,
                     "refused": dict(storage.refused) if budgeted else {}, "keys": per_key}
    return out
