"""The block API (OpenBlockSpace, CloseBlockSpace, AttendRequest.blocks) through a real server subprocess, the
real clients, and raw bytes where the client would refuse to send something. The numeric parity in depth is
tests/engine/test_blocks.py's; this file is about the service edge.

Covered:

* end to end: a space opened, a prefill and decodes through attend_blocks unary, the sync stream, the asyncio
  client and the asyncio stream (rows built as vLLM's metadata builder does: tests/helpers/blockspace.py,
  chunked layers windowed to their chunk), every output equal to ReferenceModel's; Info's planes_per_block and
  the caller's block_spaces; close returns the pool blocks; the metrics move (opened, attend calls by mode,
  the block_spaces gauge, kv_blocks_used and the tenant's kv_blocks back where they were); custom layer_planes
  (two planes: fewer pool blocks, layers of different planes kept apart); two tenants' block calls and sequence
  calls at once, each answered as alone; a tenant that gets back blocks another wrote (its space and its
  sequence) reads zeros;
* hostile requests at the edge, on a server with tenants: bytes of the wrong size in every BlockBatch field,
  tables of the wrong size or width, entries and blocks together, bad space ids (empty, 10,000 characters,
  33 characters, not UTF-8, closed, never issued, another tenant's), int32/int64 extremes in every integer
  field, rows and slots outside the space, a bad layer; each gets INVALID_ARGUMENT or NOT_FOUND with a bounded
  message naming the field, and changes nothing: the pool's free blocks, the caller's spaces, and the K/V in
  the space (the bad requests would overwrite a live sequence's keys; a later decode reads them); a self-check
  shows that the unbroken request does change them; int64 min slots are padding (served, nothing written);
* OpenBlockSpace's bad sizes and layer_planes (INVALID_ARGUMENT), a space past the free pool, past the
  tenant's max_kv_blocks quota, and a tenant's 65th space (RESOURCE_EXHAUSTED, nothing taken);
  CloseBlockSpace of an unknown id (NOT_FOUND, never another tenant's); a request of no tokens
  (INVALID_ARGUMENT);
* AttendStream: a bad block request is answered with its status in its response (raw, sync and asyncio
  streams) and the stream goes on serving;
* a client that vanishes (killed, or its channel closed) without closing its space: the space is evicted
  after --idle-timeout-s (gauge, evicted counter, free blocks), a space in use is not, and the server serves on;
* a server asked to drain with a space open refuses the block RPCs with UNAVAILABLE and exits cleanly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from chunkattn_client import (
    AsyncChunkAttnClient,
    BatchEntry,
    BlockRows,
    BlockSpace,
    ChunkAttnClient,
    ChunkAttnError,
    ReferenceModel,
    codec,
    wire,
)
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import MAX_MESSAGE_CHARS
from chunkattn_client.reference import chunked_attention, within_tolerance
from chunkattn_server.service.auth import token_digest
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.rawrpc import BIG, SERVICE, Answer, Watch
from tests.helpers.server_process import SMALL, ServerProcess, counter

H, HKV, D, BS = 4, 2, 16, 4
CHUNKS = [16, 16, 16, 0]  # SMALL's layers
GLOBAL = 3
POOL = 512
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
I32, I64 = np.iinfo(np.int32), np.iinfo(np.int64)
TENANTS = ("e2e", "a", "b", "many", "quota")
TOKENS = {name: f"block-api-token-of-{name}-0123456789" for name in TENANTS}
QUOTA_BLOCKS = 8


# -- servers and callers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Tenants, each with its token; "quota" may hold QUOTA_BLOCKS pool blocks."""
    spec: dict[str, dict[str, Any]] = {name: {"tokens_sha256": [token_digest(TOKENS[name])]} for name in TENANTS}
    spec["quota"]["max_kv_blocks"] = QUOTA_BLOCKS
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    path.write_text(json.dumps({"tenants": spec}))
    path.chmod(0o600)
    with ServerProcess(*SMALL, "--num-blocks", str(POOL), "--idle-timeout-s", "0", "--auth-tokens", str(path)) as s:
        yield s


def client(server: ServerProcess, tenant: str) -> ChunkAttnClient:
    return ChunkAttnClient(server.target, token=TOKENS[tenant], timeout_s=30)


class Caller:
    """Raw bytes to the server's methods under a tenant's token: what a client that is not ours can send."""

    def __init__(self, target: str, tenant: str) -> None:
        self.channel = grpc.insecure_channel(target, options=BIG)
        self.metadata = (("authorization", f"Bearer {TOKENS[tenant]}"),)

    def close(self) -> None:
        self.channel.close()

    def call(self, method: str, data: bytes) -> Answer:
        try:
            unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(SERVICE + method)
            return Answer(grpc.StatusCode.OK, data=unary(data, metadata=self.metadata, timeout=30))
        except grpc.RpcError as e:
            return Answer(e.code(), e.details() or "")

    def stream(self, messages: list[bytes]) -> list[pb.AttendResponse]:
        """AttendStream: every answer (the stream must end OK)."""
        bidi: grpc.StreamStreamMultiCallable[bytes, bytes] = self.channel.stream_stream(SERVICE + "AttendStream")
        return [pb.AttendResponse.FromString(a) for a in bidi(iter(messages), metadata=self.metadata, timeout=30)]

    def info(self) -> pb.InfoResponse:
        answer = self.call("Info", b"")
        assert answer.code == grpc.StatusCode.OK, answer
        return pb.InfoResponse.FromString(answer.data)


@contextlib.contextmanager
def caller(server: ServerProcess, tenant: str) -> Iterator[Caller]:
    c = Caller(server.target, tenant)
    try:
        yield c
    finally:
        c.close()


def refused(answer: Answer, code: grpc.StatusCode, *words: str) -> None:
    assert answer.code == code, answer
    for w in words:
        assert w in answer.details, answer
    assert len(answer.details) <= MAX_MESSAGE_CHARS, answer


