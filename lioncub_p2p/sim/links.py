"""Uneven links on one machine: per-peer profiles and the network namespaces that enforce them.

As root, each peer gets its own network namespace joined to a bridge namespace by a veth pair, on
private addresses (10.77.0.0/24) that exist only inside those namespaces and have no route out.
The kernel enforces the caps: a ``tbf`` qdisc on the peer's end of its veth (upload) and on the
bridge's end (download); random loss is an nftables rule on the peer's input (when ``nft`` is
installed). This kernel has no ``netem``: added latency comes from a small user-space proxy in each
peer's namespace (``sim/proxy.py``), which delays what the peer receives. Everything created is removed by ``teardown`` (also on errors and Ctrl+C: the
simulator calls it from ``finally``), and names carry the creating process id so parallel runs
never collide.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from .. import failpoints

logger = logging.getLogger(__name__)
SUBNET = "10.77.0"


@dataclass
class LinkProfile:
    """One peer's link and its flakiness schedule (rounds count the peer's own steps)."""

    up_mbit: float = 100.0
    down_mbit: float = 100.0
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    leave_at: int | None = None  # killed at this round...
    rejoin_at: int | None = None  # ...and started again when the swarm reaches this round
    stall_at: int | None = None  # frozen (SIGSTOP) at this round...
    stall_s: float = 0.0  # ...for this many seconds
    cut_at: int | None = None  # its link goes down at this round (nothing passes, connections hang)...
    cut_s: float = 0.0  # ...for this many seconds
    join_at: int | None = None  # first started when the swarm reaches this round (a newcomer)
    failpoint: str | None = None  # dies by SIGKILL at this protocol point ("result@20"; see failpoints.py)
    hang_at: int | None = None  # its training thread sleeps at this round (its event loop goes on)...
    hang_s: float = 0.0  # ...for this many seconds

    def __post_init__(self) -> None:
        if self.up_mbit <= 0 or self.down_mbit <= 0:
            raise ValueError(f"link rates must be positive, got up {self.up_mbit}, down {self.down_mbit}")
        try:
            failpoints.parse(self.failpoint)  # a typo fails here, not silently in a peer
        except ValueError:
            raise ValueError(f"failpoint {self.failpoint!r} is not POINT or POINT@STEP with POINT one of "
                             f"{', '.join(failpoints.POINTS)}") from None
        if not 0 <= self.loss_pct < 100 or self.delay_ms < 0:
            raise ValueError(f"loss must be in [0, 100) and delay >= 0, got {self.loss_pct}, {self.delay_ms}")
        if self.stall_s < 0 or self.cut_s < 0 or not 0 <= self.hang_s <= 3600:
            raise ValueError(f"stall_s and cut_s must be >= 0 and hang_s in [0, 3600], got {self.stall_s}, "
                             f"{self.cut_s}, {self.hang_s}")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> "LinkProfile":
        """A profile from its YAML form; ValueError naming the field for anything unknown or mistyped."""
        if not isinstance(value, dict):
            raise ValueError(f"each peer is a mapping like {{up: 100, down: 20}}, got {value!r}")
        aliases = {"up": "up_mbit", "down": "down_mbit", "mbit": None, "delay": "delay_ms", "loss": "loss_pct"}
        fields = cls.__dataclass_fields__
        kwargs: dict[str, Any] = {}
        for key, v in value.items():
            name = aliases.get(key, key)
            if key != "mbit" and name not in fields:
                known = sorted(set(aliases) - {None} | set(fields) - set(aliases.values()))
                raise ValueError(f"unknown field {key!r}; known: {', '.join(known)}")
            if key == "failpoint":
                if v is not None and not isinstance(v, str):
                    raise ValueError(f"failpoint must be text like \"result@20\", got {v!r}")
            elif name in ("leave_at", "rejoin_at", "stall_at", "cut_at", "join_at", "hang_at"):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"{key} is a round number (a whole number >= 0), got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{key} must be a number, got {v!r}")
            if key == "mbit":
                kwargs["up_mbit"] = kwargs["down_mbit"] = float(v)
            else:
                kwargs[name] = v
        return cls(**kwargs)


def parse_links(text: str) -> list[LinkProfile]:
    """"100,50,20,10" (symmetric Mbit/s) or "100/20,50" (up/down) -> profiles."""
    profiles = []
    for item in text.split(","):
        up, _, down = item.strip().partition("/")
        try:
            rates = float(up), float(down or up)
        except ValueError:
            raise ValueError(f"{item.strip()!r} is not a rate in Mbit/s; write e.g. 100,50 or 100/20,50 "
                             f"(up/down)") from None
        profiles.append(LinkProfile(*rates))
    return profiles


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can build namespaces with caps, and why not."""
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"lcprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return (True, "") if ok else (False, "`ip netns add` failed (no permission in this container?)")


