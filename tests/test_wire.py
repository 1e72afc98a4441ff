"""The generated protobuf module matches proto/lioncub.proto, and framing bounds what a peer can send."""
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from lioncub_p2p.wire import MAX_FRAME_BYTES, PROTOCOL_VERSION, WireError, lioncub_pb2, pb, read_frame, write_frame

ROOT = Path(__file__).resolve().parents[1]


def test_generated_module_is_not_stale(tmp_path):
    out = tmp_path / "lioncub.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--descriptor_set_out={out}",
                    str(ROOT / "proto" / "lioncub.proto")], check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # protoc fills json_name in descriptor sets, not in generated code
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(lioncub_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "regenerate: python -m grpc_tools.protoc -Iproto --python_out=lioncub_p2p/wire proto/lioncub.proto"


class _Sink:
    def __init__(self):
        self.data = bytearray()

    def write(self, b):
        self.data += b

    async def drain(self):
        pass


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_frame_round_trip_and_limits():
    async def go():
        sink = _Sink()
        msg = pb.FetchResult(version=PROTOCOL_VERSION, round_id=b"r", part=3)
        written = await write_frame(sink, msg)
        assert written == len(sink.data)
        got, nread = await read_frame(_reader(bytes(sink.data)), pb.FetchResult)
        assert got == msg and nread == written
        assert await read_frame(_reader(b""), pb.FetchResult) == (None, 0)
        with pytest.raises(WireError, match="exceeds"):
            await read_frame(_reader((MAX_FRAME_BYTES + 1).to_bytes(4, "big")), pb.FetchResult)
        with pytest.raises(WireError, match="ended"):
            await read_frame(_reader((10).to_bytes(4, "big") + b"abc"), pb.FetchResult)
        with pytest.raises(WireError, match="version"):
            sink = _Sink()
            await write_frame(sink, pb.FetchResult(version=99))
            await read_frame(_reader(bytes(sink.data)), pb.FetchResult)
        with pytest.raises(WireError, match="undecodable"):
            await read_frame(_reader((3).to_bytes(4, "big") + b"\xff\xff\xff"), pb.FetchResult)

    asyncio.run(go())


def test_each_frame_reaches_the_daemon_in_one_write():
    """Two writes per frame cost a second syscall and daemon read (-17% median step with one write)."""

    class CountingSink(_Sink):
        writes = 0

        def write(self, b):
            self.writes += 1
            super().write(b)

    async def go():
        sink = CountingSink()
        msg = pb.VoteChunk(version=PROTOCOL_VERSION, round_id=b"r", codes=bytes(1000), last=True)
        written = await write_frame(sink, msg)
        assert sink.writes == 1 and written == len(sink.data) == 4 + msg.ByteSize()
        got, _ = await read_frame(_reader(bytes(sink.data)), pb.VoteChunk)
        assert got == msg

    asyncio.run(go())


def test_a_rounds_first_chunk_is_small_and_chunks_tile_the_part():
    """The first chunk of a part arrives within the reducer's first-frame deadline even at 1 Mbit/s
    (4 KiB: 33 ms), and the chunks cover the part exactly, 8-byte aligned."""
    from lioncub_p2p.allreduce.round import FIRST_CHUNK_BYTES, chunk_spans

    for nbytes, chunk in [(0, 256 << 10), (5, 256 << 10), (4096, 256 << 10), (1_000_003, 256 << 10),
                          (100_000, 1024), (100_000, 1 << 20)]:
        for planes in (1, 2, 3, 4):  # sign votes have one plane, an l1:P code P of them
            spans = chunk_spans(nbytes, chunk, planes=planes)
            assert sum(length for _, length in spans) == nbytes
            assert all(o1 + l1 == o2 for (o1, l1), (o2, _) in zip(spans, spans[1:]))
            assert all(offset % 8 == 0 for offset, _ in spans)
            if spans:  # what a frame carries (length bytes of every plane) stays within the caps
                assert spans[0][1] * planes <= min(FIRST_CHUNK_BYTES, chunk)
                assert spans[0] == (0, min(nbytes, min(FIRST_CHUNK_BYTES, chunk) // planes // 8 * 8))
                assert all(length * planes <= chunk for _, length in spans)


def test_a_peers_text_reaches_a_log_line_printable_and_bounded():
    """Errors and reasons peers send end up in this peer's log: a newline or a terminal escape in them
    would forge lines ("[ OK ] ..."), a megabyte of them would flood it."""
    from lioncub_p2p.wire import printable

    forged = "busy\n  [ OK ] bandwidth to Qm…: upload 900 Mbit/s\x1b[2K\r"
    assert printable(forged) == "busy  [ OK ] bandwidth to Qm…: upload 900 Mbit/s[2K"
    assert printable("x" * 10**6, 200) == "x" * 200 and printable("\n" * 10**6) == ""
