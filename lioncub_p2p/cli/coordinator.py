"""lioncub-coordinator: a bootstrap DHT peer for a run, optionally monitoring it.

    lioncub-coordinator --run-id demo --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity-path coord.key

Listens on every interface (TCP) by default, prints its multiaddrs (give them to trainers
as --initial-peers) sorted by who can dial them, and keeps a stable peer id across restarts through
the identity file. With --manifest run.yaml it publishes the run's settings (task, lr, batch size,
encodings, ...; signed with its identity) and keeps them alive: trainers that name this coordinator
in --initial-peers adopt them. It answers trainers' dial-back requests (``lioncub/dialback/1``), so a
trainer behind NAT finds out it cannot be dialed and joins in client mode. With --monitor-jsonl it logs, every --monitor-period seconds, the peers alive,
the global step, samples/s and bytes/s, and appends them as JSON lines. SIGINT and SIGTERM stop it
cleanly (its DHT child and libp2p daemon included).
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from hivemind import DHT

from ..aio import BackgroundLoop
from ..identity import Identity
from ..swarm.manifest import MANIFEST_TTL, Manifest, ManifestError, publish_manifest
from ..swarm.membership import read_peer_records
from ..swarm.config import LISTEN_ALL
from ..swarm.reachability import serve_dialback
from ..swarm.dht_budget import dht_validators
from ..swarm.tickets import TicketError, publish_revocations, read_serials_file
from .addresses import check_listen, check_peers, reachability
from .checks import check_run_id, check_writable_file
from .common import HelpFormatter, UsageError, add_log_level, read_peers_file, setup_logging
from .lifecycle import ChildReaper, Interrupted, StopSignals

logger = logging.getLogger("lioncub.coordinator")
REVOKED_REPUBLISH_S = 60.0  # the revocation file is re-read and the list stored again this often


def parse_args(argv: list[str] | None = None, *, monitor_default: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lioncub-monitor" if monitor_default else "lioncub-coordinator",
                                description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--run-id", default="demo", help="the run to monitor (coordinators serve any run)")
    p.add_argument("--host-maddrs", nargs="+", default=LISTEN_ALL,
                   help="where to listen, e.g. /ip4/0.0.0.0/tcp/31337 /ip4/0.0.0.0/udp/31337/quic-v1 for fixed ports")
    p.add_argument("--announce-maddrs", nargs="*", default=[],
                   help="public addresses others should dial, if behind port forwarding")
    p.add_argument("--initial-peers", nargs="*", default=[], help="other coordinators' multiaddrs")
    p.add_argument("--initial-peers-file", default=None, help="read initial peers from this file (waits for it)")
    p.add_argument("--identity-path", default=None, help="private key file: keeps the peer id across restarts")
    p.add_argument("--manifest", default=None,
                   help="publish this YAML file as the run's manifest (task, task_args, lr, batch_size, upload, ...): "
                        "trainers that dial this coordinator adopt it")
    p.add_argument("--authority-key", default=None,
                   help="an invited run: the authority key that signs its tickets (lioncub-invite authority): the "
                        "published manifest names it, and only ticket holders take part")
    p.add_argument("--revoked", default=None,
                   help="with --authority-key: a file of revoked ticket serials (lioncub-invite revoke), published "
                        "signed and re-read every minute")
    p.add_argument("--write-maddrs", default=None, help="write this peer's multiaddrs to this file")
    p.add_argument("--write-maddrs-host", default=None,
                   help="in that file, address this peer by this DNS name (e.g. its compose service name)")
    p.add_argument("--client-mode", action="store_true", help="do not listen (a monitor behind NAT)")
    p.add_argument("--nat-probing", action="store_true", help="UPnP/AutoNAT probing of the network card")
    p.add_argument("--monitor-jsonl", default=None, help="append run metrics to this JSONL file")
    p.add_argument("--monitor", action="store_true", default=monitor_default, help="log run metrics")
    p.add_argument("--monitor-period", type=float, default=5.0, help="seconds between monitor lines")
    p.add_argument("--quiet", action="store_true", help="accepted for symmetry with lioncub-train (logs lines only)")
    add_log_level(p)
    p.add_argument("--duration", type=float, default=None, help=argparse.SUPPRESS)  # exit after this many seconds (tests)
    return p.parse_args(argv)


def run_summary(dht: DHT, run_id: str) -> dict:
    """What the run's peer records say right now (signed, validated, unexpired; at most 5 s to read)."""
    records = list(read_peer_records(dht, run_id, timeout=5).values())
    losses = [r.loss for r in records if r.loss is not None]
    return {"time": time.time(), "run_id": run_id, "peers_alive": len(records),
            "peers_synced": sum(r.synced for r in records), "client_mode_peers": sum(r.client_mode for r in records),
            "global_step": max((r.step for r in records), default=0),
            "samples_per_s": sum(r.samples_per_s for r in records),
            "bytes_up_per_s": sum(r.bytes_up_per_s for r in records),
            "bytes_down_per_s": sum(r.bytes_down_per_s for r in records),
            "mean_loss": sum(losses) / len(losses) if losses else None}


