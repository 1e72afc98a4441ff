"""Several hosts on one machine, as the internet sees them: one network namespace per host.

* Public hosts sit on one segment (a bridge in its own namespace) at 10.78.0.x and can dial each other.
* A private host sits behind its own NAT router: the router's WAN end is on the public segment,
  its LAN is 192.168.N.0/24, and nftables masquerades what leaves the LAN and drops whatever
  arrives from the WAN that the LAN did not ask for (a home router). Public hosts cannot dial it.
* Latency: this kernel has no ``netem``; each host that wants it runs ``sim/nfq_delay.py``, which
  delays what the host receives (give each host half the round-trip time you want).
* Bandwidth: an optional ``tbf`` cap on both directions of a host's link.

Needs root, iproute2, nftables (NAT) and iptables + the NetfilterQueue package (latency). Names
carry the creating process id so parallel runs never collide; ``teardown`` kills every process
left in the namespaces and deletes them (use the object as a context manager).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PUBLIC_SUBNET = "10.78.0"


class HostNetworkError(RuntimeError):
    pass


def missing_tools(nat: bool = False, delay: bool = False) -> str | None:
    """Why this machine cannot build the network (None if it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    needed = ["ip", "tc"] + (["nft"] if nat else []) + (["iptables"] if delay else [])
    for tool in needed:
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 nftables iptables)"
    if delay:
        try:
            import netfilterqueue  # noqa: F401
        except ImportError:
            return "added latency needs the NetfilterQueue package (apt-get install libnetfilter-queue-dev; " \
                   "pip install NetfilterQueue)"
    return None


@dataclass
class Host:
    name: str
    namespace: str
    ip: str  # its own address (a LAN address for a private host)
    public_ip: str  # how public hosts see it (its router's WAN address for a private host)


@dataclass
class HostNetwork:
    prefix: str = field(default_factory=lambda: f"lch{os.getpid() % 100000}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)
    _delayers: list[subprocess.Popen] = field(default_factory=list)
    _next_public: int = 10
    _next_lan: int = 1

    def __enter__(self) -> "HostNetwork":
        self._add_namespace(self._bridge)
        self._run("ip", "link", "add", "br0", "type", "bridge", ns=self._bridge)
        self._run("ip", "link", "set", "br0", "up", ns=self._bridge)
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    @property
    def _bridge(self) -> str:
        return f"{self.prefix}br"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].namespace]

    def add_public(self, name: str, *, delay_ms: float = 0.0, mbit: float | None = None) -> Host:
        ns = self._add_namespace(f"{self.prefix}{name}")
        ip = self._public_ip()
        self._plug(ns, "eth0", ip, mbit)
        self.hosts[name] = Host(name, ns, ip, ip)
        if delay_ms:
            self._delay(ns, "eth0", delay_ms)
        return self.hosts[name]

    def add_private(self, name: str, *, delay_ms: float = 0.0, mbit: float | None = None) -> Host:
        """A host behind a NAT router of its own."""
        lan = f"192.168.{self._next_lan}"
        self._next_lan += 1
        router = self._add_namespace(f"{self.prefix}{name}r")
        wan_ip = self._public_ip()
        self._plug(router, "wan", wan_ip, mbit)
        ns = self._add_namespace(f"{self.prefix}{name}")
        self._run("ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._run("ip", "addr", "add", f"{lan}.1/24", "dev", "lan", ns=router)
        self._run("ip", "link", "set", "lan", "up", ns=router)
        self._run("ip", "addr", "add", f"{lan}.2/24", "dev", "eth0", ns=ns)
        self._run("ip", "link", "set", "eth0", "up", ns=ns)
        self._run("ip", "route", "add", "default", "via", f"{lan}.1", ns=ns)
        self._run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=router)
        for rule in ("add table ip nat",
                     "add chain ip nat post { type nat hook postrouting priority 100 ; }",
                     "add rule ip nat post oifname wan masquerade",
                     "add table ip filter",
                     "add chain ip filter forward_lan { type filter hook forward priority 0 ; policy drop ; }",
                     "add rule ip filter forward_lan ct state established,related accept",
                     "add rule ip filter forward_lan iifname lan accept"):
            self._run("nft", *rule.split(), ns=router)
        self.hosts[name] = Host(name, ns, f"{lan}.2", wan_ip)
        if delay_ms:
            self._delay(ns, "eth0", delay_ms)
        return self.hosts[name]

    def teardown(self) -> None:
        for proc in self._delayers:
            proc.terminate()
        for proc in self._delayers:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._delayers.clear()
        for ns in reversed(self._namespaces):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()

    # -- plumbing -------------------------------------------------------------------------------

    def _public_ip(self) -> str:
        ip = f"{PUBLIC_SUBNET}.{self._next_public}"
        self._next_public += 1
        return ip

    def _add_namespace(self, ns: str) -> str:
        self._run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        self._run("ip", "link", "set", "lo", "up", ns=ns)
        return ns

    def _plug(self, ns: str, dev: str, ip: str, mbit: float | None) -> None:
        """A veth from ``ns`` (named ``dev``) to the public bridge, optionally capped both ways."""
        outer = f"{self.prefix}{len(self._namespaces)}x"
        self._run("ip", "link", "add", outer, "netns", self._bridge, "type", "veth", "peer", "name", dev, "netns", ns)
        self._run("ip", "link", "set", outer, "master", "br0", ns=self._bridge)
        self._run("ip", "link", "set", outer, "up", ns=self._bridge)
        self._run("ip", "addr", "add", f"{ip}/24", "dev", dev, ns=ns)
        self._run("ip", "link", "set", dev, "up", ns=ns)
        if mbit:
            tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "200ms"]
            self._run("tc", "qdisc", "replace", "dev", dev, "root", *tbf, ns=ns)
            self._run("tc", "qdisc", "replace", "dev", outer, "root", *tbf, ns=self._bridge)

    def _delay(self, ns: str, dev: str, delay_ms: float) -> None:
        ready = Path(f"/tmp/{ns}.delay-ready")
        ready.unlink(missing_ok=True)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "lioncub_p2p.sim.nfq_delay",
                                 "--delay-ms", str(delay_ms), "--dev", dev, "--ready-file", str(ready)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._delayers.append(proc)
        deadline = time.monotonic() + 15
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise HostNetworkError(f"latency for {ns} did not start: {proc.stderr.read().decode()[-300:]}")
            time.sleep(0.05)
        ready.unlink()

    def _run(self, *cmd: str, ns: str | None = None) -> None:
        full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
        result = subprocess.run(full, capture_output=True, text=True)
        if result.returncode != 0:
            raise HostNetworkError(f"{' '.join(full)} failed: {result.stderr.strip()}")
