"""A round's update assembled from its parts' results (``assemble``): packed bits when every part has a
majority result, else float32 with zeros (or values with NaN) where a part is missing or does not
decode. Pure functions, no state: the voter's side (voting.py) and the cluster aggregator call it.
"""
from __future__ import annotations

import torch

from ..codecs import is_values
from ..ops import unpack_signs
from .round import PartResult, RoundSpec


def assemble(spec: RoundSpec, outcomes: dict[int, PartResult | None]) -> tuple[torch.Tensor, dict[int, str]]:
    """The whole buffer's update from its parts, and the parts whose bytes did not decode.

    Packed bits (nbytes,) if every part has a majority result, else float32 (nbytes*8,) with zeros
    where a part is missing or undecodable (every peer holding the same bytes decides the same)."""
    parts = sorted(outcomes)
    if is_values(spec.upload):  # values, not votes: NaN marks what the caller keeps locally
        return _assemble_values(spec, outcomes)
    if spec.result.name == "majority" and all(outcomes[j] is not None for j in parts):
        joined = bytearray(b"".join(outcomes[j].wire for j in parts))
        return (torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)), {}
    update, bad = torch.zeros(spec.nbytes * 8, dtype=torch.float32), {}
    for j in parts:
        outcome = outcomes[j]
        if outcome is None:
            continue
        a, b = spec.bounds[j]
        raw = torch.frombuffer(bytearray(outcome.wire), dtype=torch.uint8)
        try:
            if spec.result.name == "majority":
                update[8 * a : 8 * b] = unpack_signs(raw, 8 * (b - a))
            else:
                update[8 * a : 8 * b] = spec.result.decode(raw, 8 * (b - a), len(outcome.counted) * spec.upload.max_code)
        except ValueError as e:
            bad[j] = str(e)
    return update, bad


def _assemble_values(spec: RoundSpec, outcomes: dict[int, PartResult | None]) -> tuple[torch.Tensor, dict[int, str]]:
    values, bad = torch.full((spec.upload.values_in(spec.nbytes),), float("nan")), {}
    for j, outcome in outcomes.items():
        if outcome is None:
            continue
        a, b = spec.bounds[j]
        try:
            values[spec.upload.value_span(a, b)] = spec.result.decode(
                torch.frombuffer(bytearray(outcome.wire), dtype=torch.uint8), 8 * (b - a), len(outcome.counted),
                codec=spec.upload)
        except ValueError as e:
            bad[j] = str(e)
    return values, bad