def wait_for(what: Callable[[], bool], timeout_s: float = 15.0, message: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, message or "timed out"
        time.sleep(0.05)


def gauge(server: ServerProcess, name: str) -> float:
    return counter(server.metrics(), name)


# -- requests -----------------------------------------------------------------------------------------------


def qkv(rng: np.random.Generator, n: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        (rng.standard_normal((n, H, D)) * scale).astype(np.float32),
        (rng.standard_normal((n, HKV, D)) * scale).astype(np.float32),
        (rng.standard_normal((n, HKV, D)) * scale).astype(np.float32),
    )


def rows_of(kv: KVCacheManager, space_id: str, entries: list[tuple[str, int, int]], layer: int) -> BlockRows:
    """The rows vLLM's metadata builder gives a scheduled step of ``layer`` (virtual batches for a chunked one)."""
    none = torch.empty(0)
    call = kv.call(space_id, "", entries, CHUNKS[layer], none, none, none)
    return BlockRows(space_id, call.slots, call.starts, call.seq_lens, call.tables)


def batch(rows: BlockRows) -> pb.BlockBatch:
    """The BlockBatch of ``rows``, built here from the proto's words (not by the client)."""
    table = np.asarray(rows.block_table)
    return pb.BlockBatch(
        space_id=rows.space_id,
        slot_mapping=np.asarray(rows.slot_mapping, "<i8").tobytes(),
        query_start_loc=np.asarray(rows.query_start_loc, "<i4").tobytes(),
        seq_lens=np.asarray(rows.seq_lens, "<i4").tobytes(),
        block_table=table.astype("<i4").tobytes(),
        block_table_width=table.shape[1],
    )


def encode(
    layer: int,
    blocks: pb.BlockBatch | None,
    q: np.ndarray,
    k: np.ndarray | None,
    v: np.ndarray | None,
    *,
    request_id: int = 0,
) -> bytes:
    raw = [None if x is None else codec.to_raw(x) for x in (k, v)]
    return wire.encode_attend_request(layer, [], codec.to_raw(q), raw[0], raw[1], request_id, blocks)


def output_of(data: bytes) -> np.ndarray:
    out = pb.AttendResponse.FromString(data).output
    return np.frombuffer(out.data, np.float32).reshape(tuple(out.shape))


def close_enough(out: np.ndarray, expected: np.ndarray) -> float:
    ok, err = within_tolerance(out, expected, "float32")
    assert ok, f"error {err:.3g}"
    return err


# -- 1. end to end --------------------------------------------------------------------------------------------

# Two sequences, then a third: prefills across the chunk boundary (16), decodes, a mixed step.
STEPS: list[list[tuple[str, int, int]]] = [
    [("a", 0, 19), ("b", 0, 5)],
    [("a", 19, 1), ("b", 5, 12)],
    [("a", 20, 1), ("b", 17, 1)],
    [("a", 21, 1), ("b", 18, 1), ("c", 0, 3)],
]
SPACE = 16  # blocks: a 22, b 19, c 3 tokens = 6 + 5 + 1 blocks of 4


def test_end_to_end_unary_streams_and_asyncio_match_the_reference(server: ServerProcess) -> None:
    rng = np.random.default_rng(1)
    before = server.metrics()
    with client(server, "e2e") as c:
        info = c.info()
        assert (info.planes_per_block, info.block_spaces, info.block_size) == (1, 0, BS)
        free = info.free_blocks
        space = c.open_block_space(SPACE)
        assert (space.num_blocks, space.block_size, space.num_planes) == (SPACE, BS, 4)
        assert len(space.space_id) == 32
        int(space.space_id, 16)
        assert space.pool_blocks == SPACE * 4  # one plane per layer, one plane per pool block
        info = c.info()
        assert (info.block_spaces, info.free_blocks) == (1, free - space.pool_blocks)
        with client(server, "a") as other:
            assert other.info().block_spaces == 0  # Info counts the caller's spaces only
        opened = server.metrics()
        assert counter(opened, "chunkattn_block_spaces_opened_total") == 1 + counter(
            before, "chunkattn_block_spaces_opened_total"
        )
        assert gauge(server, "chunkattn_block_spaces") == 1 + counter(before, "chunkattn_block_spaces")
        used = counter(before, "chunkattn_kv_blocks_used")
        assert counter(opened, "chunkattn_kv_blocks_used") == used + space.pool_blocks
        assert counter(opened, "chunkattn_tenant_kv_blocks", tenant="e2e") == space.pool_blocks

        ref = ReferenceModel.for_server(info)
        kv = KVCacheManager(SPACE, BS, seed=3)

        def step(
            entries: list[tuple[str, int, int]], layer: int
        ) -> tuple[BlockRows, np.ndarray, np.ndarray, np.ndarray]:
            q, k, v = qkv(rng, sum(n for _, _, n in entries))
            return rows_of(kv, space.space_id, entries, layer), q, k, v

        def expect(entries: list[tuple[str, int, int]], layer: int, out: Any, q: Any, k: Any, v: Any) -> None:
            assert out.shape == q.shape
            close_enough(out, ref.attend(layer, [BatchEntry(*e) for e in entries], q, k, v))

        # The prefill, unary.
        kv.schedule(STEPS[0])
        for layer in range(4):
            rows, q, k, v = step(STEPS[0], layer)
            expect(STEPS[0], layer, c.attend_blocks(layer, rows, q, k, v), q, k, v)
        # A step over the sync stream.
        kv.schedule(STEPS[1])
        with c.stream() as stream:
            for layer in range(4):
                rows, q, k, v = step(STEPS[1], layer)
                expect(STEPS[1], layer, stream.attend_blocks(layer, rows, q, k, v), q, k, v)

        # One over the asyncio client, one over its stream.
        async def aio() -> None:
            async with AsyncChunkAttnClient(server.target, token=TOKENS["e2e"], timeout_s=30) as ac:
                kv.schedule(STEPS[2])
                for layer in range(4):
                    rows, q, k, v = step(STEPS[2], layer)
                    expect(STEPS[2], layer, await ac.attend_blocks(layer, rows, q, k, v), q, k, v)
                kv.schedule(STEPS[3])
                async with ac.stream() as astream:
                    for layer in range(4):
                        rows, q, k, v = step(STEPS[3], layer)
                        expect(STEPS[3], layer, await astream.attend_blocks(layer, rows, q, k, v), q, k, v)
                assert (await ac.info()).block_spaces == 1

        asyncio.run(aio())
        calls = len(STEPS) * 4
        wait_for(
            lambda: (
                counter(server.metrics(), "chunkattn_attend_calls_total", mode="blocks")
                == calls + counter(before, "chunkattn_attend_calls_total", mode="blocks")
            ),
            message="chunkattn_attend_calls_total{mode=blocks} did not count every call",
        )
        after = server.metrics()
        assert counter(after, "chunkattn_attend_calls_total", mode="sequence") == counter(
            before, "chunkattn_attend_calls_total", mode="sequence"
        )

        assert c.close_block_space(space.space_id) == space.pool_blocks
        info = c.info()
        assert (info.block_spaces, info.free_blocks, info.active_sequences) == (0, free, 0)
        closed = server.metrics()
        assert counter(closed, "chunkattn_block_spaces") == counter(before, "chunkattn_block_spaces")
        assert counter(closed, "chunkattn_kv_blocks_used") == used
        assert counter(closed, "chunkattn_tenant_kv_blocks", tenant="e2e") == 0
        with pytest.raises(ChunkAttnError) as e:
            c.close_block_space(space.space_id)
        assert e.value.code == NOT_FOUND


def test_layer_planes_share_a_pool_block_and_the_space_costs_fewer(server: ServerProcess) -> None:
    """vLLM's hybrid layout: the three chunked layers in one plane, the global one in another; the space costs
    2 pool blocks per block, and a layer of one plane does not read what a layer of the other wrote at the same
    slots."""
    rng = np.random.default_rng(2)
    with client(server, "e2e") as c:
        free = c.info().free_blocks
        space = c.open_block_space(4, layer_planes=[0, 0, 0, 1])
        assert (space.num_planes, space.pool_blocks) == (2, 8)
        assert c.info().free_blocks == free - 8
        ref = ReferenceModel.for_server(c.info())
        kv = KVCacheManager(4, BS)
        for entries in ([("s", 0, 6)], [("s", 6, 1)]):  # the decode reads the prefill's keys from the space
            kv.schedule(entries)
            for layer in (0, GLOBAL):  # layers of different planes, the same slots
                q, k, v = qkv(rng, entries[0][2])
                out = c.attend_blocks(layer, rows_of(kv, space.space_id, entries, layer), q, k, v)
                close_enough(out, ref.attend(layer, [BatchEntry(*entries[0])], q, k, v))
        assert c.close_block_space(space.space_id) == 8
        assert c.info().free_blocks == free


def test_block_calls_of_two_tenants_and_sequence_calls_at_once_are_each_served_as_alone(server: ServerProcess) -> None:
    """Three clients at once on one layer after another: two tenants' spaces (block calls of one layer may share
    a step) and the sequence API (never in a step with block calls); every answer is its reference's."""
    errors: list[BaseException] = []

    def blocks(tenant: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with client(server, tenant) as c:
            space = c.open_block_space(8)
            ref = ReferenceModel.for_server(c.info())
            kv = KVCacheManager(8, BS, seed=seed)
            for entries in [[("s", 0, 10)], *[[("s", 10 + i, 1)] for i in range(12)]]:
                kv.schedule(entries)
                for layer in range(4):
                    q, k, v = qkv(rng, entries[0][2])
                    out = c.attend_blocks(layer, rows_of(kv, space.space_id, entries, layer), q, k, v)
                    close_enough(out, ref.attend(layer, [BatchEntry(*entries[0])], q, k, v))
            c.close_block_space(space.space_id)

    def sequences() -> None:
        rng = np.random.default_rng(0)
        with client(server, "e2e") as c:
            ref = ReferenceModel.for_server(c.info())
            for entry in [BatchEntry("s", 0, 10), *[BatchEntry("s", 10 + i, 1) for i in range(12)]]:
                for layer in range(4):
                    q, k, v = qkv(rng, entry.num_tokens)
                    close_enough(c.attend(layer, [entry], q, k, v), ref.attend(layer, [entry], q, k, v))
            c.release(["s"])

    def run(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:
            errors.append(e)

    with caller(server, "a") as raw:
        free = raw.info().free_blocks
        threads = [
            threading.Thread(target=run, args=(blocks, "a", 1)),
            threading.Thread(target=run, args=(blocks, "b", 2)),
            threading.Thread(target=run, args=(sequences,)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client got no answer"
        assert not errors, errors
        assert raw.info().free_blocks == free


# -- 2. hostile requests ----------------------------------------------------------------------------------------

PREFILL = 19  # tokens of sequence "a" in the hostile tests' space, every layer
HOSTILE_SPACE = 8


@dataclass
class Live:
    """A space of tenant "a" holding sequence "a" (PREFILL tokens, every layer), and what it should hold."""

    server: ServerProcess
    c: ChunkAttnClient
    raw: Caller
    space_id: str
    kv: KVCacheManager
    ref: ReferenceModel
    length: int = PREFILL

    def base(self) -> tuple[pb.BlockBatch, np.ndarray, np.ndarray, np.ndarray]:
        """A valid request that rewrites "a"'s first 4 keys in the global layer with other values (a hostile
        case breaks one of its fields: whatever of it the server wrote would show in ``decode_error``)."""
        table = self.kv.tables[0, "a"]
        slots = [self.kv.slot("a", p) for p in range(4)]
        rows = BlockRows(self.space_id, slots, [0, 4], [4], [[table[0]]])
        q, k, v = qkv(np.random.default_rng(99), 4, scale=10.0)
        return batch(rows), q, k, v

    def decode_error(self) -> float:
        """A decode step of "a" in every layer (a write: the reference follows): its largest error."""
        rng = np.random.default_rng(self.length)
        entries = [("a", self.length, 1)]
        self.kv.schedule(entries)
        worst = 0.0
        for layer in range(4):
            q, k, v = qkv(rng, 1)
            out = self.c.attend_blocks(layer, rows_of(self.kv, self.space_id, entries, layer), q, k, v)
            expected = self.ref.attend(layer, [BatchEntry("a", self.length, 1)], q, k, v)
            worst = max(worst, within_tolerance(out, expected, "float32")[1])
        self.length += 1
        return worst

    def unchanged(self, free: int) -> None:
        info = self.raw.info()
        assert (info.free_blocks, info.block_spaces) == (free, 1)
        assert self.decode_error() <= 1e-5, "the space's K/V changed"


@pytest.fixture
def live(server: ServerProcess) -> Iterator[Live]:
    rng = np.random.default_rng(5)
    with client(server, "a") as c, caller(server, "a") as raw:
        space = c.open_block_space(HOSTILE_SPACE)
        kv = KVCacheManager(HOSTILE_SPACE, BS, seed=7)
        ref = ReferenceModel.for_server(c.info())
        entries = [("a", 0, PREFILL)]
        kv.schedule(entries)
        for layer in range(4):
            q, k, v = qkv(rng, PREFILL)
            c.attend_blocks(layer, rows_of(kv, space.space_id, entries, layer), q, k, v)
            ref.attend(layer, [BatchEntry(*entries[0])], q, k, v)
        yield Live(server, c, raw, space.space_id, kv, ref)
        with contextlib.suppress(ChunkAttnError):
            c.close_block_space(space.space_id)


def test_the_hostile_tests_see_a_write_into_the_space(live: Live) -> None:
    """Self-check: the hostile cases' base request, unbroken, is served and changes "a"'s keys."""
    free = live.raw.info().free_blocks
    blocks, q, k, v = live.base()
    answer = live.raw.call("Attend", encode(GLOBAL, blocks, q, k, v))
    assert answer.code == grpc.StatusCode.OK, answer
    assert live.raw.info().free_blocks == free
    assert live.decode_error() > 1e-3


Mutation = Callable[[pb.AttendRequest, Live], None]


def _set(**fields: Any) -> Mutation:
    def mutate(r: pb.AttendRequest, live: Live) -> None:
        for name, value in fields.items():
            setattr(r.blocks, name, value)

    return mutate


def _i32(*values: int) -> bytes:
    return np.array(values, "<i4").tobytes()


def _i64(*values: int) -> bytes:
    return np.array(values, "<i8").tobytes()


def _with_entries(r: pb.AttendRequest, live: Live) -> None:
    r.entries.append(pb.SequenceEntry(seq_id="a", position=live.length, num_tokens=4))


def _closed_space(r: pb.AttendRequest, live: Live) -> None:
    other = live.c.open_block_space(1)
    assert live.c.close_block_space(other.space_id) == 4
    r.blocks.space_id = other.space_id


# name: (mutation, status, words its message must hold)
HOSTILE: dict[str, tuple[Mutation, grpc.StatusCode, tuple[str, ...]]] = {
    "slot_mapping of 7 bytes per token": (
        lambda r, live: setattr(r.blocks, "slot_mapping", r.blocks.slot_mapping[:-1]),
        INVALID,
        ("blocks.slot_mapping", "8-byte"),
    ),
    "slot_mapping of 4-byte integers": (
        lambda r, live: setattr(
            r.blocks, "slot_mapping", np.frombuffer(r.blocks.slot_mapping, "<i8").astype("<i4").tobytes() + b"\0"
        ),
        INVALID,
        ("blocks.slot_mapping",),
    ),
    "query_start_loc not a multiple of 4": (
        _set(query_start_loc=_i32(0, 4) + b"\0"),
        INVALID,
        ("blocks.query_start_loc", "4-byte"),
    ),
    "seq_lens not a multiple of 4": (_set(seq_lens=_i32(4)[:3]), INVALID, ("blocks.seq_lens", "4-byte")),
    "block_table not a multiple of 4": (_set(block_table=b"\0\0\0\0\0"), INVALID, ("blocks.block_table", "4-byte")),
    "block_table entries != rows x width": (
        _set(block_table_width=2),
        INVALID,
        ("blocks.block_table", "block_table_width (2)"),
    ),
    "block_table_width int32 max": (_set(block_table_width=int(I32.max)), INVALID, ("block_table_width",)),
    "block_table_width -1": (_set(block_table_width=-1), INVALID, ("block_table_width (-1)",)),
    "block_table_width int32 min, table empty": (
        _set(block_table_width=int(I32.min), block_table=b""),
        INVALID,
        ("block_table_width",),
    ),
    "entries and blocks": (_with_entries, INVALID, ("entries and blocks",)),
    "empty space_id": (_set(space_id=""), INVALID, ("blocks.space_id", "0 characters")),
    "10,000-character space_id": (_set(space_id="f" * 10_000), INVALID, ("blocks.space_id", "10000 characters")),
    "33-character space_id": (
        lambda r, live: setattr(r.blocks, "space_id", live.space_id + "0"),
        INVALID,
        ("blocks.space_id",),
    ),
    "a space id never issued": (_set(space_id="0" * 32), NOT_FOUND, ("block space", "does not exist")),
    "a space id not of hex digits": (_set(space_id="x" * 32), NOT_FOUND, ("block space",)),
    "a closed space": (_closed_space, NOT_FOUND, ("block space", "does not exist")),
    "no rows": (_set(query_start_loc=_i32(0), seq_lens=b"", block_table=b""), INVALID, ("seq_lens has 0 rows",)),
    "query_start_loc ends at int32 max": (_set(query_start_loc=_i32(0, I32.max)), INVALID, ("query_start_loc",)),
    "query_start_loc starts at int32 min": (_set(query_start_loc=_i32(I32.min, 4)), INVALID, ("query_start_loc",)),
    "query_start_loc jumps to int32 max and back": (
        lambda r, live: _set(
            query_start_loc=_i32(0, I32.max, 4),
            seq_lens=_i32(4, 4),
            block_table=r.blocks.block_table * 2,
        )(r, live),
        INVALID,
        ("query_start_loc[2]", "decreases"),
    ),
    "query_start_loc one entry short": (_set(query_start_loc=_i32(4)), INVALID, ("query_start_loc has 1 entries",)),
    "seq_lens int32 max": (_set(seq_lens=_i32(I32.max)), INVALID, ("seq_lens[0]",)),
    "seq_lens int32 min": (_set(seq_lens=_i32(I32.min)), INVALID, ("seq_lens[0]", "less than its row's q_len")),
    "seq_lens past the table": (_set(seq_lens=_i32(5)), INVALID, ("seq_lens[0]", "block_table_width (1)")),
    "block_table entry past the space": (
        _set(block_table=_i32(HOSTILE_SPACE)),
        INVALID,
        ("block_table row 0 entry 0",),
    ),
    "block_table entry int32 max": (_set(block_table=_i32(I32.max)), INVALID, ("block_table row 0 entry 0",)),
    "block_table entry int32 min": (_set(block_table=_i32(I32.min)), INVALID, ("block_table row 0 entry 0",)),
    "slot_mapping int64 max": (
        lambda r, live: setattr(r.blocks, "slot_mapping", r.blocks.slot_mapping[:-8] + _i64(I64.max)),
        INVALID,
        ("slot_mapping[3]", "past the space's last slot"),
    ),
    "slot_mapping past the space": (
        lambda r, live: setattr(r.blocks, "slot_mapping", _i64(0, 1, 2, HOSTILE_SPACE * BS)),
        INVALID,
        ("slot_mapping[3]",),
    ),
    "slot_mapping one short": (
        lambda r, live: setattr(r.blocks, "slot_mapping", r.blocks.slot_mapping[:-8]),
        INVALID,
        ("slot_mapping has 3 entries",),
    ),
    "a layer past the model's": (lambda r, live: setattr(r, "layer", 4), INVALID, ("layer",)),
    "a negative layer": (lambda r, live: setattr(r, "layer", -1), INVALID, ("layer",)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_bad_block_request_is_refused_naming_the_field_and_changes_nothing(live: Live, case: str) -> None:
    mutate, code, words = HOSTILE[case]
    blocks, q, k, v = live.base()
    request = pb.AttendRequest.FromString(encode(GLOBAL, blocks, q, k, v))
    mutate(request, live)
    served = counter(live.server.metrics(), "chunkattn_attend_calls_total", mode="blocks")
    free = live.raw.info().free_blocks
    refused(live.raw.call("Attend", request.SerializeToString()), code, *words)
    live.unchanged(free)
    # Only the 4 calls of the check's decode were served.
    wait_for(lambda: counter(live.server.metrics(), "chunkattn_attend_calls_total", mode="blocks") >= served + 4)
    assert counter(live.server.metrics(), "chunkattn_attend_calls_total", mode="blocks") == served + 4


def test_a_space_id_that_is_not_utf8_is_invalid_argument(live: Live) -> None:
    blocks, q, k, v = live.base()
    blocks.ClearField("space_id")
    data = encode(GLOBAL, blocks, q, k, v) + bytes([7 << 3 | 2, 3, 1 << 3 | 2, 1, 0xFF])  # blocks.space_id = b"\xff"
    free = live.raw.info().free_blocks
    refused(live.raw.call("Attend", data), INVALID, "not a valid chunkattn.v1.AttendRequest")
    live.unchanged(free)


def test_the_client_refuses_what_the_wire_cannot_hold(live: Live) -> None:
    """Values past int32 in an int32 field, and a table that is not 2-D: ValueError before anything is sent."""
    q, k, v = qkv(np.random.default_rng(0), 1)
    free = live.raw.info().free_blocks
    for rows, field in (
        (BlockRows(live.space_id, [0], [0, 2**31], [1], [[0]]), "query_start_loc"),
        (BlockRows(live.space_id, [0], [0, 1], [1], [[2**31]]), "block_table"),
        (BlockRows(live.space_id, [0], [0, 1], [1], [0]), "block_table"),
        (BlockRows(live.space_id, [0.5], [0, 1], [1], [[0]]), "slot_mapping"),
    ):
        with pytest.raises(ValueError, match=field):
            live.c.attend_blocks(GLOBAL, rows, q, k, v)
    live.unchanged(free)


def test_a_block_request_of_no_tokens_is_refused_not_internal(live: Live) -> None:
    """Rows of no new tokens (q_len 0) are allowed; a request of only such rows has q, k, v of 0 tokens: it is
    refused as INVALID_ARGUMENT (never INTERNAL) and changes nothing."""
    free = live.raw.info().free_blocks
    rows = BlockRows(live.space_id, np.zeros(0, np.int64), [0, 0], [0], np.zeros((1, 0), np.int64))
    q, k, v = qkv(np.random.default_rng(0), 0)
    answer = live.raw.call("Attend", encode(GLOBAL, batch(rows), q, k, v))
    assert answer.code == INVALID, answer
    assert "no tokens" in answer.details
    live.unchanged(free)


def test_int64_min_slots_are_padding_answered_and_not_written(live: Live) -> None:
    """A negative slot is a padding token: not written. Even int64 min; its row attends over the call's own k/v."""
    blocks, q, k, v = live.base()
    blocks.slot_mapping = _i64(*[I64.min] * 4)
    free = live.raw.info().free_blocks
    answer = live.raw.call("Attend", encode(GLOBAL, blocks, q, k, v))
    assert answer.code == grpc.StatusCode.OK, answer
    scale = live.ref.scales[GLOBAL]
    close_enough(output_of(answer.data), chunked_attention(q, k, v, np.arange(4), chunk_size=0, scale=scale))
    live.unchanged(free)


def test_another_tenants_space_is_not_found_and_keeps_working(server: ServerProcess, live: Live) -> None:
    blocks, q, k, v = live.base()
    free = live.raw.info().free_blocks
    with caller(server, "b") as b, client(server, "b") as bc:
        refused(b.call("Attend", encode(GLOBAL, blocks, q, k, v)), NOT_FOUND, "block space", "does not exist")
        [streamed] = b.stream([encode(GLOBAL, blocks, q, k, v, request_id=3)])
        assert (streamed.request_id, streamed.status.code) == (3, NOT_FOUND.value[0]), streamed
        assert not streamed.HasField("output")
        refused(
            b.call("CloseBlockSpace", pb.CloseBlockSpaceRequest(space_id=live.space_id).SerializeToString()),
            NOT_FOUND,
            "block space",
        )
        assert bc.info().block_spaces == 0
        # b's own space of the same size is its own: a's keys are not in it.
        own = bc.open_block_space(HOSTILE_SPACE)
        assert own.space_id != live.space_id
        blocks.space_id = own.space_id
        blocks.slot_mapping = _i64(-1, -1, -1, -1)
        blocks.seq_lens = _i32(8)
        blocks.query_start_loc = _i32(0, 4)
        blocks.block_table = _i32(*live.kv.tables[0, "a"][:2])
        blocks.block_table_width = 2
        answer = b.call("Attend", encode(GLOBAL, blocks, q, k, v))
        assert answer.code == grpc.StatusCode.OK, answer
        zeros = np.zeros((4, HKV, D), np.float32)  # a fresh space's blocks are zero: the keys before are zeros
        expected = chunked_attention(
            q, np.concatenate([zeros, k]), np.concatenate([zeros, v]), np.arange(4, 8), chunk_size=0, scale=0.25
        )
        close_enough(output_of(answer.data), expected)
        assert bc.close_block_space(own.space_id) == HOSTILE_SPACE * 4
    live.unchanged(free)


def test_a_tenant_never_reads_what_another_wrote_in_blocks_it_gets_back(server: ServerProcess) -> None:
    """Tenant a fills a space and a sequence with large K/V and gives them back; tenant b opens a space of every
    free pool block (one plane: each of them read through it) and reads them all: zeros, none of a's K/V."""
    rng = np.random.default_rng(12)
    with client(server, "a") as a, client(server, "b") as b:
        space = a.open_block_space(16)
        n = 16 * BS
        slots = np.arange(n)
        q, k, v = qkv(rng, n, scale=30.0)
        for layer in range(4):
            a.attend_blocks(layer, BlockRows(space.space_id, slots, [0, n], [n], [np.arange(16)]), q, k, v)
        a.attend(GLOBAL, [BatchEntry("seq", 0, n)], q, k, v, end_of_sequence=["seq"])
        assert a.close_block_space(space.space_id) == space.pool_blocks

        free = b.info().free_blocks
        whole = b.open_block_space(free, layer_planes=[0, 0, 0, 0])
        assert (whole.pool_blocks, b.info().free_blocks) == (free, 0)
        keys = free * BS  # every slot's key but the last, which is the request's own (not written: slot -1)
        q, k, v = qkv(rng, 1)
        out = b.attend_blocks(GLOBAL, BlockRows(whole.space_id, [-1], [0, 1], [keys], [np.arange(free)]), q, k, v)
        zeros = np.zeros((keys - 1, HKV, D), np.float32)
        expected = chunked_attention(
            q, np.concatenate([zeros, k]), np.concatenate([zeros, v]), [keys - 1], chunk_size=0, scale=0.25
        )
        close_enough(out, expected)
        assert b.close_block_space(whole.space_id) == free


def test_attend_stream_answers_a_bad_block_request_with_its_status_and_goes_on(
    server: ServerProcess, live: Live
) -> None:
    blocks, q, k, v = live.base()
    bad = []
    for mutate in (
        _set(slot_mapping=b"\1" * 9),
        _set(space_id=""),
        _set(space_id="0" * 32),
        _set(block_table=_i32(-1)),
    ):
        r = pb.AttendRequest.FromString(encode(GLOBAL, blocks, q, k, v))
        mutate(r, live)
        bad.append(r)
    # A read-only row between them (slots -1): "a"'s keys, then the request's own.
    probe = BlockRows(live.space_id, [-1], [0, 1], [live.length + 1], [live.kv.tables[0, "a"]])
    pq, pk, pv = qkv(np.random.default_rng(8), 1)
    expected = copy.deepcopy(live.ref).attend(GLOBAL, [BatchEntry("a", live.length, 1)], pq, pk, pv)
    messages = []
    for i, r in enumerate(bad):
        r.request_id = 10 + i
        messages += [r.SerializeToString(), encode(GLOBAL, batch(probe), pq, pk, pv, request_id=20 + i)]
    free = live.raw.info().free_blocks
    answers = live.raw.stream(messages)
    assert [a.request_id for a in answers] == [10, 20, 11, 21, 12, 22, 13, 23]
    codes = [a.status.code for a in answers[::2]]
    assert codes == [INVALID.value[0], INVALID.value[0], NOT_FOUND.value[0], INVALID.value[0]], answers[::2]
    for a, field in zip(answers[::2], ("slot_mapping", "space_id", "block space", "block_table"), strict=True):
        assert field in a.status.message, a
        assert not a.HasField("output"), a
    for a in answers[1::2]:
        assert a.status.code == 0, a
        close_enough(np.frombuffer(a.output.data, np.float32).reshape(pq.shape), expected)
    live.unchanged(free)

    # The sync and asyncio streams: a ChunkAttnError for the bad call, then the stream serves on.
    closed = BlockRows("0" * 32, [0], [0, 1], [1], [[0]])
    outside = BlockRows(live.space_id, [0], [0, 1], [1], [[HOSTILE_SPACE]])
    with live.c.stream() as stream:
        for rows, code in ((closed, NOT_FOUND), (outside, INVALID)):
            with pytest.raises(ChunkAttnError) as e:
                stream.attend_blocks(GLOBAL, rows, pq, pk, pv)
            assert e.value.code == code
            close_enough(stream.attend_blocks(GLOBAL, probe, pq, pk, pv), expected)

    async def aio() -> None:
        async with (
            AsyncChunkAttnClient(server.target, token=TOKENS["a"], timeout_s=30) as ac,
            ac.stream() as astream,
        ):
            for rows, code in ((closed, NOT_FOUND), (outside, INVALID)):
                with pytest.raises(ChunkAttnError) as e:
                    await astream.attend_blocks(GLOBAL, rows, pq, pk, pv)
                assert e.value.code == code
                close_enough(await astream.attend_blocks(GLOBAL, probe, pq, pk, pv), expected)

    asyncio.run(aio())
    live.unchanged(free)


OPEN: dict[str, tuple[pb.OpenBlockSpaceRequest, grpc.StatusCode, tuple[str, ...]]] = {
    "num_blocks 0": (pb.OpenBlockSpaceRequest(num_blocks=0), INVALID, ("num_blocks is 0",)),
    "num_blocks -1": (pb.OpenBlockSpaceRequest(num_blocks=-1), INVALID, ("num_blocks is -1",)),
    "num_blocks int64 min": (pb.OpenBlockSpaceRequest(num_blocks=int(I64.min)), INVALID, ("num_blocks",)),
    "num_blocks 2^62": (pb.OpenBlockSpaceRequest(num_blocks=2**62), INVALID, ("num_blocks", str(2**62))),
    "num_blocks int64 max": (pb.OpenBlockSpaceRequest(num_blocks=int(I64.max)), INVALID, ("num_blocks",)),
    "num_blocks past the pool": (
        pb.OpenBlockSpaceRequest(num_blocks=POOL + 1),
        INVALID,
        ("num_blocks", f"1 .. {POOL}"),
    ),
    "num_blocks past the free pool": (
        pb.OpenBlockSpaceRequest(num_blocks=POOL // 2),
        EXHAUSTED,
        ("needs", "pool blocks", "free"),
    ),
    "layer_planes too short": (
        pb.OpenBlockSpaceRequest(num_blocks=1, layer_planes=[0, 1]),
        INVALID,
        ("layer_planes has 2 entries",),
    ),
    "layer_planes too long": (
        pb.OpenBlockSpaceRequest(num_blocks=1, layer_planes=[0] * 5000),
        INVALID,
        ("layer_planes has 5000",),
    ),
    "layer_planes past the layers": (
        pb.OpenBlockSpaceRequest(num_blocks=1, layer_planes=[0, 1, 2, 4]),
        INVALID,
        ("layer_planes[3] is 4",),
    ),
    "layer_planes negative": (
        pb.OpenBlockSpaceRequest(num_blocks=1, layer_planes=[-1, 0, 0, 0]),
        INVALID,
        ("layer_planes[0] is -1",),
    ),
    "layer_planes int32 extremes": (
        pb.OpenBlockSpaceRequest(num_blocks=1, layer_planes=[0, int(I32.max), int(I32.min), 0]),
        INVALID,
        ("layer_planes[1]",),
    ),
}


@pytest.mark.parametrize("case", list(OPEN))
def test_a_bad_open_block_space_is_refused_and_takes_nothing(server: ServerProcess, case: str) -> None:
    request, code, words = OPEN[case]
    with caller(server, "a") as raw:
        before = raw.info()
        refused(raw.call("OpenBlockSpace", request.SerializeToString()), code, *words)
        after = raw.info()
        assert (after.free_blocks, after.block_spaces) == (before.free_blocks, before.block_spaces)


def test_close_block_space_of_bad_ids_is_not_found_with_a_bounded_message(server: ServerProcess) -> None:
    with caller(server, "a") as raw:
        free = raw.info().free_blocks
        for space_id in ("", "0" * 32, "f" * 10_000, "é" * 5000):
            answer = raw.call("CloseBlockSpace", pb.CloseBlockSpaceRequest(space_id=space_id).SerializeToString())
            refused(answer, NOT_FOUND, "does not exist")
        assert raw.info().free_blocks == free


def test_a_tenants_65th_space_is_refused_and_closing_one_makes_room(server: ServerProcess) -> None:
    with client(server, "many") as c, client(server, "a") as a:
        free = c.info().free_blocks
        tiny = [0, 0, 0, 0]  # one plane: one pool block per space
        spaces = [c.open_block_space(1, layer_planes=tiny) for _ in range(64)]
        assert len({s.space_id for s in spaces}) == 64
        assert c.info().free_blocks == free - 64
        with pytest.raises(ChunkAttnError) as e:
            c.open_block_space(1, layer_planes=tiny)
        assert e.value.code == EXHAUSTED
        assert "64 block spaces" in e.value.message
        assert (c.info().free_blocks, c.info().block_spaces) == (free - 64, 64)
        other = a.open_block_space(1, layer_planes=tiny)  # the limit is per tenant
        assert a.close_block_space(other.space_id) == 1
        assert c.close_block_space(spaces.pop().space_id) == 1
        spaces.append(c.open_block_space(1, layer_planes=tiny))
        for s in spaces:
            assert c.close_block_space(s.space_id) == 1
        assert (c.info().free_blocks, c.info().block_spaces) == (free, 0)


def test_a_space_past_the_tenants_quota_is_refused_naming_it(server: ServerProcess) -> None:
    with client(server, "quota") as c:
        free = c.info().free_blocks
        first = c.open_block_space(QUOTA_BLOCKS // 4)  # 4 planes: the whole quota
        with pytest.raises(ChunkAttnError) as e:
            c.open_block_space(1, layer_planes=[0, 0, 0, 0])
        assert e.value.code == EXHAUSTED
        assert "max_kv_blocks" in e.value.message
        assert (c.info().free_blocks, c.info().block_spaces) == (free - QUOTA_BLOCKS, 1)
        assert c.close_block_space(first.space_id) == QUOTA_BLOCKS
        second = c.open_block_space(1, layer_planes=[0, 0, 0, 0])
        assert c.close_block_space(second.space_id) == 1
        assert c.info().free_blocks == free


# -- 3. a client that vanishes ----------------------------------------------------------------------------------

VANISHING = """
import sys, time
import numpy as np
from chunkattn_client import BlockRows, ChunkAttnClient
c = ChunkAttnClient(sys.argv[1], timeout_s=30)
s = c.open_block_space(3)
stream = c.stream()
x = np.ones((2, 4, 16), np.float32)
kv = np.ones((2, 2, 16), np.float32)
stream.attend_blocks(0, BlockRows(s.space_id, [0, 1], [0, 2], [2], [[0]]), x, kv, kv)
print(s.space_id, flush=True)
time.sleep(600)
"""


def test_a_vanished_clients_space_is_evicted_when_idle_and_a_used_one_is_not() -> None:
    rng = np.random.default_rng(4)
    with (
        ServerProcess(*SMALL, "--num-blocks", "64", "--idle-timeout-s", "1") as s,
        ChunkAttnClient(s.target, timeout_s=30) as c,
    ):
        kept = c.open_block_space(2)

        def use_kept() -> float:
            """A call to the kept space (rewrites its slot 0, reads it back); its error."""
            q, k, v = qkv(rng, 1)
            out = c.attend_blocks(GLOBAL, BlockRows(kept.space_id, [0], [0, 1], [1], [[0]]), q, k, v)
            return within_tolerance(out, chunked_attention(q, k, v, [0], chunk_size=0, scale=0.25), "float32")[1]

        def try_kept() -> float | ChunkAttnError:
            try:
                return use_kept()
            except ChunkAttnError as e:
                return e

        # The kept space is used every 0.1 s from now on; two others are left idle by clients that vanish.
        with Watch(try_kept, pause_s=0.1) as watch:
            child = subprocess.Popen([sys.executable, "-c", VANISHING, s.target], stdout=subprocess.PIPE, text=True)
            try:
                assert child.stdout is not None
                killed = child.stdout.readline().strip()
                assert len(killed) == 32, (killed, s.log())
            finally:
                child.kill()  # with its channel and its stream open
                child.wait()
            gone = ChunkAttnClient(s.target, timeout_s=30)
            dropped = gone.open_block_space(4).space_id
            gone.close()  # the channel closed without CloseBlockSpace
            assert gauge(s, "chunkattn_block_spaces_opened_total") == 3
            wait_for(lambda: gauge(s, "chunkattn_block_spaces") == 1, message=s.log())
            time.sleep(1.5)  # well past the idle timeout: the kept space stays while used
        assert watch.results, "the kept space was never used"
        assert all(isinstance(r, float) and r <= 1e-5 for r in watch.results), watch.results
        assert gauge(s, "chunkattn_block_spaces_evicted_total") == 2
        assert c.info().free_blocks == 64 - kept.pool_blocks
        for space_id in (killed, dropped):
            with pytest.raises(ChunkAttnError) as e:
                c.close_block_space(space_id)
            assert e.value.code == NOT_FOUND
        assert use_kept() <= 1e-5

        # Unused, it goes too; then the server serves a new space.
        wait_for(lambda: gauge(s, "chunkattn_block_spaces") == 0, message=s.log())
        assert gauge(s, "chunkattn_block_spaces_evicted_total") == 3
        assert gauge(s, "chunkattn_kv_blocks_used") == 0
        assert (c.info().free_blocks, c.info().block_spaces) == (64, 0)
        with pytest.raises(ChunkAttnError) as e:
            use_kept()
        assert e.value.code == NOT_FOUND
        kept = c.open_block_space(2)
        assert use_kept() <= 1e-5
        assert c.close_block_space(kept.space_id) == kept.pool_blocks
        assert "block spaces unused past their lease" in s.log()


# -- 4. drain ---------------------------------------------------------------------------------------------------


def test_a_draining_server_refuses_block_calls_with_unavailable_and_exits_cleanly_with_a_space_open() -> None:
    """Its spaces end with it (blocks are the process's): what a client sees meanwhile is UNAVAILABLE, never
    INTERNAL, on every block RPC and on an open stream's next block call."""
    q, k, v = qkv(np.random.default_rng(6), 1)
    with ServerProcess(*SMALL, "--num-blocks", "64", "--idle-timeout-s", "0", "--drain-delay-s", "3") as s:
        c = ChunkAttnClient(s.target, timeout_s=10)
        space = c.open_block_space(2)
        rows = BlockRows(space.space_id, [0], [0, 1], [1], [[0]])
        stream = c.stream()
        stream.attend_blocks(GLOBAL, rows, q, k, v)
        s.proc.send_signal(signal.SIGTERM)

        def refused_now() -> bool:
            """Whether OpenBlockSpace is refused (the drain begun); a space opened just before is closed."""
            try:
                c.close_block_space(c.open_block_space(1).space_id)
            except ChunkAttnError as e:
                code = e.code
            else:
                return False
            assert code == grpc.StatusCode.UNAVAILABLE, code
            return True

        wait_for(refused_now, message=s.log())
        calls: dict[str, Callable[[], Any]] = {
            "OpenBlockSpace": lambda: c.open_block_space(1),
            "Attend": lambda: c.attend_blocks(GLOBAL, rows, q, k, v),
            "AttendStream": lambda: stream.attend_blocks(GLOBAL, rows, q, k, v),
            "CloseBlockSpace": lambda: c.close_block_space(space.space_id),
        }
        for name, call in calls.items():
            with pytest.raises(ChunkAttnError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, (name, e.value)
            assert "draining" in e.value.message, (name, e.value)  # the server's refusal, not a closed connection
        stream.cancel()
        c.close()
        assert s.proc.wait(30) == 0, s.log()
        assert "Traceback" not in s.log()


# -- issue 35: the third hostile review -------------------------------------------------------------------------


def tenants_file(tmp_path: Path, *names: str) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tenants": {n: {"tokens_sha256": [token_digest(TOKENS[n])]} for n in names}}))
    path.chmod(0o600)
    return str(path)


def test_35_1_a_rows_slot_must_be_where_its_table_puts_it_and_other_tenants_padding_changes_nothing(
    tmp_path: Path,
) -> None:
    """Issue 35.1, through a real server that waits 0.3 s for calls to merge: tenant a's decode whose slot (20)
    is not where its table puts its last key (slot 3) is INVALID_ARGUMENT naming both and writes nothing (it was
    answered from the cache alone and from its own k/v when merged with tenant b's padded call: up to 1.21
    apart). a's valid decode gives the reference's answer alone and in one step with b's padded call."""
    rng = np.random.default_rng(351)
    flags = ("--num-blocks", "128", "--max-batch-delay-us", "300000", "--idle-timeout-s", "0")
    with (
        ServerProcess(*SMALL, *flags, "--auth-tokens", tenants_file(tmp_path, "a", "b")) as s,
        client(s, "a") as a,
        client(s, "b") as b,
    ):
        mine, theirs = a.open_block_space(8), b.open_block_space(8)
        q, k, v = qkv(rng, 3)
        a.attend_blocks(GLOBAL, BlockRows(mine.space_id, [0, 1, 2], [0, 3], [3], [[0]]), q, k, v)
        qd, kd, vd = qkv(rng, 1)
        free = a.info().free_blocks
        with pytest.raises(ChunkAttnError) as e:
            a.attend_blocks(GLOBAL, BlockRows(mine.space_id, [20], [0, 1], [4], [[0]]), qd, kd, vd)
        assert e.value.code == INVALID, e.value
        assert "slot_mapping[0] is 20; token 0 is key 3 of row 0, which block_table row 0 puts in slot 3" in str(
            e.value
        )
        assert a.info().free_blocks == free
        keys, values = np.concatenate([k, kd]), np.concatenate([v, vd])
        want = chunked_attention(qd, keys, values, [3], chunk_size=0, scale=0.25)
        decode = BlockRows(mine.space_id, [3], [0, 1], [4], [[0]])
        close_enough(np.asarray(a.attend_blocks(GLOBAL, decode, qd, kd, vd)), want)  # alone
        qb, kb, vb = qkv(rng, 2)
        padded = BlockRows(theirs.space_id, [0, -1], [0, 2], [2], [[0]])
        before = s.metrics()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ours = pool.submit(a.attend_blocks, GLOBAL, decode, qd, kd, vd)
            time.sleep(0.05)  # inside the first call's 0.3 s wait
            other = pool.submit(b.attend_blocks, GLOBAL, padded, qb, kb, vb)
            merged, padded_out = np.asarray(ours.result()), np.asarray(other.result())
        after = s.metrics()
        steps = counter(after, "chunkattn_step_calls_count") - counter(before, "chunkattn_step_calls_count")
        calls = counter(after, "chunkattn_step_calls_sum") - counter(before, "chunkattn_step_calls_sum")
        assert (steps, calls) == (1, 2), "the two calls did not share a step"
        close_enough(merged, want)
        close_enough(padded_out, chunked_attention(qb, kb, vb, [0, 1], chunk_size=0, scale=0.25))


def test_35_2_opening_the_whole_pool_in_a_loop_stalls_nobody_and_is_rate_bounded(tmp_path: Path) -> None:
    """Issue 35.2: OpenBlockSpace zeroed the whole pool on the engine thread (584-652 ms on the demo model) and a
    client looping open/close moved another's decodes from p99 1.6 ms to 603 ms. Opening zeroes nothing now
    (each block is zeroed by the first call that touches it), and a tenant may open the pool's size per 10 s:
    tenant a looping open/close of a space of the whole pool (384 MiB) gets RESOURCE_EXHAUSTED saying when to
    retry, and tenant b's decodes are never held 100 ms; a's space still reads zeros where b's KV was."""
    rng = np.random.default_rng(352)
    flags = ("--num-blocks", str(1 << 17), "--idle-timeout-s", "0")
    with (
        ServerProcess(*SMALL, *flags, "--auth-tokens", tenants_file(tmp_path, "a", "b")) as s,
        client(s, "a") as a,
        client(s, "b") as b,
    ):
        info = b.info()
        whole = info.num_blocks // (-(-len(CHUNKS) // info.planes_per_block))  # space blocks of the whole pool
        q, k, v = qkv(rng, 1)
        b.attend(0, [BatchEntry("victim", 0, 1)], q, k * 100, v * 100)  # b's KV in a block a gets later
        b.release(["victim"])
        b.attend(0, [BatchEntry("victim", 0, 1)], q, k, v)
        position = [1]

        def decode() -> None:
            b.attend(0, [BatchEntry("victim", position[0], 1)], *qkv(rng, 1))
            position[0] += 1

        answers: list[str] = []

        def open_or_refused() -> ChunkAttnError | BlockSpace:
            try:
                return a.open_block_space(whole - 1)
            except ChunkAttnError as e:
                return e

        with Watch(decode, pause_s=0.002) as decodes:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                space = open_or_refused()
                if isinstance(space, ChunkAttnError):
                    assert space.code == EXHAUSTED, space
                    assert "per 10 s" in space.message, space
                    assert "retry in" in space.message, space
                    answers.append("refused")
                    continue
                answers.append("opened")
                # the last space block (0 .. whole - 2) reads zeros, whatever its pool blocks held
                qa, ka, va = qkv(rng, 1)
                slot = 4 * (whole - 2) + 3
                rows = BlockRows(space.space_id, [slot], [0, 1], [4], [[whole - 2]])
                out = np.asarray(a.attend_blocks(GLOBAL, rows, qa, ka, va))
                zeros = np.zeros((3, HKV, D), np.float32)
                close_enough(out, chunked_attention(qa, np.concatenate([zeros, ka]), np.concatenate([zeros, va]),
                                                    [3], chunk_size=0, scale=0.25))  # fmt: skip
                a.close_block_space(space.space_id)
        assert answers[0] == "opened", answers
        assert "refused" in answers, answers
        assert answers.count("opened") <= 2, answers  # the pool's size per 10 s
        assert len(decodes.seconds) > 20
        print(
            f"decodes: {len(decodes.seconds)}, worst {decodes.worst * 1000:.1f} ms; a: {answers.count('opened')} opened"
        )
        assert decodes.worst < 0.1, f"b's decode waited {decodes.worst * 1000:.0f} ms"


LEASED = """
import sys, time
import numpy as np
from chunkattn_client import BlockRows, ChunkAttnClient
c = ChunkAttnClient(sys.argv[1], token=sys.argv[2], timeout_s=30)
s = c.open_block_space(3, lease_s=2)
x, kv = np.ones((1, 4, 16), np.float32), np.ones((1, 2, 16), np.float32)
c.attend_blocks(0, BlockRows(s.space_id, [0], [0, 1], [1], [[0]]), x, kv, kv)
print(s.space_id, s.lease_s, flush=True)
time.sleep(600)
"""


def test_35_5_a_killed_engines_space_ends_with_its_lease_and_a_tenant_lists_and_closes_its_own(
    tmp_path: Path,
) -> None:
    """Issue 35.5: with --idle-timeout-s 0 (as docs/vllm.md advised for a server of vLLM's), a space whose engine
    was killed held its blocks, quota and space slot until the server restarted. A space opened with a lease is
    closed once unused (no call, no renewal) that long, whatever the idle timeout; one renewed in time stays; a
    tenant lists its own spaces (never another's) and closes one whose id its client lost."""
    flags = ("--num-blocks", "256", "--idle-timeout-s", "0")
    with (
        ServerProcess(*SMALL, *flags, "--auth-tokens", tenants_file(tmp_path, "a", "b")) as s,
        client(s, "a") as a,
        client(s, "b") as b,
    ):
        renewed = a.open_block_space(2, lease_s=1.5)
        assert renewed.lease_s == 1.5
        lost = a.open_block_space(5)  # no lease: kept for ever here, until closed
        assert lost.lease_s == 0
        theirs = b.open_block_space(1)
        child = subprocess.Popen(
            [sys.executable, "-c", LEASED, s.target, TOKENS["a"]], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            killed, granted = child.stdout.readline().split()
            assert float(granted) == 2.0, s.log()
        finally:
            child.kill()  # SIGKILL: no CloseBlockSpace, its channel just gone
            child.wait()
        listed = {x.space_id: x for x in a.list_block_spaces()}
        assert set(listed) == {renewed.space_id, lost.space_id, killed}
        assert theirs.space_id not in listed  # never another tenant's
        assert (listed[lost.space_id].num_blocks, listed[lost.space_id].lease_s) == (5, 0)
        assert listed[killed].lease_s == 2
        assert listed[killed].idle_s < 2
        assert [x.space_id for x in b.list_block_spaces()] == [theirs.space_id]
        with pytest.raises(ChunkAttnError) as e:
            b.renew_block_space(renewed.space_id)  # another tenant's id: as unknown as one never issued
        assert e.value.code == NOT_FOUND
        started = time.monotonic()
        while time.monotonic() - started < 3.5:  # past the killed space's lease, renewing the other
            assert a.renew_block_space(renewed.space_id) == 1.5
            time.sleep(0.5)
        listed = {x.space_id: x for x in a.list_block_spaces()}
        assert set(listed) == {renewed.space_id, lost.space_id}, s.log()
        assert gauge(s, "chunkattn_block_spaces_evicted_total") == 1
        with pytest.raises(ChunkAttnError) as e:
            a.attend_blocks(0, BlockRows(killed, [0], [0, 1], [1], [[0]]), *qkv(np.random.default_rng(5), 1))
        assert e.value.code == NOT_FOUND
        assert "ListBlockSpaces" in e.value.message
        assert a.close_block_space(lost.space_id) == lost.pool_blocks  # found again by listing
        wait_for(lambda: [x.space_id for x in a.list_block_spaces()] == [], 5, s.log())  # unrenewed, it goes too
        assert gauge(s, "chunkattn_kv_blocks_used") == theirs.pool_blocks
        for bad in (-1.0, 0.5, 86401.0, float("nan"), float("inf")):
            with pytest.raises(ChunkAttnError) as e:
                a.open_block_space(1, lease_s=bad)
            assert e.value.code == INVALID, e.value
            assert "lease_s" in e.value.message, e.value


def test_35_5_a_lease_is_never_longer_than_the_idle_timeout() -> None:
    with ServerProcess(*SMALL, "--num-blocks", "64", "--idle-timeout-s", "30") as s, ChunkAttnClient(s.target) as c:
        assert c.open_block_space(1, lease_s=600).lease_s == 30
        assert c.open_block_space(1, lease_s=5).lease_s == 5
        assert c.open_block_space(1).lease_s == 30
        assert [x.lease_s for x in c.list_block_spaces()] == [30, 5, 30]
