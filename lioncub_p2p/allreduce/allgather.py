"""D-Lion's vote as its public code does it: every peer gathers every other peer's packed signs.

A baseline for the simulator, not a recommendation: each peer sends its whole buffer to each of
the n−1 others and receives theirs, (n−1)·d bits each way per step against the butterfly's
2·(n−1)/n·d, then takes the majority locally. It reuses the vote round's messages (``part`` = the
sender's group index) and checks, but has no recovery: a peer that misses an upload votes without it.
"""
from __future__ import annotations

import asyncio
import logging
import time

import torch
from hivemind.p2p import P2P, PeerID

from ..identity import Identity
from ..ops import majority_vote
from ..wire import MAX_FRAME_BYTES, PROTOCOL_VERSION, WireError, close_after_reply, pb, read_frame, write_frame
from ..wire.gate import StreamGate, guard
from .admission import OPEN, Admission
from .round import (MAX_FIRST_FRAME_BYTES, AllReduceConfig, PartReport, RoundReport, RoundSpec, chunk_spans,
                    result_wire, upload_wire)

logger = logging.getLogger(__name__)
GATHER_PROTOCOL = "lioncub/gather/1"


class GatherNode:
    """``identity`` is accepted for symmetry with VoteNode: uploads come straight from their senders
    over authenticated streams, so there is nothing to sign."""

    def __init__(self, p2p: P2P, config: AllReduceConfig | None = None, admission: Admission = OPEN,
                 identity: Identity | None = None):
        self.p2p, self.config, self.admission = p2p, config or AllReduceConfig(), admission
        self.peer_id = p2p.peer_id.to_base58()
        self._inbox: dict[bytes, dict[int, torch.Tensor]] = {}
        self._arrived: dict[bytes, asyncio.Event] = {}
        self._specs: dict[bytes, RoundSpec] = {}
        self._bytes_down: dict[bytes, int] = {}
        cfg = self.config
        self.gate = StreamGate("gather", per_peer=cfg.max_streams_per_peer, strangers=cfg.max_stranger_streams,
                               total=cfg.max_streams,
                               is_member=lambda peer: any(peer in s._index for s in self._specs.values()))

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(GATHER_PROTOCOL, guard(self.gate, self._on_stream))

    def _round(self, spec: RoundSpec) -> None:
        rid = spec.round_id
        self._specs.setdefault(rid, spec)
        self._inbox.setdefault(rid, {})
        self._arrived.setdefault(rid, asyncio.Event())
        self._bytes_down.setdefault(rid, 0)
        for old in list(self._specs)[: -self.config.keep_rounds]:
            for table in (self._specs, self._inbox, self._arrived, self._bytes_down):
                table.pop(old, None)

    async def run_round(self, spec: RoundSpec, upload: torch.Tensor, tag: bytes = b"") -> tuple[torch.Tensor, RoundReport]:
        started = time.perf_counter()
        me = spec.index_of(self.peer_id)
        self._round(spec)
        report = RoundReport(spec.round_id.hex(), spec.step, me, [PartReport(0, me, 0, spec.nbytes)])
        inbox, arrived = self._inbox[spec.round_id], self._arrived[spec.round_id]
        inbox[me] = upload[0].cpu().contiguous()
        self._check(spec.round_id)
        others = [i for i in range(len(spec.group)) if i != me]
        sends = [asyncio.create_task(self._send(spec, me, i, upload[0], report)) for i in others]
        try:
            await asyncio.wait_for(arrived.wait(), self.config.upload_timeout)
        except asyncio.TimeoutError:
            logger.info("gather round %s: %d of %d uploads", spec.round_id.hex()[:12], len(inbox), len(spec.group))
        await asyncio.gather(*sends, return_exceptions=True)
        counted = sorted(inbox)
        update = majority_vote(torch.stack([inbox[i] for i in counted]), seed=spec.seed, step=spec.step)
        report.parts[0].status, report.parts[0].counted = "ok", counted
        report.bytes_down = self._bytes_down[spec.round_id]
        report.timings["total"] = time.perf_counter() - started
        return update, report

    def _check(self, rid: bytes) -> None:
        if rid in self._specs and len(self._inbox[rid]) >= len(self._specs[rid].group):
            self._arrived[rid].set()

    async def _send(self, spec: RoundSpec, me: int, to: int, buffer: torch.Tensor, report: RoundReport) -> None:
        encoding, bits = upload_wire(spec.upload)
        writer = None
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(spec.group[to].peer_id),
                                                                          GATHER_PROTOCOL)
            data = buffer.numpy().tobytes()
            for offset, length in chunk_spans(len(data), self.config.chunk_bytes) or [(0, 0)]:
                chunk = data[offset : offset + length]
                sent = await write_frame(writer, pb.VoteChunk(
                    version=PROTOCOL_VERSION, round_id=spec.round_id, step=spec.step, part=me, offset=offset,
                    length=len(chunk), upload=encoding, upload_bits=bits, result=result_wire(spec.result), codes=chunk,
                    last=offset + length >= len(data),
                    token=self.admission.token(self.peer_id) if offset == 0 else b""))
                report.bytes_up += sent
            # the receiver closes once it has the last chunk; closing first can lose that chunk (QUIC)
            await close_after_reply(reader, writer, self.config.join_timeout)
        except Exception as e:
            logger.info("gather round %s: upload to %d failed: %s", spec.round_id.hex()[:12], to, e)
        finally:
            if writer is not None:
                writer.close()

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # the whole upload within the round's upload window, whatever the sender's pace
            await asyncio.wait_for(self._receive(info, reader), self.config.first_frame_timeout
                                   + self.config.join_timeout + self.config.upload_timeout)
        except Exception as e:
            logger.warning("gather upload from %s rejected: %s", info.peer_id, f"{type(e).__name__}: {e}")

    async def _receive(self, info, reader: asyncio.StreamReader) -> None:
        data, rid, sender = bytearray(), None, None
        while True:
            first = rid is None
            wait = self.config.first_frame_timeout if first else self.config.join_timeout
            chunk, nread = await asyncio.wait_for(
                read_frame(reader, pb.VoteChunk, MAX_FIRST_FRAME_BYTES if first else MAX_FRAME_BYTES), wait)
            if chunk is None:
                raise WireError("stream ended before the last chunk")
            if rid is None:
                refused = self.admission.reason(info.peer_id.to_base58(), chunk.token)
                if refused:
                    raise WireError(f"not admitted: {refused}")
                rid = chunk.round_id
                for _ in range(int(self.config.join_timeout / 0.01)):  # the round may not have started here
                    if rid in self._specs:
                        break
                    await asyncio.sleep(0.01)
                spec = self._specs.get(rid)
                if spec is None:
                    raise WireError("unknown round")
                sender = spec.index_of(info.peer_id.to_base58())
            if chunk.round_id != rid or chunk.part != sender or chunk.offset != len(data):
                raise WireError("chunk out of place")
            if len(data) + len(chunk.codes) > spec.nbytes:
                raise WireError("upload larger than the buffer")
            data += chunk.codes
            self._bytes_down[rid] = self._bytes_down.get(rid, 0) + nread
            if chunk.last:
                break
        if len(data) != spec.nbytes:
            raise WireError(f"upload of {len(data)} bytes, expected {spec.nbytes}")
        if rid in self._inbox:  # not forgotten meanwhile
            self._inbox[rid][sender] = torch.frombuffer(data, dtype=torch.uint8)
            self._check(rid)
