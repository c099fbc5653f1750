"""Fork, ExportKV, ImportKV and TransferKV between real server subprocesses."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from chunkattn_client import BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel, kvfile
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from tests.helpers.server_process import SMALL, ServerProcess, connections, counter, free_port
from tests.helpers.tensors import qkv

pytestmark = pytest.mark.server

HKV, D, C, BS = 2, 16, 16, 4


@pytest.fixture(scope="module")
def a() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL) as s:
        yield s


@pytest.fixture(scope="module")
def b() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL) as s:
        yield s


def client(s: ServerProcess) -> ChunkAttnClient:
    return ChunkAttnClient(s.target, timeout_s=60)


class Feed:
    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def step(self, clients: list[ChunkAttnClient], ids: list[str], position: int, n: int) -> list[list[np.ndarray]]:
        """Every layer once, the same tensors to each client; returns the outputs per client."""
        outs: list[list[np.ndarray]] = [[] for _ in clients]
        for layer in range(4):
            q, k, v = qkv(self.rng, n)
            for i, (c, s) in enumerate(zip(clients, ids, strict=True)):
                outs[i].append(c.attend(layer, [BatchEntry(s, position, n)], q, k, v))
        return outs


def pool(s: ServerProcess) -> tuple[int, int]:
    with client(s) as c:
        info = c.info()
    return info.free_blocks, info.active_sequences


def test_decoding_after_a_transfer_equals_decoding_at_the_source_bit_for_bit(
    a: ServerProcess, b: ServerProcess
) -> None:
    feed = Feed()
    with client(a) as ca, client(b) as cb:
        feed.step([ca], ["t1"], 0, 50)
        moved = ca.transfer_kv("t1", b.target, new_seq_id="t1-moved")
        assert moved.released is False
        assert moved.records >= moved.blocks > 0
        for i in range(20):  # 50..69 crosses the chunk boundary at 64 in the chunked layers
            src, dst = feed.step([ca, cb], ["t1", "t1-moved"], 50 + i, 1)
            for x, y in zip(src, dst, strict=True):
                assert np.array_equal(x, y)
        ca.release(["t1"])
        cb.release(["t1-moved"])


def _chunks(c: ChunkAttnClient, seq_id: str, **kw: object) -> list[pb.KVChunk]:
    return list(c.export_kv(seq_id, **kw))  # type: ignore[arg-type]


def test_chunked_layers_move_one_chunk_and_a_block_whatever_the_prompt(
    a: ServerProcess, b: ServerProcess, tmp_path: Path
) -> None:
    with client(a) as ca, client(b) as cb:
        Feed(1).step([ca], ["long"], 0, 10 * C + 3)
        path = tmp_path / "long.kv"
        messages, size = kvfile.write(path, ca.export_kv("long", max_message_bytes=4096))
        chunks = list(kvfile.read(path))
        assert len(chunks) == messages > 3  # small messages: several block messages
        per_layer: dict[int, int] = {}
        for ch in chunks:
            for blk in ch.blocks.blocks:
                per_layer[blk.layer] = per_layer.get(blk.layer, 0) + 1
        for layer in (0, 1, 2):  # chunked, C = 16
            assert per_layer[layer] * BS <= C + BS
        assert per_layer[3] == -(-(10 * C + 3) // BS)  # the global layer: everything
        imported = cb.import_kv(kvfile.read(path), seq_id="long-copy")
        assert imported.records == sum(per_layer.values())
        assert imported.bytes == sum(per_layer.values()) * 2 * HKV * BS * D * 4
        assert size > imported.bytes
        for c, s in ((ca, "long"), (cb, "long-copy")):
            c.release([s])


@pytest.fixture
def exported(a: ServerProcess) -> Iterator[list[pb.KVChunk]]:
    with client(a) as ca:
        Feed(2).step([ca], ["src"], 0, 37)
        yield _chunks(ca, "src", max_message_bytes=2048)
        ca.release(["src"])


def _refused(target: ServerProcess, chunks: list[pb.KVChunk], code: grpc.StatusCode, text: str) -> None:
    before = pool(target)
    with client(target) as c, pytest.raises(ChunkAttnError) as e:
        c.import_kv(chunks)
    assert e.value.code == code, e.value
    assert text in e.value.message
    assert pool(target) == before  # nothing allocated, nothing created


def test_an_import_that_stalls_after_its_header_is_abandoned_and_returns_its_blocks(
    exported: list[pb.KVChunk],
) -> None:
    with ServerProcess(*SMALL, "--kv-import-stall-s", "1") as target:
        before = pool(target)
        resume = threading.Event()

        def header_then_silence() -> Iterator[pb.KVChunk]:
            yield exported[0]
            resume.wait(30)

        with client(target) as c, concurrent.futures.ThreadPoolExecutor(1) as pool_thread:
            call = pool_thread.submit(c.import_kv, header_then_silence())
            deadline = time.monotonic() + 10
            while pool(target)[0] == before[0]:  # the header reserved the blocks...
                assert time.monotonic() < deadline, "the import never reserved its blocks"
                time.sleep(0.05)
            with pytest.raises(ChunkAttnError) as e:
                call.result(timeout=30)
            resume.set()
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        assert "sent nothing for 1 s (messages so far: 1)" in e.value.message
        assert pool(target) == before  # ...and the stall returned them


def test_a_damaged_block_is_data_loss(b: ServerProcess, exported: list[pb.KVChunk]) -> None:
    damaged = [pb.KVChunk.FromString(c.SerializeToString()) for c in exported]
    block = damaged[2].blocks.blocks[0]
    block.k = bytes([block.k[0] ^ 0xFF]) + block.k[1:]
    _refused(b, damaged, grpc.StatusCode.DATA_LOSS, "fails its checksum")


@pytest.mark.parametrize("cut", [1, 2])  # without the trailer; without the last blocks and the trailer
def test_a_stream_cut_short_is_data_loss(b: ServerProcess, exported: list[pb.KVChunk], cut: int) -> None:
    _refused(b, exported[:-cut], grpc.StatusCode.DATA_LOSS, "cut short")


def test_another_model_shape_is_invalid_argument_naming_the_difference(exported: list[pb.KVChunk]) -> None:
    other = [*SMALL[: SMALL.index("--head-size") + 1], "32", *SMALL[SMALL.index("--head-size") + 2 :]]
    with ServerProcess(*other) as s:
        _refused(s, exported, grpc.StatusCode.INVALID_ARGUMENT, "head_size: 32 here, 16 in the stream")


def test_an_id_in_use_is_already_exists(a: ServerProcess, exported: list[pb.KVChunk]) -> None:
    _refused(a, exported, grpc.StatusCode.ALREADY_EXISTS, "'src'")  # the source still holds "src"


def test_too_few_free_blocks_is_resource_exhausted(exported: list[pb.KVChunk]) -> None:
    with ServerProcess(*SMALL, "--num-blocks", "8") as small:
        _refused(small, exported, grpc.StatusCode.RESOURCE_EXHAUSTED, "the import needs")


def test_transfer_with_release_moves_the_sequence_and_counts_it(a: ServerProcess, b: ServerProcess) -> None:
    feed = Feed(3)
    with client(a) as ca, client(b) as cb:
        feed.step([ca], ["mv"], 0, 21)
        a_free, a_active = pool(a)
        moved = ca.transfer_kv("mv", b.target, release_after=True)
        assert moved.released
        # The pool gauges followed the release and the import at once (read before Info, which sets them too).
        gauges = [counter(s.metrics(), "chunkattn_active_sequences") for s in (a, b)]
        assert gauges == [pool(a)[1], pool(b)[1]]
        assert moved.seconds > 0
        assert pool(a) == (a_free + moved.blocks, a_active - 1)
        with pytest.raises(ChunkAttnError) as e:
            ca.release(["mv"])
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        feed.step([cb], ["mv"], 21, 1)  # it decodes on b
        cb.release(["mv"])
    sent = counter(a.metrics(), "chunkattn_kv_transfer_bytes_total", direction="out")
    received = counter(b.metrics(), "chunkattn_kv_transfer_bytes_total", direction="in")
    assert sent >= moved.bytes > 0
    assert received >= moved.bytes
    assert counter(a.metrics(), "chunkattn_kv_transfers_total", code="OK", direction="out") >= 1


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the connections from Linux's /proc/net/tcp")
def test_transfers_to_one_target_reuse_the_sources_connection(a: ServerProcess, b: ServerProcess) -> None:
    with client(a) as ca, client(b) as cb:
        Feed(8).step([ca], ["kept"], 0, 9)
        ca.transfer_kv("kept", b.target, new_seq_id="kept-1")
        first = connections(a.proc.pid, b.port)
        assert len(first) == 1, f"the source holds {len(first)} connections to the target after a transfer"
        ca.transfer_kv("kept", b.target, new_seq_id="kept-2")
        assert connections(a.proc.pid, b.port) == first  # the same connection, not a new one
        assert cb.release(["kept-1", "kept-2"]) == 2
        ca.release(["kept"])


def test_transfer_errors(a: ServerProcess) -> None:
    with client(a) as ca:
        with pytest.raises(ChunkAttnError) as e:
            ca.transfer_kv("nope", "127.0.0.1:1")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        Feed(4).step([ca], ["stay"], 0, 9)
        before = pool(a)
        with pytest.raises(ChunkAttnError) as e:
            ca.transfer_kv("stay", f"127.0.0.1:{free_port()}", release_after=True)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "did not import" in e.value.message
        assert pool(a) == before  # still here: a failed transfer releases nothing
        ca.release(["stay"])


def test_fork_over_rpc_decodes_apart_and_frees_exactly(a: ServerProcess) -> None:
    rng = np.random.default_rng(5)
    ref = ReferenceModel([C, C, C, 0])
    free_before, _ = pool(a)
    with client(a) as ca:

        def call(seq: str, position: int, n: int) -> None:
            for layer in range(4):
                q, k, v = qkv(rng, n)
                entries = [BatchEntry(seq, position, n)]
                assert np.abs(ca.attend(layer, entries, q, k, v) - ref.attend(layer, entries, q, k, v)).max() < 1e-5

        call("parent", 0, 14)
        assert ca.fork("parent", "child") > 0
        ref.fork("parent", "child")
        with pytest.raises(ChunkAttnError) as e:
            ca.fork("parent", "child")
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        for i in range(6):  # 14..19: across the boundary at 16, each with its own tokens
            call("parent", 14 + i, 1)
            call("child", 14 + i, 1)
        ca.release(["parent", "child"])
    assert pool(a)[0] == free_before


def test_the_asyncio_client_forks_exports_imports_and_transfers(a: ServerProcess, b: ServerProcess) -> None:
    import asyncio

    from chunkattn_client import AsyncChunkAttnClient

    with client(a) as ca:
        Feed(6).step([ca], ["aio"], 0, 11)

    async def main() -> None:
        async with AsyncChunkAttnClient(a.target) as xa, AsyncChunkAttnClient(b.target) as xb:
            assert await xa.fork("aio", "aio-fork") > 0
            imported = await xb.import_kv(xa.export_kv("aio-fork"), seq_id="aio-copy")
            assert (imported.seq_id, imported.records > 0) == ("aio-copy", True)
            moved = await xa.transfer_kv("aio", b.target, release_after=True)
            assert moved.released
            assert await xb.release(["aio", "aio-copy"]) == 2
            assert await xa.release(["aio-fork"]) == 1

    asyncio.run(main())


def test_the_kv_command_line(
    a: ServerProcess, b: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from chunkattn_client.cli import main

    with client(a) as ca:
        Feed(7).step([ca], ["cli"], 0, 19)
    path = str(tmp_path / "cli.kv")
    assert main(["kv", "fork", "--target", a.target, "cli", "cli-fork"]) == 0
    assert "blocks shared copy-on-write" in capsys.readouterr().out
    assert main(["kv", "export", "--target", a.target, "cli-fork", "--out", path]) == 0
    assert "exported 'cli-fork'" in capsys.readouterr().out
    assert main(["kv", "import", "--target", b.target, path, "--seq-id", "cli-copy"]) == 0
    assert "imported 'cli-copy'" in capsys.readouterr().out
    assert main(["kv", "transfer", "--target", a.target, "cli", "--to", b.target, "--release"]) == 0
    assert "released at the source" in capsys.readouterr().out
    assert main(["kv", "import", "--target", b.target, path]) == 0  # under the exported id, "cli-fork"
    capsys.readouterr()
    assert main(["kv", "import", "--target", b.target, path]) == 1  # now the id is taken: ALREADY_EXISTS
    assert "ALREADY_EXISTS" in capsys.readouterr().err
    with client(a) as ca, client(b) as cb:
        ca.release(["cli-fork"])
        assert cb.release(["cli", "cli-copy", "cli-fork"]) == 3


def test_an_import_cancelled_mid_stream_returns_every_reserved_block(
    b: ServerProcess, exported: list[pb.KVChunk]
) -> None:
    import threading
    import time

    from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2_grpc as pb_grpc

    free_before, active_before = pool(b)
    release = threading.Event()

    def stalled() -> Iterator[pb.KVChunk]:
        yield from exported[:2]  # the header and some blocks, then nothing
        release.wait(30)

    with grpc.insecure_channel(b.target) as channel:
        call = pb_grpc.ChunkAttnStub(channel).ImportKV.future(stalled())
        deadline = time.monotonic() + 30
        while pool(b)[0] == free_before:  # the header arrived: the import reserved its blocks
            assert time.monotonic() < deadline, "the import never reserved its blocks"
            time.sleep(0.05)
        call.cancel()
        release.set()
    deadline = time.monotonic() + 30
    while pool(b) != (free_before, active_before):
        assert time.monotonic() < deadline, f"blocks not returned: {pool(b)} vs {(free_before, active_before)}"
        time.sleep(0.05)


@pytest.mark.slow  # ~20 s: two servers and two keepalive periods
def test_a_frozen_target_fails_the_transfer_after_an_unanswered_ping_not_at_its_deadline() -> None:
    """A target that stops answering without closing its connection (SIGSTOP: the kernel keeps the TCP
    connection up, nothing answers HTTP/2 pings; as a host cut off or powered off) fails the transfer with
    UNAVAILABLE within two keepalive periods of the source, not at the call's 120 s deadline. The source
    keeps its sequence and its blocks, and transfers again once the target is back."""
    with (
        ServerProcess(*SMALL, "--transfer-keepalive-s", "5") as source,
        ServerProcess(*SMALL) as target,
        ChunkAttnClient(source.target, timeout_s=120) as cs,
    ):
        Feed(9).step([cs], ["frozen"], 0, 9)
        cs.transfer_kv("frozen", target.target, new_seq_id="before")  # the source now holds a channel
        before = pool(source)
        target.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(ChunkAttnError) as e:
                cs.transfer_kv("frozen", target.target, new_seq_id="during")
            took = time.monotonic() - started
        finally:
            target.proc.send_signal(signal.SIGCONT)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
        assert "did not import" in e.value.message
        assert took < 30, f"the source found out after {took:.0f} s (keepalive 5 s)"
        assert pool(source) == before
        cs.transfer_kv("frozen", target.target, new_seq_id="after")  # a fresh channel
        with client(target) as ct:
            assert ct.release(["before", "after"]) == 2
            if ct.info().active_sequences:  # "during" could land once the target resumed; only its answer was lost
                assert ct.release(["during"]) == 1
        cs.release(["frozen"])


def test_a_target_that_refuses_imports_is_never_reported_as_internal() -> None:
    """A full target ends each transfer's stream at its header. gRPC Python's asyncio client sometimes
    reports that as INTERNAL "Internal error from Core" (grpc/grpc#36066); the source says UNAVAILABLE."""
    with ServerProcess(*SMALL, "--num-blocks", "2048") as src, ServerProcess(*SMALL, "--num-blocks", "8") as full:
        with client(src) as c:
            rng = np.random.default_rng(0)
            for layer in range(4):
                q, k, v = qkv(rng, 2000)
                c.attend(layer, [BatchEntry("big", 0, 2000)], q, k, v)
            codes: collections.Counter[grpc.StatusCode] = collections.Counter()
            for _ in range(200):
                with pytest.raises(ChunkAttnError) as err:
                    c.transfer_kv("big", full.target)
                codes[err.value.code] += 1
                if err.value.code == grpc.StatusCode.UNAVAILABLE:
                    assert "grpc/grpc#36066" in err.value.message
        assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}, codes
        assert pool(full)[0] == 8