def main(argv: list[str] | None = None, *, monitor_default: bool = False) -> None:
    args = parse_args(argv, monitor_default=monitor_default)
    setup_logging(args.log_level)
    with StopSignals() as stop, ChildReaper() as reaper:
        try:
            serve(args, stop)
        except UsageError as e:
            raise SystemExit(f"error: {e}")
        except Interrupted:
            pass  # the orderly shutdown ran in serve()
        finally:
            stop.leaving()
            if reaper.reap():
                logger.warning("ended child processes left after the shutdown: %s", ", ".join(reaper.reaped))


def check_settings(args: argparse.Namespace) -> list[str]:
    """Everything that can be checked before starting a daemon; returns the initial peers to dial."""
    check_run_id(args.run_id)
    check_listen("--host-maddrs", args.host_maddrs)
    check_listen("--announce-maddrs", args.announce_maddrs)
    initial = check_peers("--initial-peers", list(args.initial_peers))
    if args.initial_peers_file:
        initial += check_peers(f"--initial-peers-file {args.initial_peers_file}:", read_peers_file(args.initial_peers_file))
    if args.monitor_period <= 0:
        raise UsageError(f"--monitor-period must be positive, got {args.monitor_period}")
    for flag in ("--monitor-jsonl", "--write-maddrs"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path:
            check_writable_file(flag, path)
    if args.identity_path:
        try:
            Path(args.identity_path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--identity-path {args.identity_path}: cannot create its folder ({e.strerror})") from None
    return initial


def read_manifest(path: str | None, authority: Identity | None = None) -> Manifest | None:
    """The run manifest to publish: the file's, naming the authority of an invited run."""
    if not path and authority is None:
        return None
    try:
        manifest = Manifest.from_yaml(path) if path else Manifest()
    except ManifestError as e:
        raise UsageError(f"--manifest {e}") from None
    if authority is None:
        return manifest
    if manifest.authority not in (None, authority.peer_id):
        raise UsageError(f"--manifest {path} names authority {manifest.authority}, but --authority-key is "
                         f"{authority.peer_id}'s: leave authority out of the manifest")
    return replace(manifest, authority=authority.peer_id)


def read_authority(args: argparse.Namespace) -> Identity | None:
    if args.revoked and not args.authority_key:
        raise UsageError("--revoked needs the --authority-key that signs the list")
    if not args.authority_key:
        return None
    if not Path(args.authority_key).exists():
        raise UsageError(f"--authority-key {args.authority_key} does not exist: create it with lioncub-invite "
                         f"authority --key {args.authority_key}")
    try:
        return Identity(args.authority_key)
    except (OSError, ValueError) as e:
        raise UsageError(f"--authority-key {args.authority_key}: not a usable key file ({e})") from None


def revoked_serials(path: str | None) -> list[str]:
    """The serials to publish as revoked (none without a file; an unreadable one is one line)."""
    if not path or not Path(path).exists():
        return []
    try:
        return read_serials_file(path)
    except OSError as e:
        raise UsageError(f"--revoked {path}: cannot read it ({e.strerror})") from None
    except TicketError as e:
        raise UsageError(f"--revoked {e}") from None


def serve(args: argparse.Namespace, stop: StopSignals) -> None:
    initial = check_settings(args)
    authority = read_authority(args)
    revoked_serials(args.revoked)  # one line now for a bad file, not a warning every minute
    manifest = read_manifest(args.manifest, authority)
    identity = None
    if manifest is not None:  # signed with the DHT's own key: trainers trust it by the peer id they dial
        try:
            identity = Identity.load_or_create(args.identity_path)
        except (OSError, ValueError) as e:
            raise UsageError(f"--identity-path {args.identity_path}: not a usable identity file ({e})") from None
    try:
        dht = DHT(start=True, initial_peers=initial, host_maddrs=args.host_maddrs,
                  announce_maddrs=args.announce_maddrs or None,
                  identity_path=identity.path if identity is not None else args.identity_path,
                  # refuse forged records, bound what others store; an invited run's list only from its authority
                  record_validators=dht_validators(args.run_id, authority.peer_id if authority else None),
                  client_mode=args.client_mode, no_listen=args.client_mode, nat_port_map=args.nat_probing,
                  auto_nat=args.nat_probing)
    except Exception as e:
        raise UsageError(f"the DHT did not start ({' '.join(str(e).split())[:300]}). If --initial-peers are set, are "
                         f"they reachable? Is another process using this identity file or port?") from None
    loop = p2p = None
    try:
        if not args.client_mode:  # answer trainers asking whether they can be dialed (behind NAT or not)
            loop = BackgroundLoop("coordinator")
            p2p = loop.run(dht.replicate_p2p(), timeout=30)
            loop.run(serve_dialback(p2p), timeout=30)
        _serve(args, dht, stop, manifest, identity, authority)
    finally:
        if loop is not None:
            try:
                if p2p is not None:
                    loop.run(p2p.shutdown(), timeout=5)  # our handle only: the DHT owns the daemon
            except Exception as e:
                logger.debug("closing the p2p handle: %s", e)
            loop.stop()
        dht.shutdown()
        print("coordinator stopped", flush=True)


def _publish(dht: DHT, run_id: str, manifest: Manifest, identity: Identity) -> bool:
    try:
        stored = publish_manifest(dht, run_id, manifest, identity)
    except Exception as e:  # the DHT is busy or has no peers yet: try again soon
        logger.warning("could not publish run %s's manifest: %s: %s", run_id, type(e).__name__, e)
        return False
    if stored:
        logger.info("published run %s's manifest: %s", run_id, json.dumps(manifest.payload(), sort_keys=True))
    return stored


def _publish_revoked(dht: DHT, args: argparse.Namespace, authority: Identity) -> float:
    """Store the authority's list of revoked tickets; seconds until it is stored again."""
    try:
        serials = revoked_serials(args.revoked)
        if publish_revocations(dht, args.run_id, authority, serials):
            logger.info("published run %s's revocations: %d tickets", args.run_id, len(serials))
            return REVOKED_REPUBLISH_S
    except Exception as e:  # a bad edit of the file, a busy DHT: the last list stays in force until it expires
        logger.warning("could not publish run %s's revocations: %s", args.run_id, e)
    return 5.0


def _serve(args: argparse.Namespace, dht: DHT, stop: StopSignals, manifest: Manifest | None = None,
           identity: Identity | None = None, authority: Identity | None = None) -> None:
    republish = revoke_at = 0.0  # when the manifest (the revocations) are stored next
    if manifest is not None:  # before the addresses go out: the first trainer must find it
        republish = time.monotonic() + (MANIFEST_TTL / 3 if _publish(dht, args.run_id, manifest, identity) else 5.0)
    if authority is not None:
        revoke_at = time.monotonic() + _publish_revoked(dht, args, authority)
    maddrs = [] if args.client_mode else [str(m) for m in dht.get_visible_maddrs()]
    if maddrs:
        print("coordinator ready; trainers join with:\n  --initial-peers " + " ".join(maddrs), flush=True)
        for line in reachability(maddrs):
            print(line, flush=True)
    else:
        print(f"monitor connected (client mode, not listening) to run {args.run_id}", flush=True)
    if args.write_maddrs and maddrs:
        written = maddrs
        if args.write_maddrs_host:
            written = [re.sub(r"^/ip[46]/[^/]+", f"/dns4/{args.write_maddrs_host}", m) for m in maddrs]
        tmp = Path(args.write_maddrs + ".tmp")
        tmp.write_text("\n".join(written) + "\n")
        tmp.replace(args.write_maddrs)

    pause = threading.Event()  # never set: waits that a stop signal interrupts
    deadline = time.monotonic() + args.duration if args.duration else None
    monitoring = args.monitor or args.monitor_jsonl
    while not stop.requested:
        if manifest is not None and time.monotonic() >= republish:
            republish = time.monotonic() + (MANIFEST_TTL / 3 if _publish(dht, args.run_id, manifest, identity) else 5.0)
        if authority is not None and time.monotonic() >= revoke_at:
            revoke_at = time.monotonic() + _publish_revoked(dht, args, authority)
        if pause.wait(args.monitor_period if monitoring else 1.0) or (deadline and time.monotonic() > deadline):
            break
        if monitoring:
            summary = run_summary(dht, args.run_id)
            logger.info("run %s: %d peers alive (%d synced), step %d, %.1f samples/s, up %.2f MB/s, down %.2f MB/s",
                        args.run_id, summary["peers_alive"], summary["peers_synced"], summary["global_step"],
                        summary["samples_per_s"], summary["bytes_up_per_s"] / 1e6,
                        summary["bytes_down_per_s"] / 1e6)
            if args.monitor_jsonl:
                with stop.deferred(), open(args.monitor_jsonl, "a") as f:  # never half a line
                    f.write(json.dumps(summary) + "\n")


def monitor_main(argv: list[str] | None = None) -> None:
    """lioncub-monitor: a coordinator in client mode that only monitors (logs + JSONL)."""
    main(["--client-mode"] + (argv if argv is not None else sys.argv[1:]), monitor_default=True)


if __name__ == "__main__":
    main()
