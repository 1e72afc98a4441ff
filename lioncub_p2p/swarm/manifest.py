"""The run manifest: what every peer of a run must agree on, published once and adopted by joiners.

The founder of a run (or a coordinator, ``publish_manifest``) stores the run's settings under
``{run}.manifest``, signed like every record (``records.py``); the group's leader keeps it alive.
A joiner takes every field it has no opinion on (None) from the run's manifest and stops with one
line naming the field when an opinion it holds differs (``resolve``). Fields:

* ``protocol``: the wire protocol version; ``task``, ``task_args``: what model the run trains (free
  text for the trainer CLI, e.g. "digits" with {"hidden": 256}); ``layout_hash``, ``param_count``:
  the exact tensor layout (``snapshot.Layout.digest``) and its parameter count;
* what the swarm itself runs with and all peers must share: ``upload``, ``result``, ``transport``,
  ``momentum`` (a ``MomentumSchedule`` as a map), ``momentum_rule``, ``full_digest_every``, ``seed``,
  ``delay`` (1: overlapped rounds, each vote applied one step later), ``max_group`` (a two-level vote:
  groups of at most this many peers, their counts combined; unset or 0: one flat group);
* what the trainer should use: ``lr``, ``weight_decay``, ``betas``, ``lr_schedule`` (a description),
  ``batch_size``; ``secret_required`` (whether the run is private) and ``authority`` (an invited run:
  whose tickets admit, ``tickets.py``).

Which manifest a joiner trusts (``choose``): the one published by the run group's leader (or another
member; the group is found through the admission exchange, which in a private run proves its author
holds the run key), else, before any group exists, one signed by a coordinator it was given (a peer
id in its ``initial_peers``). The founder adopts its coordinator's manifest, completes it (layout,
the optimizer's lr, defaults) and publishes the result, which every leader keeps alive unchanged.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from ..codecs import L1Upload, is_values, result_codec, upload_codec
from ..identity import Identity, Verifier
from ..momentum import MomentumSchedule
from ..wire import PROTOCOL_VERSION
from .records import RateLimitedLog, dht_key, read_records, seal, store_record

MANIFEST_TTL = 600.0
MAX_MANIFESTS = 256
SWARM_FIELDS = ("upload", "result", "transport", "momentum", "momentum_rule", "full_digest_every", "seed", "delay",
                "max_group")
# fields older versions wrote that mean nothing now: read and dropped (audit_every: voters audit every round since
# protocol 2), so their run files still load
LEGACY_FIELDS = ("audit_every",)
_MOMENTUM_KEYS = {"every", "until", "geometric", "start", "params", "slices", "wire"}


class ManifestError(ValueError):
    """A manifest (file or record) that is malformed; the message is one line naming the field."""


class ManifestMismatch(ValueError):
    """This peer's settings or model differ from the run's."""


def _positive(value: Any, name: str, *, zero: bool = False, high: float = 1e6) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (value >= 0 if zero else value > 0) or value > high:
        raise ManifestError(f"{name} must be a {'non-negative' if zero else 'positive'} number up to {high:g}, "
                            f"got {value!r}")
    return float(value)


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ManifestError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _short(value: Any, name: str, limit: int = 200) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise ManifestError(f"{name} must be a non-empty line of at most {limit} characters, got {value!r}")
    return value


def upload_name(spec: Any) -> str:
    """The canonical name of an upload encoding ("l1" and "l1:4" are the same codec)."""
    try:
        codec = upload_codec(spec)
    except (ValueError, TypeError) as e:
        raise ManifestError(f"upload: {e}") from None
    if is_values(codec):
        raise ManifestError(f"upload: {codec.name} is a momentum format, not a vote's: use sign or l1:BITS here and "
                            f"momentum.wire for the momentum rounds")
    return f"l1:{codec.bits}" if isinstance(codec, L1Upload) else codec.name


def momentum_map(schedule: MomentumSchedule) -> dict[str, Any]:
    value: dict[str, Any] = {"every": schedule.every, "start": schedule.start}
    if schedule.until is not None:
        value["until"] = schedule.until
    if schedule.geometric is not None:
        value["geometric"] = schedule.geometric
    if schedule.params:
        value["params"] = list(schedule.params)
    if schedule.slices:
        value["slices"] = schedule.slices
    if schedule.wire != "bf16":  # absent: bf16 (manifests from before fp8 read the same)
        value["wire"] = schedule.wire
    return value


def _momentum(value: Any) -> dict[str, Any]:
    if isinstance(value, MomentumSchedule):
        return momentum_map(value)
    if not isinstance(value, dict) or not set(value) <= _MOMENTUM_KEYS:
        raise ManifestError(f"momentum must be a map with keys among {sorted(_MOMENTUM_KEYS)}, got {value!r}")
    params = value.get("params", [])
    if not isinstance(params, (list, tuple)) or len(params) > 64 or \
            not all(isinstance(p, str) and 0 < len(p) <= 200 for p in params):
        raise ManifestError("momentum.params must be a list of name patterns")
    try:
        schedule = MomentumSchedule(every=_integer(value.get("every", 0), "momentum.every", 0, 1 << 31),
                                    until=None if value.get("until") is None else
                                    _integer(value["until"], "momentum.until", 0, 1 << 53),
                                    geometric=None if value.get("geometric") is None else
                                    _positive(value["geometric"], "momentum.geometric"),
                                    start=_integer(value.get("start", 1), "momentum.start", 1, 1 << 53),
                                    params=tuple(params),
                                    slices=_integer(value.get("slices", 0), "momentum.slices", 0, 1 << 16),
                                    wire=value.get("wire", "bf16"))
    except ValueError as e:
        raise ManifestError(f"momentum: {e}") from None
    return momentum_map(schedule)


@dataclass(frozen=True)
class Manifest:
    """A run's settings; None: not set (in a joiner's opinions: adopt the run's)."""

    protocol: int | None = None
    task: str | None = None
    task_args: dict[str, Any] | None = None
    layout_hash: str | None = None
    param_count: int | None = None
    upload: str | None = None
    result: str | None = None
    transport: str | None = None
    momentum: dict[str, Any] | None = None
    momentum_rule: str | None = None
    full_digest_every: int | None = None
    seed: int | None = None
    delay: int | None = None
    max_group: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    lr_schedule: str | None = None
    batch_size: int | None = None
    secret_required: bool | None = None
    authority: str | None = None  # an invited run: the id of the authority whose tickets admit (tickets.py)

    def __post_init__(self) -> None:
        checked = {f.name: _check(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None}
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.max_group and (self.upload not in (None, "sign") or self.result not in (None, "majority")
                               or self.transport not in (None, "butterfly")):
            raise ManifestError(f"max_group needs upload sign, result majority and transport butterfly (the "
                                f"groups' counts are combined into the flat majority), got upload {self.upload}, "
                                f"result {self.result}, transport {self.transport}")

    # -- conversions -------------------------------------------------------------------------------

    def payload(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v, tuple) else v) for f in fields(self)
                if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_payload(cls, value: Any) -> "Manifest":
        """Raises ManifestError naming the first bad or unknown field."""
        if not isinstance(value, dict):
            raise ManifestError("a manifest must be a map of settings")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known and k not in LEGACY_FIELDS)
        if unknown:
            raise ManifestError(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**{k: v for k, v in value.items() if k in known})

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Manifest":
        """Read a run.yaml; ManifestError with one line (file and problem) for anything wrong."""
        import yaml

        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ManifestError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise ManifestError(f"{path}: not a text (UTF-8) YAML file; pass the run's run.yaml") from None
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ManifestError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
        if value is None:
            raise ManifestError(f"{path}: the manifest is empty")
        try:
            return cls.from_payload(value)
        except ManifestError as e:
            raise ManifestError(f"{path}: {e}") from None

    def digest(self) -> str:
        body = json.dumps(self.payload(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        return hashlib.blake2b(body, digest_size=16).hexdigest()

    # -- comparing ---------------------------------------------------------------------------------

    def merged(self, other: "Manifest | None") -> "Manifest":
        """This manifest's fields, and ``other``'s where this one has none."""
        if other is None:
            return self
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(self)
                                if getattr(self, f.name) is None and getattr(other, f.name) is not None})

    def conflicts(self, other: "Manifest") -> list[tuple[str, Any, Any]]:
        """(field, mine, theirs) for every field both set differently."""
        return [(f.name, mine, theirs) for f in fields(self)
                if (mine := getattr(self, f.name)) is not None and (theirs := getattr(other, f.name)) is not None
                and mine != theirs]

    def momentum_schedule(self) -> MomentumSchedule | None:
        if self.momentum is None:
            return None
        value = dict(self.momentum)
        value["params"] = tuple(value.get("params", ()))
        return MomentumSchedule(**value)