@dataclass
class NamespaceNetwork:
    """A bridge namespace, one namespace per peer, and one for the coordinator (unshaped)."""

    profiles: list[LinkProfile]
    prefix: str = field(default_factory=lambda: f"lcs{os.getpid() % 100000}")
    notes: list[str] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def namespace(self, peer: int | str) -> str:
        return f"{self.prefix}p{peer}"

    def address(self, peer: int | str) -> str:
        return f"{SUBNET}.2" if peer == "c" else f"{SUBNET}.{10 + int(peer)}"

    def exec_prefix(self, peer: int | str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(peer)]

    def _run(self, *cmd: str, ns: str | None = None) -> None:
        full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
        result = subprocess.run(full, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(full)} failed: {result.stderr.strip()}")

    def setup(self) -> None:
        try:
            self._run("ip", "netns", "add", self.bridge)
            self._created.append(self.bridge)
            self._run("ip", "link", "add", "br0", "type", "bridge", ns=self.bridge)
            self._run("ip", "link", "set", "br0", "up", ns=self.bridge)
            self._run("ip", "link", "set", "lo", "up", ns=self.bridge)
            for peer in ["c"] + list(range(len(self.profiles))):
                self._add_peer(peer)
        except Exception:
            self.teardown()
            raise

    def _add_peer(self, peer: int | str) -> None:
        ns, host_end, peer_end = self.namespace(peer), f"{self.prefix}h{peer}", f"{self.prefix}v{peer}"
        self._run("ip", "netns", "add", ns)
        self._created.append(ns)
        self._run("ip", "link", "add", host_end, "type", "veth", "peer", "name", peer_end)
        self._run("ip", "link", "set", host_end, "netns", self.bridge)
        self._run("ip", "link", "set", peer_end, "netns", ns)
        self._run("ip", "link", "set", host_end, "master", "br0", ns=self.bridge)
        self._run("ip", "link", "set", host_end, "up", ns=self.bridge)
        self._run("ip", "link", "set", peer_end, "name", "eth0", ns=ns)
        self._run("ip", "addr", "add", f"{self.address(peer)}/24", "dev", "eth0", ns=ns)
        self._run("ip", "link", "set", "eth0", "up", ns=ns)
        self._run("ip", "link", "set", "lo", "up", ns=ns)
        if peer == "c":
            return
        profile = self.profiles[int(peer)]
        tbf = ["tbf", "rate", f"{profile.up_mbit}mbit", "burst", "64kb", "latency", "200ms"]
        self._run("tc", "qdisc", "replace", "dev", "eth0", "root", *tbf, ns=ns)
        tbf[2] = f"{profile.down_mbit}mbit"
        self._run("tc", "qdisc", "replace", "dev", host_end, "root", *tbf, ns=self.bridge)
        if profile.loss_pct:
            if shutil.which("nft"):
                per_mille = int(round(profile.loss_pct * 10))
                self._run("nft", "add", "table", "inet", "sim", ns=ns)
                self._run("nft", "add", "chain", "inet", "sim", "in", "{ type filter hook input priority 0 ; }", ns=ns)
                self._run("nft", "add", "rule", "inet", "sim", "in", "iifname", "eth0", "numgen", "random", "mod",
                          "1000", "<", str(per_mille), "drop", ns=ns)
            else:
                self.notes.append(f"peer {peer}: loss {profile.loss_pct}% not applied (install nftables)")

    def set_link(self, peer: int, up: bool) -> None:
        """Cut or restore a peer's link: its veth end in the bridge goes down (packets are lost, TCP
        connections hang and retransmit) or up again."""
        self._run("ip", "link", "set", f"{self.prefix}h{peer}", "up" if up else "down", ns=self.bridge)

    def wire_bytes(self, peer: int) -> tuple[int, int]:
        """(sent, received) bytes on the peer's interface so far: what really crossed its link."""
        out = subprocess.run(["ip", "netns", "exec", self.namespace(peer), "cat", "/sys/class/net/eth0/statistics/tx_bytes",
                              "/sys/class/net/eth0/statistics/rx_bytes"], capture_output=True, text=True)
        tx, rx = (int(v) for v in out.stdout.split())
        return tx, rx

    def teardown(self) -> None:
        """Delete every namespace created (their interfaces and qdiscs go with them)."""
        for ns in reversed(self._created):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()
