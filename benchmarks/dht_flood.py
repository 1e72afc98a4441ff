"""What a flood of strangers' records costs an honest DHT node, with the storage budget on and off.

One honest hivemind DHT on 127.0.0.1 (the run's validators: ``dht_budget.dht_validators`` with the
defence on, the record check alone with it off, as before issue 44) holds an honest leader's group
record. A rogue DHT node (no validator) then stores straight at it, a few values per call:

* one group record of the largest allowed size (256 KiB payload) signed by each of ``--identities``
  throwaway RSA identities, under ``{run}.group`` (each passes the full record check), and
* ``--foreign`` values of ``--foreign-kib`` KiB under unrelated keys, expiring in a year.

Reported per mode: how many of each the node kept, the bytes its DHT storage holds, the RSS growth of
the honest DHT process and of its p2pd (``/proc/<pid>/status`` VmRSS, before the flood and after it),
and the latency of its first ``{run}.group`` read (``records.read_records``, as a peer reads groups)
and whether the honest leader's record is in it.

    python benchmarks/dht_flood.py [--identities 1000] [--foreign 1000] [--foreign-kib 128] [--defence both]

RSA keys for the identities are made once (about 25 s per 1000 on 2 cores) and kept in --keys.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import msgpack

RUN = "flood"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _new_key(_: int) -> bytes:
    from lioncub_p2p.identity import Identity

    return Identity.in_memory().der()


def throwaway_keys(path: str, count: int) -> None:
    """At least ``count`` private keys (DER) in ``path``, made in parallel where missing."""
    keys = []
    if os.path.exists(path):
        with open(path, "rb") as f:
            keys = msgpack.unpackb(f.read())
    if len(keys) < count:
        started = time.monotonic()
        with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
            keys += list(pool.map(_new_key, range(count - len(keys)), chunksize=16))
        descriptor = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as f:
            f.write(msgpack.packb(keys))
        os.replace(path + ".tmp", path)
        print(f"made {count} throwaway RSA keys in {time.monotonic() - started:.0f} s ({path})", flush=True)


def _largest_group_payload() -> dict:
    from lioncub_p2p.swarm.records import LIMITS, canonical

    return {"epoch": 1, "pad": "x" * (LIMITS["group"][0] - len(canonical({"epoch": 1, "pad": ""})))}


async def _flood(_dht, node, peer: str, keys_path: str, group: range, foreign: int = 0, foreign_bytes: int = 0,
                 foreign_ahead: float = 0.0) -> int:
    """In the rogue's DHT process (its pipe takes no large arguments): sign the largest group record for
    the throwaway ids ``group`` of ``keys_path`` and make ``foreign`` values under unrelated keys; store
    them straight at ``peer``, 4 per call (~1 MiB: hivemind's unary calls take 2). Returns how many it kept."""
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    from lioncub_p2p.identity import Identity
    from lioncub_p2p.swarm.records import seal

    with open(keys_path, "rb") as f:
        ders = msgpack.unpackb(f.read())
    exp, now, payload = get_dht_time() + 280, get_dht_time(), _largest_group_payload()
    items = []
    for i in group:
        t = Identity.in_memory(ders[i])
        items.append((f"{RUN}.group", t.peer_id, msgpack.packb(seal(t, RUN, "group", exp, payload)), exp))
    items += [(f"junk-{random.random()}", None, os.urandom(foreign_bytes), now + foreign_ahead) for _ in range(foreign)]
    target, kept = PeerID.from_base58(peer), 0
    for start in range(0, len(items), 4):
        batch = items[start:start + 4]
        answer = await node.protocol.call_store(target, [DHTID.generate(k) for k, _, _, _ in batch],
                                                [v for _, _, v, _ in batch], [e for _, _, _, e in batch],
                                                subkeys=[s for _, s, _, _ in batch])
        kept += sum(bool(ok) for ok in (answer or []))
    return kept


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _rss(dht) -> tuple[float, float]:
    """(the DHT process's RSS, its p2pd's and helpers') in MiB."""
    from lioncub_p2p.swarm.dht_process import descendants

    return rss_mib(dht.pid), sum(rss_mib(pid) for pid in descendants(dht.pid))


def run(defence: bool, args: argparse.Namespace) -> dict:
    from hivemind import DHT
    from hivemind.utils import get_dht_time

    from lioncub_p2p.identity import Identity, Verifier
    from lioncub_p2p.swarm.dht_budget import dht_validators, storage_usage
    from lioncub_p2p.swarm.dht_process import start_dht, stop_dht
    from lioncub_p2p.swarm.membership import MAX_RECORDS
    from lioncub_p2p.swarm.records import RateLimitedLog, RunRecordValidator, read_records, seal

    validators = dht_validators(RUN) if defence else [RunRecordValidator([RUN])]
    honest = start_dht(host_maddrs=LOOPBACK, nat_port_map=False, auto_nat=False, record_validators=validators)
    rogue = None
    try:
        leader, exp = Identity.load_or_create(None), get_dht_time() + 280
        value = seal(leader, RUN, "group", exp, {"epoch": 1, "members": [leader.peer_id]})
        assert honest.store(f"{RUN}.group", value, exp, subkey=leader.peer_id, return_future=True).result(30)
        rogue = DHT(start=True, initial_peers=[str(m) for m in honest.get_visible_maddrs()], host_maddrs=LOOPBACK,
                    nat_port_map=False, auto_nat=False)
        time.sleep(1.0)
        before = _rss(honest)

        def flood(**kwargs) -> int:
            job = functools.partial(_flood, peer=honest.peer_id.to_base58(), keys_path=args.keys, **kwargs)
            return rogue.run_coroutine(job, return_future=True).result(600)

        started, group, foreign = time.monotonic(), 0, 0
        for start in range(0, args.identities, 100):
            group += flood(group=range(start, min(start + 100, args.identities)))
        for start in range(0, args.foreign, 100):
            foreign += flood(group=range(0), foreign=min(100, args.foreign - start),
                             foreign_bytes=args.foreign_kib << 10, foreign_ahead=365 * 86400.0)
        flood_s = time.monotonic() - started
        time.sleep(1.0)
        after = _rss(honest)
        usage = honest.run_coroutine(storage_usage, return_future=True).result(120)
        started = time.monotonic()
        found = asyncio.run(read_records(honest, RUN, "group", Verifier(), RateLimitedLog(logging.getLogger("flood")),
                                         timeout=120, limit=MAX_RECORDS))
        read_s = time.monotonic() - started
        return {"defence": "on" if defence else "off", "group_kept": group, "group_sent": args.identities,
                "foreign_kept": foreign, "foreign_sent": args.foreign, "flood_s": round(flood_s, 1),
                "held_mib": round((usage["storage"]["bytes"] + usage["cache"]["bytes"]) / 2**20, 1),
                "dht_rss_mib": [round(before[0]), round(after[0])], "p2pd_rss_mib": [round(before[1]), round(after[1])],
                "read_s": round(read_s, 2), "read_records": len(found),
                "leader_read": any(author == leader.peer_id for author, _, _ in found)}
    finally:
        if rogue is not None:
            stop_dht(rogue)
        stop_dht(honest)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--identities", type=int, default=1000, help="throwaway ids, one largest group record each")
    p.add_argument("--foreign", type=int, default=1000, help="values under unrelated keys, expiring in a year")
    p.add_argument("--foreign-kib", type=int, default=128, help="size of each of those values")
    p.add_argument("--defence", choices=("both", "on", "off"), default="both")
    p.add_argument("--keys", default=os.path.join(tempfile.gettempdir(), "lioncub-dht-flood-keys.msgpack"),
                   help="where the throwaway RSA keys are kept between runs")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    throwaway_keys(args.keys, args.identities)
    rows = [run(mode == "on", args) for mode in (("on", "off") if args.defence == "both" else (args.defence,))]
    print(f"\n{args.identities} throwaway ids x one 256 KiB group record; {args.foreign} x {args.foreign_kib} KiB "
          f"under unrelated keys, expiring in a year\n")
    print("| defence | group records kept | foreign values kept | DHT storage holds | DHT process RSS | p2pd RSS "
          "| flood took | first group read | leader's record read |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['defence']} | {r['group_kept']} / {r['group_sent']} | {r['foreign_kept']} / {r['foreign_sent']} "
              f"| {r['held_mib']} MiB | {r['dht_rss_mib'][0]} -> {r['dht_rss_mib'][1]} MiB "
              f"(+{r['dht_rss_mib'][1] - r['dht_rss_mib'][0]}) | {r['p2pd_rss_mib'][0]} -> {r['p2pd_rss_mib'][1]} MiB "
              f"| {r['flood_s']} s | {r['read_s']} s ({r['read_records']} records) | {r['leader_read']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