def _check(name: str, value: Any) -> Any:
    if name == "protocol":
        return _integer(value, name, 1, 1 << 31)
    if name == "task":
        return _short(value, name)
    if name == "task_args":
        if not isinstance(value, dict) or len(value) > 32:
            raise ManifestError("task_args must be a map of at most 32 settings")
        for k, v in value.items():
            _short(k, "task_args key", 64)
            if isinstance(v, float) and not math.isfinite(v) or not isinstance(v, (str, int, float, bool)) \
                    or isinstance(v, str) and len(v) > 200:
                raise ManifestError(f"task_args.{k} must be a short string, a number or a boolean, got {v!r}")
        return dict(value)
    if name == "layout_hash":
        if not isinstance(value, str) or len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
            raise ManifestError(f"layout_hash must be 32 hex digits, got {value!r}")
        return value
    if name in ("param_count",):
        return _integer(value, name, 0, 1 << 53)
    if name == "upload":
        return upload_name(value)
    if name == "result":
        try:
            return result_codec(value).name if isinstance(value, str) else result_codec(value).name
        except (ValueError, TypeError) as e:
            raise ManifestError(f"result: {e}") from None
    if name == "transport":
        if value not in ("butterfly", "allgather"):
            raise ManifestError(f"transport must be butterfly or allgather, got {value!r}")
        return value
    if name == "momentum":
        return _momentum(value)
    if name == "momentum_rule":
        if value not in ("trimmed_mean", "average"):
            raise ManifestError(f"momentum_rule must be trimmed_mean or average, got {value!r}")
        return value
    if name == "full_digest_every":
        return _integer(value, name, 1, 1 << 20)
    if name == "seed":
        return _integer(value, name, 0, (1 << 63) - 1)
    if name == "delay":
        return _integer(value, name, 0, 1)
    if name == "max_group":
        if value == 1:
            raise ManifestError("max_group must be 0 (one flat group) or at least 2, got 1")
        return _integer(value, name, 0, 4096)
    if name == "lr":
        return _positive(value, name, high=1e3)
    if name == "weight_decay":
        return _positive(value, name, zero=True, high=1e3)
    if name == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ManifestError(f"betas must be two numbers in [0, 1), got {value!r}")
        betas = tuple(_positive(b, "betas", zero=True, high=1.0) for b in value)
        if not all(b < 1.0 for b in betas):
            raise ManifestError(f"betas must be two numbers in [0, 1), got {value!r}")
        return betas
    if name == "lr_schedule":
        return _short(value, name)
    if name == "batch_size":
        return _integer(value, name, 1, 1 << 31)
    if name == "authority":
        if not isinstance(value, str) or not 0 < len(value) <= 128 or not value.isalnum():
            raise ManifestError(f"authority must be the id of the run's authority (lioncub-invite authority prints "
                                f"it), got {value!r}")
        return value
    if name == "secret_required":
        if not isinstance(value, bool):
            raise ManifestError(f"secret_required must be true or false, got {value!r}")
        return value
    raise ManifestError(f"unknown field {name!r}")


