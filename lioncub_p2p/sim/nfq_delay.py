"""Added latency inside a network namespace, for a kernel without ``netem``.

Run inside a host's namespace: every packet the host receives on ``--dev`` is queued to this process
(an iptables NFQUEUE rule on the input hook, installed here and removed on exit) and released
``--delay-ms`` later, in arrival order. Delaying only what a host *receives* keeps TCP's own pacing
intact (delaying output collapsed throughput in measurements); give each host half the round-trip
time you want between two hosts. ``bypass`` lets packets through unqueued if this process dies.

    ip netns exec HOST python -m lioncub_p2p.sim.nfq_delay --delay-ms 20
"""
from __future__ import annotations

import argparse
import collections
import select
import signal
import socket
import subprocess
import time

def _rule(action: str, dev: str, queue: int) -> list[str]:
    # iptables' NFQUEUE target: this kernel's nftables has no native `queue` statement
    return ["iptables", action, "INPUT", "-i", dev, "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]


def install(dev: str, queue: int) -> None:
    remove(dev, queue)
    subprocess.run(_rule("-A", dev, queue), check=True, capture_output=True)


def remove(dev: str, queue: int) -> None:
    while subprocess.run(_rule("-D", dev, queue), capture_output=True).returncode == 0:
        pass


def run(delay_s: float, queue: int, ready_file: str | None) -> None:
    from netfilterqueue import NetfilterQueue  # only here: an optional dependency of the simulator

    held: collections.deque = collections.deque()

    def hold(packet) -> None:
        held.append((time.monotonic() + delay_s, packet))

    nfq = NetfilterQueue()
    nfq.bind(queue, hold, max_len=65536)
    sock = socket.fromfd(nfq.get_fd(), socket.AF_UNIX, socket.SOCK_STREAM)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    if ready_file:
        open(ready_file, "w").close()
    try:
        while not stop:
            wait = max(held[0][0] - time.monotonic(), 0.0) if held else 0.2
            if select.select([sock], [], [], wait)[0]:
                nfq.run(block=False)  # every queued packet that is ready
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
    finally:
        for _, packet in held:
            packet.accept()
        nfq.unbind()
        sock.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, required=True, help="added to every packet received on --dev")
    p.add_argument("--dev", default="eth0")
    p.add_argument("--queue", type=int, default=0)
    p.add_argument("--ready-file", default=None, help="created once packets are being delayed")
    args = p.parse_args(argv)
    install(args.dev, args.queue)
    try:
        run(args.delay_ms / 1e3, args.queue, args.ready_file)
    finally:
        remove(args.dev, args.queue)


if __name__ == "__main__":
    main()
