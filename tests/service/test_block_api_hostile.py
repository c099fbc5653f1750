"""The block API (OpenBlockSpace, CloseBlockSpace, AttendRequest.blocks) through a real server subprocess, the
real clients, and raw bytes where the client would refuse to send something. The numeric parity in depth is
tests/engine/test_blocks.py's; these modules (test_block_api_*.py) are about the service edge; the shared
server, its tenants and callers are in conftest.py and tests/helpers/blockapi.py.

Covered here:

* a tenant that gets back blocks another wrote (its space and its sequence) reads zeros;
* hostile requests at the edge, on a server with tenants: bytes of the wrong size in every BlockBatch field,
  tables of the wrong size or width, entries and blocks together, bad space ids (empty, 10,000 characters,
  33 characters, not UTF-8, closed, never issued, another tenant's), int32/int64 extremes in every integer
  field, rows and slots outside the space, a bad layer; each gets INVALID_ARGUMENT or NOT_FOUND with a bounded
  message naming the field, and changes nothing: the pool's free blocks, the caller's spaces, and the K/V in
  the space (the bad requests would overwrite a live sequence's keys; a later decode reads them); a self-check
  shows that the unbroken request does change them; int64 min slots are padding (served, nothing written);
  a request of no tokens (INVALID_ARGUMENT);
* AttendStream: a bad block request is answered with its status in its response (raw, sync and asyncio
  streams) and the stream goes on serving;
* issue 35.1: a row's slot must be where its table puts it, and another tenant's padding in the same step
  changes nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from chunkattn_client import (
    AsyncChunkAttnClient,
    BatchEntry,
    BlockRows,
    ChunkAttnClient,
    ChunkAttnError,
    ReferenceModel,
)
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.reference import chunked_attention, within_tolerance
from tests.helpers.blockapi import (
    BS,
    GLOBAL,
    HKV,
    I32,
    I64,
    INVALID,
    NOT_FOUND,
    TOKENS,
    Caller,
    D,
    batch,
    caller,
    client,
    close_enough,
    encode,
    output_of,
    refused,
    rows_of,
    tenants_file,
    wait_for,
)
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.server_process import SMALL, ServerProcess, counter
from tests.helpers.tensors import qkv

pytestmark = pytest.mark.server


# -- hostile requests -------------------------------------------------------------------------------------------

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


# -- issue 35: the third hostile review -------------------------------------------------------------------------


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