# momentum streamed 1/20 per step in fp8: no step waits for a whole-buffer round, 9.1 bits per value
DEFAULTS = Manifest(upload="sign", result="majority", transport="butterfly", momentum={"slices": 20, "wire": "fp8"},
                    momentum_rule="trimmed_mean", full_digest_every=10, seed=0, delay=0)


def resolve(opinions: Manifest, run: Manifest | None, run_id: str) -> Manifest:
    """This peer's manifest in run ``run_id``: the run's, where this peer has no opinion.

    Raises ManifestMismatch (one line) when an opinion differs from the run's."""
    if run is None:
        return opinions
    if run.protocol is not None and opinions.protocol is not None and run.protocol != opinions.protocol:
        newer = "upgrade lioncub-p2p" if run.protocol > opinions.protocol else "the run uses an older lioncub-p2p"
        raise ManifestMismatch(f"run {run_id} speaks protocol version {run.protocol}, this peer "
                               f"{opinions.protocol} ({newer})")
    conflicts = opinions.conflicts(run)
    if conflicts:
        name, mine, theirs = conflicts[0]
        more = f" (also {', '.join(n for n, _, _ in conflicts[1:])})" if len(conflicts) > 1 else ""
        raise ManifestMismatch(f"this peer's {name}={_show(mine)} differs from run {run_id}'s {name}={_show(theirs)}"
                               f"{more}: leave it unset to adopt the run's settings, or join another run")
    return opinions.merged(run)


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, tuple)) else str(value)


