"""Two-level votes for large swarms: groups vote inside themselves, the group results are combined.

A flat butterfly over n peers opens n - 1 streams per peer per round and shrinks each part to
numel / n; past a few dozen peers, per-message latency, not bytes, sets the round time. With groups of
at most ``max_size`` peers, each group runs today's round, then the groups' results for each part are
combined so that every peer of the run applies the same update. Two ways to combine:

- **exact counts** (``combine_counts``): each group contributes its per-position vote count,
  ``planes_needed(g)`` bit planes for a group of g (3 bits for 4–7 peers, 6 for 32–63), and the sum
  over groups, thresholded at half of all voters, *is* the flat majority, bit for bit, ties included
  (the same (seed, step) tie stream as ``ops.majority_vote``);
- **majority of majorities** (``majority_of_majorities``): 1 bit per group, the majority of the
  groups' majorities; it differs from the flat majority where the groups' margins differ.
  ``benchmarks/two_level.py`` measures how often on real gradients (``docs/benchmarks.md``).

``assign_groups`` is a pure function of the members and the group record's epoch, so every peer
computes the same groups without matchmaking, and a new epoch (after churn) rebalances them. It
reshuffles every group (the epoch salts the order, so nobody picks its group by grinding peer ids):
under exact counts the result does not depend on the grouping, but each change reopens streams.

``two_level_layout`` says who does what in a round under exact counts: every group splits the buffer
into the same P parts (P = its smallest group's size) and its member k reduces part k; the G reducers
of part k then run a butterfly of their own on the count planes (group q's reducer combines the q-th
slice of part k and sends that slice's majority back to the other G - 1), and each sends part k's
result to its group. Per peer and round that is 2(g - 1) + 2(G - 1) messages instead of 2(n - 1).
``sim/scale.py`` times this pattern against the flat butterfly for hundreds of peers.

**On the wire, the second level is an ordinary round.** A group's counts travel as the L1 codes of
its *margin* (``margin_codes``: 2c - v + s per position, c of its v counted voters for, s =
2^(bits-1) - 1), and a reducer that sums L1 codes and thresholds the sum at half of G·2s with the
(seed, step) tie stream, which is what ``codecs.L1Upload`` with ``MajorityResult`` does, gives the flat
majority bit for bit: sum(2c - v) > 0 exactly when 2·sum(c) > sum(v), and the ties fall on the same
positions (``RoundSpec.tie_offset`` places a part's round in the whole buffer's tie stream).
``two_level_specs`` builds each peer's first-level round with ``RoundSpec.combine``: the reducer of
part k closes its group's count (``PartReduction.counts``), votes the margins in part k's round among
the G groups' reducers of part k (``VoteNode._combine``, prepared with the first level so that early
groups' margins are counted as they come) and returns that round's majority as part k's result,
signed by itself, to its group's voters. So the combiner's deadline, quorum (over groups), signed
results, recovery and audits among the combiners are the round machinery's: a group late at a
combiner is left out of that slice for every peer alike, and a slice nobody received leaves part k
without a result in every group (``LocalSwarm.two_level``, tested with 13 nodes). A group whose
reducer of part k combined and then failed to answer it assembles part k from that round's signed
slices, fetched from the other groups' reducers of part k (``VoteNode._recover_combined``); so does a
group whose votes for part k fell below its quorum, its reducer included (its votes are left out of
part k, which the other groups decide: a failed group does not split the run while the slices can
be fetched).

A run votes two-level when its manifest sets ``max_group`` (``RoundBook.two_level_spec``: the layout from
the group record's members and epoch). Each group's reducer votes its group's state tag at the second
level, and ``group_tag`` tells a group that diverged as a whole (``docs/protocol.md``).
A voter audits a first-level result by comparing a slice of it with the combiners' signed slice
(``VoteNode._compare_with_second_level``), then the margins its reducer sent up with a recount of
the group's votes at the same positions (``VoteNode._check_margins``; each reducer signs its margins'
root in the second-level round, ``RoundSpec.second_level``): a mismatch is a lie proven by pieces the
reducer signed (``audit.judge_margins``).
``benchmarks/two_level_wire.py`` times both kinds of round side by side on loopback.
"""
from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from .. import codecs, ops
from .partition import PeerSpec, part_bounds
from .round import RoundReport, RoundSpec, decides


