"""SwarmConfig: the knobs of a swarm member, checked when made (one line naming the field)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..allreduce import AllReduceConfig
from ..momentum import MomentumSchedule
from ..wire import PROTOCOL_VERSION
from . import manifest as manifests
from ..identity import Verifier
from .manifest import Manifest, ManifestError
from .tickets import Ticket, TicketError, decode

_VERIFIER = Verifier()

MAX_RECORD_TTL = 300.0
# TCP and QUIC on every interface, ports chosen by the OS. Over QUIC a stream closed right after its
# last write loses that write, so every handler here that ends a stream with a reply waits (bounded)
# for the reader to close first (wire.close_after_reply; tests/test_transfer.py)
LISTEN_ALL = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]

MAX_WEIGHT = 1e6  # a peer's announced share of the reduction work (its upload Mbit/s, say)

@dataclass
class SwarmConfig:
    """Knobs of a swarm member. Timeouts are in seconds.

    Settings every peer of a run must share (``upload`` ... ``seed``, and ``manifest`` for the
    trainer's: task, lr, batch size, ...) default to None: adopt the run's manifest (the library
    defaults when founding a run); a value given is an opinion the run must share, else joining stops
    with one line naming the field."""

    run_id: str
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: list(LISTEN_ALL))  # all interfaces, TCP and QUIC
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None  # None: a fresh key in a private temporary directory
    # "auto": ask the initial peers whether they can dial this machine (reachability.py): client mode if
    # not, the observed address announced behind a 1:1 NAT; True: client mode (dial out only, vote, reduce
    # nothing, serve no state); False: listen as configured
    client_mode: bool | str = "auto"
    weight: float = 1.0  # share of the reduction work (e.g. upload Mbit/s)
    nat_probing: bool = False  # UPnP / AutoNAT probing of the real network card
    upload: str | None = None  # "sign", "l1:BITS"
    result: str | None = None  # "majority", "ternary", "mean"
    transport: str | None = None  # "butterfly", or "allgather": D-Lion's all-gather of every vote (a baseline)
    momentum: MomentumSchedule | None = None  # default: streamed 1/20 per step, fp8 on the wire
    momentum_rule: str | None = None  # "trimmed_mean" (default) or "average"
    full_digest_every: int | None = None  # the state tag hashes every parameter byte on these steps (default 10)
    seed: int | None = None  # keys the shared random bits of rounds (default 0)
    # 1: overlapped rounds, the vote of step t travels during step t + 1's forward/backward and is applied
    # then (LionCub's docstring); 0 (default): each step waits for its own vote
    delay: int | None = None
    # a two-level vote (allreduce/hierarchy.py): groups of at most this many members vote inside
    # themselves and their counts are combined into the flat majority; 0 (default): one flat group
    max_group: int | None = None
    manifest: Manifest | None = None  # opinions on the trainer's settings (task, lr, batch size, ...)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    lead_steps: int = 3  # a new group takes effect at least this many steps after the leader decides it (lead.py)
    record_ttl: float = 10.0
    refresh_period: float = 0.5
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    max_state_uploads: int = 2
    join_timeout: float = 120.0
    run_secret: str | None = None  # admission: only peers knowing it vote, reduce, serve state, average
    allow_peers: list[str] = field(default_factory=list)  # admission: only these peer ids (if given)
    # an invited run: this peer's ticket (its text, ``tickets.Ticket.text``), signed by the run's authority for
    # this peer's id (``identity_path``); only peers holding one take part (``tickets.py``)
    ticket: str | None = None

    def __post_init__(self) -> None:
        if not self.run_id or "." in self.run_id:
            raise ValueError(f"run_id must be a non-empty name without dots, got {self.run_id!r}")
        if not 0 < self.record_ttl <= MAX_RECORD_TTL:
            raise ValueError(f"record_ttl must be in (0, {MAX_RECORD_TTL:.0f}] s, got {self.record_ttl}")
        if not self.weight >= 0 or self.weight > MAX_WEIGHT:
            raise ValueError(f"weight must be in [0, {MAX_WEIGHT:g}], got {self.weight}")
        if self.client_mode not in (True, False, "auto"):
            raise ValueError(f"client_mode must be True, False or 'auto', got {self.client_mode!r}")
        if self.ticket is not None:
            ticket = self.invitation()
            if ticket.run_id != self.run_id:
                raise ValueError(f"the ticket is for run {ticket.run_id}, not {self.run_id}: pass --run-id "
                                 f"{ticket.run_id}, or ask the organizer of {self.run_id} for a ticket")
        self.opinions()  # checks every setting given (ManifestError, a ValueError, names the field)

    def opinions(self) -> Manifest:
        """What this config says about the run's manifest (None where it has no opinion)."""
        own = Manifest(**{name: getattr(self, name) for name in manifests.SWARM_FIELDS if getattr(self, name) is not None})
        base = self.manifest or Manifest()
        clash = base.conflicts(own)
        if clash:
            raise ManifestError(f"{clash[0][0]} is set differently in SwarmConfig and in SwarmConfig.manifest")
        return replace(base.merged(own), protocol=PROTOCOL_VERSION, secret_required=self.run_secret is not None,
                       authority=self.invitation().authority if self.ticket is not None else base.authority)

    def invitation(self) -> Ticket:
        """This peer's ticket, decoded and signature-checked (ValueError, one line, if it is not one)."""
        try:
            return decode(self.ticket, _VERIFIER)
        except TicketError as e:
            raise ValueError(f"ticket: {e}") from None
