"""What the run secret costs a guesser, and what a fresh identity costs a peer's start.

1. Guesses per second on one core against what a guesser can get:
   * before (protocol 1): a public ``{run}.peers`` record carried HMAC-SHA256(secret, run | peer id);
     one HMAC tests a guess, offline, from anything that reads the DHT;
   * now: no DHT record holds a function of the secret. An attacker that lures a newcomer into the
     admission exchange gets one proof, HMAC(scrypt(secret), ...): one scrypt + HMAC per guess.
2. DHT start time with a freshly generated identity file, with hivemind's "is this identity taken?"
   check (it starts a second daemon and dials the key's peer id) and without (what Swarm does for a
   key it generated itself).

    python benchmarks/membership.py [--seconds 3] [--starts 3]
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
import time


def _rate(test, seconds: float) -> float:
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        test(f"guess{count}")
        count += 1
    return count / (time.perf_counter() - started)


def guessing(seconds: float) -> dict:
    from lioncub_p2p.allreduce.admission import SCRYPT_N, SCRYPT_P, SCRYPT_R

    run, peer = "demo", "QmPeer"
    token = hmac.new(b"s3cret", f"lioncub-admission|{run}|{peer}".encode(), hashlib.sha256).digest()[:16]

    def old(guess: str) -> bool:
        mac = hmac.new(guess.encode(), f"lioncub-admission|{run}|{peer}".encode(), hashlib.sha256).digest()[:16]
        return hmac.compare_digest(mac, token)

    def new(guess: str) -> bool:
        key = hashlib.scrypt(guess.encode(), salt=b"lioncub-run-key|" + run.encode(), n=SCRYPT_N, r=SCRYPT_R,
                             p=SCRYPT_P, dklen=32, maxmem=64 << 20)
        return hmac.compare_digest(hmac.new(key, b"proof", hashlib.sha256).digest(), token * 2)

    before, after = _rate(old, seconds), _rate(new, seconds)
    return {"before_guesses_per_s": before, "now_lured_proof_guesses_per_s": after, "slowdown": before / after,
            "now_public_records_guesses_per_s": 0.0}


def starts(count: int) -> dict:
    from hivemind import DHT

    from lioncub_p2p.identity import Identity

    boot = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial = [str(m) for m in boot.get_visible_maddrs()]
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    try:
        for _ in range(count):
            for name, check in (("checked", True), ("unchecked", False)):
                identity = Identity.load_or_create(None)
                started = time.perf_counter()
                dht = DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          identity_path=identity.path, check_if_identity_free=check)
                times[name].append(time.perf_counter() - started)
                dht.shutdown()
    finally:
        boot.shutdown()
    return {f"dht_start_{k}_s": statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = {**guessing(args.seconds), **starts(args.starts)}
    print(f"guesses/s on one core: before {result['before_guesses_per_s']:,.0f} (from any public peer record), "
          f"now 0 from public records, {result['now_lured_proof_guesses_per_s']:.1f} from a lured newcomer's proof "
          f"({result['slowdown']:,.0f}x slower)")
    print(f"DHT start with a fresh identity: {result['dht_start_checked_s']:.2f} s with hivemind's identity check, "
          f"{result['dht_start_unchecked_s']:.2f} s without (ratio {result['dht_start_checked_s'] / result['dht_start_unchecked_s']:.2f})")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
