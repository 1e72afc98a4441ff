"""User-space link shaping: one TCP proxy process for all peers, a token bucket per peer and direction.

For machines without root (no namespaces), and for added latency (this kernel has no netem).
Peer i listens on 127.0.0.(10+i) at one port and announces a proxy port on the same address, so
every peer dials every other through the proxy. libp2p dials from its listen address (reuseport),
so the proxy knows both ends of a connection from the source address and the port dialed:

* bytes a -> b take tokens from a's upload bucket and b's download bucket, then wait b's delay;
* bytes b -> a take from b's upload and a's download, then wait a's delay.

A pair's traffic crosses one proxy hop whichever side dialed. Loss is not applied (TCP hides it
from a proxy). Accuracy measured here is in docs/benchmarks.md.
"""
from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

from .links import LinkProfile

BURST = 64 << 10
READ = 16 << 10


def peer_ip(i: int) -> str:
    return f"127.0.0.{10 + i}"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class TokenBucket:
    rate: float  # bytes per second
    burst: float = BURST
    tokens: float = BURST
    stamp: float = field(default_factory=time.monotonic)

    async def take(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= n:
                self.tokens -= n
                return
            await asyncio.sleep((n - self.tokens) / self.rate)


class ShapingProxy:
    """Start with ``await start()`` inside an event loop; ``ports[i]`` are (listen, announced) ports.

    ``addresses[i]`` is peer i's IP (127.0.0.(10+i) by default); ``serve`` limits the listeners to
    some peers (one proxy process per network namespace); ``bandwidth=False`` leaves rates to the
    kernel (namespaces) and only adds delay."""

    def __init__(self, profiles: list[LinkProfile], *, addresses: list[str] | None = None,
                 serve: list[int] | None = None, bandwidth: bool = True,
                 ports: list[tuple[int, int]] | None = None):
        self.profiles = profiles
        self.addresses = addresses or [peer_ip(i) for i in range(len(profiles))]
        self.serve = serve if serve is not None else list(range(len(profiles)))
        self.bandwidth = bandwidth
        self.up = [TokenBucket(p.up_mbit * 1e6 / 8) for p in profiles]
        self.down = [TokenBucket(p.down_mbit * 1e6 / 8) for p in profiles]
        self.ports = ports or [(free_port(a), free_port(a)) for a in self.addresses]
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task] = set()
        self.sent = [0] * len(profiles)  # bytes each peer sent / received through the proxy
        self.received = [0] * len(profiles)
        self.cut_until = [0.0] * len(profiles)  # a cut link forwards nothing until then

    def cut(self, peer: int, seconds: float) -> None:
        """Nothing to or from ``peer`` passes for ``seconds``: its connections hang, as on a dead link."""
        self.cut_until[peer] = time.monotonic() + seconds

    def listen_maddr(self, i: int) -> str:
        return f"/ip4/{self.addresses[i]}/tcp/{self.ports[i][0]}"

    def announce_maddr(self, i: int) -> str:
        return f"/ip4/{self.addresses[i]}/tcp/{self.ports[i][1]}"

    async def start(self) -> None:
        for i in self.serve:
            server = await asyncio.start_server(lambda r, w, i=i: self._accept(i, r, w), self.addresses[i],
                                                self.ports[i][1])
            self._servers.append(server)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()

    def _peer_of(self, host: str) -> int | None:
        return self.addresses.index(host) if host in self.addresses else None

    async def _accept(self, dst: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        src = self._peer_of(writer.get_extra_info("peername")[0])
        try:
            up_reader, up_writer = await asyncio.open_connection(self.addresses[dst], self.ports[dst][0])
        except OSError:
            writer.close()
            return
        forward = [self.down[dst]] + ([self.up[src]] if src is not None else [])
        backward = [self.up[dst]] + ([self.down[src]] if src is not None else [])
        if not self.bandwidth:
            forward, backward = [], []
        delay_fwd = self.profiles[dst].delay_ms / 1e3
        delay_back = self.profiles[src].delay_ms / 1e3 if src is not None else 0.0
        for args in ((reader, up_writer, forward, delay_fwd, src, dst), (up_reader, writer, backward, delay_back, dst, src)):
            task = asyncio.create_task(self._pump(*args))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader, writer, buckets: list[TokenBucket], delay: float, sender_peer: int | None,
                    receiver_peer: int | None) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(READ)
                if not data:
                    break
                for bucket in buckets:
                    await bucket.take(len(data))
                for peer in (sender_peer, receiver_peer):
                    while peer is not None and time.monotonic() < self.cut_until[peer]:
                        await asyncio.sleep(0.05)
                if sender_peer is not None:
                    self.sent[sender_peer] += len(data)
                if receiver_peer is not None:
                    self.received[receiver_peer] += len(data)
                await queue.put((time.monotonic() + delay, data))
            await queue.put((0.0, None))
            await sender
        except (ConnectionError, OSError, asyncio.CancelledError):
            sender.cancel()
        finally:
            try:
                writer.close()
            except Exception:
                pass


def main(argv: list[str] | None = None) -> None:
    """One delay-only proxy for one peer, run inside that peer's network namespace by the simulator."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="lioncub-sim's per-namespace latency proxy")
    parser.add_argument("--serve", type=int, required=True)
    parser.add_argument("--addresses", required=True, help="comma-separated peer IPs, in peer order")
    parser.add_argument("--profiles", required=True, help="JSON list of link profiles")
    parser.add_argument("--listen-port", type=int, required=True, help="where the peer's daemon listens")
    parser.add_argument("--announce-port", type=int, required=True, help="where this proxy listens")
    args = parser.parse_args(argv)
    profiles = [LinkProfile(**p) for p in json.loads(args.profiles)]
    addresses = args.addresses.split(",")
    ports = [(args.listen_port, args.announce_port)] * len(addresses)

    async def run() -> None:
        proxy = ShapingProxy(profiles, addresses=addresses, serve=[args.serve], bandwidth=False, ports=ports)
        await proxy.start()
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
