"""Container healthcheck for coordinators, monitors and trainers (Docker HEALTHCHECK / compose).

    python peers/healthcheck.py                       # some TCP port listens here (the peer's p2pd is up)
    python peers/healthcheck.py --tcp 31337 --udp 31337
    python peers/healthcheck.py --fresh /data/monitor.jsonl --max-age 60

Reads the kernel's socket tables instead of connecting, so a healthy peer's logs do not fill with
half-open handshakes. Exit 0 when healthy, 1 with one line saying what is missing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TCP_LISTEN = "0A"  # /proc/net/tcp state code
UDP_UNCONNECTED = "07"


def bound_ports(table: str, state: str) -> set[int]:
    """Local ports of the sockets in this network namespace's /proc/net/<table>{,6} in ``state``."""
    ports: set[int] = set()
    for name in (table, table + "6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == state:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def problems(tcp: list[int], udp: list[int], fresh: str | None, max_age: float) -> list[str]:
    found: list[str] = []
    listening = bound_ports("tcp", TCP_LISTEN)
    if not tcp and not udp and not fresh and not listening:
        found.append("no TCP port is listening (the peer's libp2p daemon is not up)")
    found += [f"TCP port {p} is not listening" for p in tcp if p not in listening]
    udp_bound = bound_ports("udp", UDP_UNCONNECTED) if udp else set()
    found += [f"UDP port {p} (QUIC) is not bound" for p in udp if p not in udp_bound]
    if fresh:
        path = Path(fresh)
        if not path.exists():
            found.append(f"{fresh} does not exist yet")
        elif time.time() - path.stat().st_mtime > max_age:
            found.append(f"{fresh} was not written in the last {max_age:.0f} s")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tcp", type=int, nargs="*", default=[], help="TCP ports that must be listening")
    p.add_argument("--udp", type=int, nargs="*", default=[], help="UDP (QUIC) ports that must be bound")
    p.add_argument("--fresh", default=None, help="a file the peer keeps writing (monitor or metrics JSONL)")
    p.add_argument("--max-age", type=float, default=60.0, help="seconds since --fresh was last written")
    args = p.parse_args(argv)
    found = problems(args.tcp, args.udp, args.fresh, args.max_age)
    if found:
        print("unhealthy: " + "; ".join(found), flush=True)
        return 1
    print("healthy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