def assign_groups(peer_ids: Sequence[str], epoch: int, max_size: int = 32,
                  reducers: Collection[str] | None = None) -> list[list[str]]:
    """Split the members into ceil(n / max_size) groups whose sizes differ by at most one, in an order
    drawn from (epoch, peer id): the same on every peer, whatever order it lists the members in.
    Never a group of one among several: nobody would count its member's votes or report them missed
    (``swarm/lead.py``), so a member that stalled there was never dropped. ``max_size`` 2 with an odd
    number of members puts three in one group.

    ``reducers`` (default: everyone): the members that may reduce a part (not in client mode, weight
    above 0). They are spread evenly and listed first in each group; the others fill the smallest
    groups after them; never more groups than reducers (a group needs one)."""
    if max_size < 1:
        raise ValueError(f"max_size must be at least 1, got {max_size}")
    if len(set(peer_ids)) != len(peer_ids):
        raise ValueError("peer ids must be distinct")
    order = sorted(peer_ids, key=lambda pid: hashlib.blake2b(f"{epoch}|{pid}".encode(), digest_size=16).digest())
    if not order:
        return []
    able = [pid for pid in order if reducers is None or pid in reducers]
    if not able:
        raise ValueError("no member may reduce: a group needs a reducer")
    count = min(max(1, -(-len(order) // max_size)), len(able), max(1, len(order) // 2))
    groups = [able[i::count] for i in range(count)]
    for pid in (pid for pid in order if reducers is not None and pid not in reducers):
        min(groups, key=len).append(pid)  # the first of the smallest: the same on every peer
    return groups


@dataclass(frozen=True)
class TwoLevelLayout:
    """Who reduces and who combines which bytes in a two-level round; the same on every peer.

    ``parts[k]``: the byte range member k of every group reduces (votes of its group, into count
    planes); ``slices[k][q]``: the range of part k that group q's reducer of part k combines (the
    groups' counts, into the majority), contiguous and covering part k."""

    groups: tuple[tuple[str, ...], ...]
    parts: tuple[tuple[int, int], ...]
    slices: tuple[tuple[tuple[int, int], ...], ...]

    def reducer(self, group: int, part: int) -> str:
        return self.groups[group][part]


def two_level_layout(peer_ids: Sequence[str], epoch: int, nbytes: int, max_size: int = 32,
                     reducers: Collection[str] | None = None) -> TwoLevelLayout:
    """The layout for these members at this group epoch (``assign_groups``, then equal parts, as many as
    the group with the fewest reducers has: they are listed first, so member k of every group may reduce)."""
    groups = tuple(tuple(g) for g in assign_groups(peer_ids, epoch, max_size, reducers))
    if not groups:
        raise ValueError("a two-level round needs at least one peer")
    size = min(sum(reducers is None or pid in reducers for pid in g) for g in groups)
    parts = tuple(part_bounds(nbytes, [PeerSpec(str(k)) for k in range(size)]))
    combiners = [PeerSpec(str(q)) for q in range(len(groups))]
    slices = tuple(tuple((start + a, start + b) for a, b in part_bounds(stop - start, combiners))
                   for start, stop in parts)
    return TwoLevelLayout(groups, parts, slices)


def derived_round_id(round_id: bytes, *what: object) -> bytes:
    """The id of a round of a two-level vote: ``("group", q)`` for group q's round, ``("part", k)`` for
    part k's second-level round, both from the flat round's id (so a proof can tie them together)."""
    return hashlib.blake2b(repr((round_id, *what)).encode(), digest_size=16).digest()


def two_level_specs(round_id: bytes, step: int, layout: TwoLevelLayout, nbytes: int, *, seed: int = 0,
                    family: str = "", members: Mapping[str, PeerSpec] | None = None) -> dict[str, RoundSpec]:
    """Each peer's first-level round of a two-level vote at ``layout``: its group's round, in which member k
    reduces ``layout.parts[k]`` (members past the smallest group's size reduce nothing) and then runs the
    part's second-level round among the groups' reducers of part k (``RoundSpec.combine``): margins as L1
    votes, combiner q counting ``layout.slices[k][q]``, ties from the part's place in the whole buffer.
    Every peer builds the same specs from the same layout; round ids are derived from ``round_id``.
    ``members``: each peer's spec in the swarm's group (client mode, voter), kept in its group's round;
    the layout alone says who reduces."""
    def derived(*what: object) -> bytes:
        return derived_round_id(round_id, *what)

    size = len(layout.parts)
    bits = margin_bits(max(len(g) for g in layout.groups))
    combine = tuple(RoundSpec(derived("part", k), step, tuple(PeerSpec(g[k]) for g in layout.groups), b - a,
                              codecs.L1Upload(bits), codecs.MajorityResult(), seed, family=family and "combine",
                              tie_offset=a, second_level=True, margin_caps=tuple(len(g) for g in layout.groups))
                    for k, (a, b) in enumerate(layout.parts))
    specs = {}
    for q, group_ids in enumerate(layout.groups):
        flags = [members[pid] if members is not None else PeerSpec(pid) for pid in group_ids]
        group = tuple(PeerSpec(pid, 1.0 if k < size else 0.0, m.client_mode, m.voter)
                      for k, (pid, m) in enumerate(zip(group_ids, flags)))
        spec = RoundSpec(derived("group", q), step, group, nbytes, seed=seed, family=family,
                         combine=combine + (None,) * (len(group_ids) - size), flat_round=round_id, group_index=q)
        assert spec.bounds[:size] == list(layout.parts), "a group's parts are the layout's"
        specs.update(dict.fromkeys(group_ids, spec))
    return specs


def decided_tag(tag: bytes, votes: int, voters: Collection[int], counted: Collection[int],
                provisional: Collection[int] = ()) -> bytes:
    """What a group's reducer votes at the second level for its group's state: the tag more than half of
    the group's ``voters`` and of any others its part ``counted`` (followers in time) sent, else none
    (b""): a pair split one to one names a tag by byte order, and groups voting such tags up made the
    diverged peers' state the swarm's."""
    return tag if decides(votes, voters, counted, provisional) else b""


def group_tag(tag: bytes, votes: int, counted: int, combined: RoundReport, groups: int) -> tuple[bytes, int]:
    """The state tag a group's reducer puts in its part's result after the second level: the state most
    of the ``groups`` decided for (each reducer votes its group's ``decided_tag`` in the combine round;
    ``RoundReport.tag_majority``), as if every voter of the group had sent it: every voter of a group
    that diverged as a whole repairs, and so does a member that diverged alone in a group of two (1 of
    2 decides nothing there) where most groups decided for the common state (where most abstain, pairs
    apart in two groups of three, a group's own majority is all there is: the closing check settles the
    rest).
    Where no state has that, its group's (``tag``, held by ``votes`` of the ``counted`` voters), which
    decides for nothing a split group needs. (A part whose quorum a follower's in-time vote completed,
    half of the group's voters or fewer counted, tells its members nothing: they hear it next step or
    at the closing check.)"""
    across, _, _ = combined.tag_majority(range(groups))
    if across:
        return across, counted
    return tag, votes


def group_counts(stack: torch.Tensor) -> torch.Tensor:
    """What one group sends up under exact counts: the bit planes of its per-position vote count."""
    return ops.count_planes(stack)


def combine_counts(planes: Sequence[torch.Tensor], voters: Sequence[int], *, seed: int = 0, step: int = 0,
                   offset: int = 0) -> torch.Tensor:
    """The flat majority (packed) from each group's count planes and number of voters.

    ``offset``: the first byte of this part in the whole buffer, for the tie stream."""
    if not planes or len(planes) != len(voters):
        raise ValueError("one count (bit planes) per group, and as many voter numbers")
    nbytes = planes[0].shape[1]
    if any(p.dim() != 2 or p.shape[1] != nbytes or p.dtype != torch.uint8 for p in planes):
        raise ValueError("count planes must be uint8 (planes, nbytes) of one part")
    counts = torch.zeros(nbytes * 8, dtype=torch.int32, device=planes[0].device)
    for p, n in zip(planes, voters):
        if not 0 <= n < 1 << p.shape[0]:
            raise ValueError(f"{n} voters do not fit in {p.shape[0]} count planes")
        counts += ops.planes_to_counts(p).to(torch.int32)
    total = sum(voters)
    bits = counts * 2 > total
    if total % 2 == 0:
        ties = ops.unpack_signs(ops.random_tie_bits(seed, step, nbytes, offset=offset, device=counts.device),
                                nbytes * 8) > 0
        bits |= (counts * 2 == total) & ties
    return ops.pack_signs(bits.to(torch.float32) * 2 - 1)


def margin_bits(max_group: int) -> int:
    """Code planes for margins of groups of up to ``max_group`` voters (|2c - v| <= v <= s)."""
    bits = ops.planes_needed(max_group) + 1
    if not 2 <= bits <= 8:
        raise ValueError(f"margins of groups of {max_group} voters need {bits} bits; L1 codes hold 2..8")
    return bits


def margin_codes(planes: torch.Tensor, voters: int, bits: int) -> torch.Tensor:
    """A group's count planes (``group_counts``, ``voters`` counted) as (bits, nbytes) L1 codes of its
    margin, 2c - v + s: what its reducer would send to the second level as an ordinary L1 vote."""
    s = (1 << (bits - 1)) - 1
    if not 0 <= voters <= s:
        raise ValueError(f"{voters} voters do not fit in {bits}-bit margins")
    margin = 2 * ops.planes_to_counts(planes).to(torch.int32) - voters + s
    return codecs.pack_planes(margin, bits)


def majority_of_majorities(group_results: torch.Tensor, *, seed: int = 0, step: int = 0) -> torch.Tensor:
    """1 bit per group: the majority (packed) of the groups' packed majorities, ties as in a flat vote."""
    return ops.majority_vote(group_results, seed=seed, step=step)


def upward_bits(group_sizes: Sequence[int], rule: str) -> float:
    """Bits per parameter the second level receives from all groups together, per round."""
    if rule == "counts":
        return float(sum(ops.planes_needed(g) for g in group_sizes))
    if rule == "majority":
        return float(len(group_sizes))
    raise ValueError(f"rule must be 'counts' or 'majority', got {rule!r}")