def choose(found: dict[str, Manifest], members: list[str], anchors: list[str]) -> Manifest | None:
    """The run's manifest among the signed ones ``found`` (by author): the first of the group's
    members' (leader first: what the running group uses), else, before a group exists, the first of
    the anchors' (coordinators this peer was given). Anyone else's is ignored."""
    return next((found[a] for a in list(members) + list(anchors) if a in found), None)


# -- in the DHT --------------------------------------------------------------------------------------

async def store(dht: DHT, run_id: str, manifest: Manifest, identity: Identity, *, ttl: float = MANIFEST_TTL,
                timeout: float = 10.0) -> bool:
    return await store_record(dht, identity, run_id, "manifest", manifest.payload(), get_dht_time() + ttl,
                              timeout=timeout)


async def read(dht: DHT, run_id: str, verifier: Verifier, log: RateLimitedLog, *,
               timeout: float = 10.0, authors: Collection[str] | None = None) -> dict[str, Manifest]:
    """Every well-formed, signed manifest of the run, by author (bad ones logged and skipped); only
    ``authors``' if given (those ``choose`` would take: a flood of others' cannot hide theirs)."""
    manifests = {}
    for author, payload, _ in await read_records(dht, run_id, "manifest", verifier, log, timeout=timeout,
                                                 limit=MAX_MANIFESTS, authors=authors):
        try:
            manifests[author] = Manifest.from_payload(payload)
        except (ManifestError, TypeError) as e:
            log.warning(f"manifest:{str(e)[:40]}", "ignoring the manifest of %.60s: %s", author, e)
    return manifests


def publish_manifest(dht: DHT, run_id: str, manifest: Manifest, identity: Identity, *, ttl: float = MANIFEST_TTL,
                     timeout: float = 10.0) -> bool:
    """Publish ``manifest`` for run ``run_id`` from synchronous code, signed by ``identity``: the DHT's
    own identity (e.g. a coordinator's, whose peer id volunteers pass in --initial-peers, which makes
    its manifest the one they trust). Republish every ttl/3 to keep it alive. Returns whether stored."""
    if dht.peer_id.to_base58() != identity.peer_id:
        raise ValueError("publish the manifest with the DHT's own identity (start the DHT with identity_path="
                         "identity.path): volunteers trust it by the peer id they dial")
    manifest = replace(manifest, protocol=manifest.protocol or PROTOCOL_VERSION)
    expiration = get_dht_time() + ttl
    value = seal(identity, run_id, "manifest", expiration, manifest.payload())
    future = dht.store(dht_key(run_id, "manifest"), value, expiration, subkey=identity.peer_id, return_future=True)
    return bool(future.result(timeout))
