"""A grant sent between two servers (GrantBlocks with a target: issue 38) through real server subprocesses, the
real clients, and raw ImportKV streams where a sender that is not our server would send something else. The
contract is the proto's (GrantBlocksRequest.target, GrantBlocksResponse.records / network_bytes, GrantHeader,
ImportKV); one server's handoff is tests/service/test_block_handoff.py's, whose helpers this reuses.

Covered here:

* exactness across servers: a sequence prefilled into a space of S1 (42 tokens: across the chunk boundaries 16
  and 32; 48: a multiple of the chunk size, whose last position's chunk is the one before the next token's),
  granted with S2 as its target and taken there into shuffled blocks; the next two tokens decode bitwise alike
  on S1 and S2 in every layer. The records sent are the live (plane, block) pairs, counted here from the rule
  (a chunked layer's blocks from the chunk of position n - 1 on, a global layer's all), their bytes on the
  network 2 * HKV * BS * D * 4 each; nothing stays parked on S1, S2 holds one grant until the take, and S1's
  chunkattn_handoff_bytes_total{op="grant",where="network"} counts the bytes; a grant of 0 tokens sends none;
* a grant sent past its ttl ends on the target by the target's sweep (its gauges back to 0);
* the receiver's checks, passed on to the grantor, leaving nothing behind on either side (free blocks and the
  grant gauges of both): another model shape (INVALID_ARGUMENT naming it), a grant name open on the target
  (ALREADY_EXISTS) or on the grantor, a missing or wrong target_token (UNAUTHENTICATED), the target tenant's
  quota (RESOURCE_EXHAUSTED), a target nothing listens on (UNAVAILABLE), a target or token that is not one
  (INVALID_ARGUMENT, before the space is even looked up); after them all the name is free and the grant goes
  through. The grant belongs on the target to the tenant target_token names there (and its to_tenant): another
  tenant, the grantor's own included, finds nothing;
* hostile grant streams straight into ImportKV (raw bytes): damaged, cut short, a record not expected (not
  live, a plane out of range, sent twice), a header that contradicts itself or this server (num_records, the
  layout, num_blocks, num_tokens, another model, a bad name or ttl), NaN in a record; each refused with its
  status and leaving the target's pool and grants as they were, and a well-formed forged stream of the same
  name is then accepted, taken, and decodes as the reference says over the K/V it carried;
* float8: two e4m3 servers with the same --kv-scales hand a grant over and decode bitwise alike; a target
  holding other scales refuses it naming the scales, and nothing is left.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from chunkattn_client import BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import MAX_MESSAGE_CHARS
from chunkattn_server.kv.manifest import checksum
from chunkattn_server.service.auth import token_digest
from tests.helpers.blockapi import (
    BS,
    CHUNKS,
    EXHAUSTED,
    HKV,
    INVALID,
    NOT_FOUND,
    POOL,
    QUOTA_BLOCKS,
    TENANTS,
    TOKENS,
    D,
    client,
    close_enough,
    wait_for,
)
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.rawrpc import BIG, SERVICE
from tests.helpers.server_process import SMALL, ServerProcess, counter, free_port
from tests.helpers.tensors import qkv
from tests.service.test_block_handoff import LAYERS, Held, grant_metrics, grant_name, refused_call, same, shuffled

pytestmark = pytest.mark.server

PREFILL = 40
SPACE = 14  # blocks of a grantor's space: a prefill of up to 48 tokens (12 blocks) and two decoded tokens
DEST = 24  # blocks of a receiving space: room for the shuffled ids
RECORD = 2 * HKV * BS * D * 4  # one record's K and V, float32
EXISTS = grpc.StatusCode.ALREADY_EXISTS
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
DATA_LOSS = grpc.StatusCode.DATA_LOSS


def live_records(n: int, num_blocks: int) -> set[tuple[int, int]]:
    """The (plane, block) pairs a grant of ``num_blocks`` blocks holding ``n`` tokens sends, by the proto's rule
    (SMALL's layout: one plane per layer): a chunked layer's blocks from the chunk of position n - 1 on, a global
    layer's all, up to the last block holding a token."""
    if n == 0:
        return set()
    last = min(num_blocks, -(-n // BS)) - 1
    pairs = set()
    for plane, chunk in enumerate(CHUNKS):
        first = (n - 1) // chunk * chunk // BS if chunk else 0
        pairs |= {(plane, b) for b in range(first, last + 1)}
    return pairs


def token_file(directory: Path) -> str:
    """SMALL's block API tenants (tests/helpers/blockapi.py), each with its token; "quota" may hold QUOTA_BLOCKS
    pool blocks."""
    spec: dict[str, dict[str, Any]] = {name: {"tokens_sha256": [token_digest(TOKENS[name])]} for name in TENANTS}
    spec["quota"]["max_kv_blocks"] = QUOTA_BLOCKS
    path = directory / "tokens.json"
    path.write_text(json.dumps({"tenants": spec}))
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def s2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The target: the same model and tenants as ``server`` (S1, tests/service/conftest.py), a pool of its own."""
    tokens = token_file(tmp_path_factory.mktemp("auth2"))
    with ServerProcess(*SMALL, "--num-blocks", str(POOL), "--idle-timeout-s", "0", "--auth-tokens", tokens) as s:
        yield s


@pytest.fixture(scope="module")
def other_shape() -> Iterator[ServerProcess]:
    """A target serving chunks of 8 (no tokens)."""
    flags = list(SMALL)
    flags[flags.index("--chunk-size") + 1] = "8"
    with ServerProcess(*flags, "--num-blocks", "256") as s:
        yield s


@contextlib.contextmanager
def at(s: ServerProcess, tenant: str | None = "a") -> Iterator[ChunkAttnClient]:
    """A client of ``s`` under ``tenant``'s token (None: no token, for a server without tokens)."""
    with ChunkAttnClient(s.target, token=None if tenant is None else TOKENS[tenant], timeout_s=30) as c:
        yield c


@dataclass
class Pools:
    """What a refused grant must leave as it was on each server (with the tenant whose Info reads it): the
    pool's free blocks and the gauges of grants and their parked blocks."""

    servers: list[tuple[ServerProcess, str | None]]
    before: list[tuple[int, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.before = self._now()

    def _now(self) -> list[tuple[int, float, float]]:
        now = []
        for s, tenant in self.servers:
            with at(s, tenant) as c:
                free = c.info().free_blocks
            now.append((free, *grant_metrics(s)))
        return now

    def unchanged(self, what: str) -> None:
        assert self._now() == self.before, what


def grant_refused(code: grpc.StatusCode, call: Callable[..., object], *args: object, **kwargs: object) -> str:
    """``refused_call`` for a grant sent to another server. A target that refuses the stream while the grantor
    still sends may lose its reason in gRPC (grpc/grpc#36066: the grantor then says UNAVAILABLE, naming that
    issue, or finds the reason out); such an answer is retried (a refusal changes nothing), so the status
    checked is the target's own."""
    for _ in range(5):
        with pytest.raises(ChunkAttnError) as e:
            call(*args, **kwargs)
        if code == UNAVAILABLE or e.value.code != UNAVAILABLE or "grpc/grpc#36066" not in e.value.message:
            break
    assert e.value.code == code, e.value
    assert len(e.value.message) <= MAX_MESSAGE_CHARS, e.value
    return e.value.message


@pytest.fixture
def a_space(server: ServerProcess) -> Iterator[Held]:
    """Tenant "a"'s space on S1 holding sequence "s" (PREFILL tokens, every layer)."""
    with at(server) as c:
        space = c.open_block_space(SPACE)
        held = Held(c, space.space_id, KVCacheManager(SPACE, BS, seed=7))
        held.prefill(PREFILL, seed=1)
        yield held
        with contextlib.suppress(ChunkAttnError):
            c.close_block_space(space.space_id)


# -- exactness across servers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [42, 48])
def test_a_grant_sent_to_another_server_decodes_there_bitwise_as_at_home(
    server: ServerProcess, s2: ServerProcess, n: int
) -> None:
    with at(server) as c1, at(s2) as c2:
        free1, free2 = c1.info().free_blocks, c2.info().free_blocks
        space = c1.open_block_space(SPACE)
        held = Held(c1, space.space_id, KVCacheManager(SPACE, BS, seed=n))
        held.prefill(n, seed=n + 1)
        blocks = len(held.table)
        assert blocks == -(-n // BS)
        live = live_records(n, blocks)
        assert len(live) == 3 * (blocks - (n - 1) // 16 * 16 // BS) + blocks  # chunked layers' tail, global's all
        home = c1.info().free_blocks
        before = server.metrics()
        name = grant_name()
        grant = c1.grant_blocks(
            space.space_id, held.table, name, num_tokens=n, target=s2.target, target_token=TOKENS["a"]
        )
        assert (grant.blocks, grant.pool_blocks, grant.ttl_s) == (blocks, blocks * LAYERS, 60.0)
        assert grant.records == len(live)
        assert grant.network_bytes == len(live) * RECORD
        # Nothing stays on S1: the snapshot parked for the stream went back to the pool.
        assert c1.info().free_blocks == home
        assert grant_metrics(server) == (0, 0)
        after = server.metrics()
        network = {"op": "grant", "where": "network"}
        assert counter(after, "chunkattn_handoff_bytes_total", **network) == grant.network_bytes + counter(
            before, "chunkattn_handoff_bytes_total", **network
        )
        assert counter(after, "chunkattn_handoffs_total", op="grant", code="OK") == 1 + counter(
            before, "chunkattn_handoffs_total", op="grant", code="OK"
        )
        # S2 holds it, every plane of every block (the planes not sent are zeros), charged to tenant "a".
        assert grant_metrics(s2) == (1, blocks * LAYERS)
        assert c2.info().free_blocks == free2 - blocks * LAYERS
        dest = c2.open_block_space(DEST)
        ids = shuffled(blocks, DEST, seed=n + 2)
        copied = c2.copy_blocks(dest.space_id, ids, grant_id=name)
        assert (copied.blocks, copied.num_tokens) == (blocks, n)
        assert grant_metrics(s2) == (0, 0)
        taken = held.moved(c2, dest.space_id, ids, DEST)
        same(held.decode(n, seed=n + 3), taken.decode(n, seed=n + 3))
        same(held.decode(n + 1, seed=n + 4), taken.decode(n + 1, seed=n + 4))
        refused_call(NOT_FOUND, c2.copy_blocks, dest.space_id, ids, grant_id=name)  # taken once
        c2.close_block_space(dest.space_id)
        c1.close_block_space(space.space_id)
        assert (c1.info().free_blocks, c2.info().free_blocks) == (free1, free2)


def test_a_grant_of_no_tokens_sends_no_records(server: ServerProcess, s2: ServerProcess, a_space: Held) -> None:
    c1 = a_space.c
    with at(s2) as c2:
        free2 = c2.info().free_blocks
        name = grant_name()
        grant = c1.grant_blocks(a_space.space_id, a_space.table[:3], name, target=s2.target, target_token=TOKENS["a"])
        assert (grant.blocks, grant.records, grant.network_bytes) == (3, 0, 0)
        assert grant_metrics(s2) == (1, 3 * LAYERS)
        dest = c2.open_block_space(3)
        assert c2.copy_blocks(dest.space_id, [2, 0, 1], grant_id=name).num_tokens == 0
        c2.close_block_space(dest.space_id)
        assert (c2.info().free_blocks, grant_metrics(s2)) == (free2, (0, 0))
    assert grant_metrics(server) == (0, 0)


def test_a_grant_sent_past_its_ttl_ends_on_the_target(server: ServerProcess, s2: ServerProcess, a_space: Held) -> None:
    """S2 runs with --idle-timeout-s 0 and nothing else opens there meanwhile: the imported grant's own deadline
    must wake its sweep."""
    with at(s2) as c2:
        free2 = c2.info().free_blocks
        expired = counter(s2.metrics(), "chunkattn_grants_expired_total")
        name = grant_name()
        a_space.c.grant_blocks(
            a_space.space_id,
            a_space.table,
            name,
            num_tokens=PREFILL,
            ttl_s=2,
            target=s2.target,
            target_token=TOKENS["a"],
        )
        assert grant_metrics(s2) == (1, len(a_space.table) * LAYERS)
        wait_for(lambda: grant_metrics(s2) == (0, 0), timeout_s=15, message="S2's sweep did not end the grant")
        assert counter(s2.metrics(), "chunkattn_grants_expired_total") == expired + 1
        assert c2.info().free_blocks == free2


# -- the receiver's checks, passed on -----------------------------------------------------------------------------


def test_a_target_that_refuses_the_grant_leaves_nothing_on_either_side(
    server: ServerProcess, s2: ServerProcess, other_shape: ServerProcess, a_space: Held
) -> None:
    c, sid, table = a_space.c, a_space.space_id, a_space.table
    with at(s2, "b") as b2, at(server, "b") as b1:
        # A name open on the target (tenant "b"'s: names are global there) and one open on the grantor.
        b_space = b2.open_block_space(2)
        open_there = grant_name()
        b2.grant_blocks(b_space.space_id, [0], open_there)
        b1_space = b1.open_block_space(1)
        open_here = grant_name()
        b1.grant_blocks(b1_space.space_id, [0], open_here)
        pools = Pools([(server, "a"), (s2, "a"), (other_shape, None)])
        name = grant_name()
        to_s2: dict[str, Any] = {"target": s2.target, "target_token": TOKENS["a"]}
        nowhere = f"127.0.0.1:{free_port()}"
        cases: list[tuple[grpc.StatusCode, str, dict[str, object], list[str]]] = [
            (
                INVALID,
                name,
                {"target": other_shape.target},
                ["another model shape", "chunk_sizes", other_shape.target],
            ),
            (EXISTS, open_there, to_s2, ["exists"]),
            (EXISTS, open_here, to_s2, ["exists"]),
            (UNAUTHENTICATED, name, {"target": s2.target}, [s2.target]),
            (UNAUTHENTICATED, name, {"target": s2.target, "target_token": "not-a-token-of-s2-0123456789"}, []),
            (EXHAUSTED, name, {"target": s2.target, "target_token": TOKENS["quota"]}, ["max_kv_blocks"]),
            (UNAVAILABLE, name, {"target": nowhere, "target_token": TOKENS["a"]}, [nowhere]),
            (INVALID, name, {"target": "nowhere"}, ["is not an address"]),
            (INVALID, name, {"target": "127.0.0.1:0"}, ["is not an address"]),
            (INVALID, name, {"target": "unix:/tmp/chunkattn.sock"}, ["TCP only"]),
            (INVALID, name, {"target": "x" * 600 + ":1"}, ["longer than"]),
            (INVALID, name, {"target": s2.target, "target_token": "a\nb"}, ["target_token"]),
        ]
        for code, grant_id, kwargs, words in cases:
            message = grant_refused(code, c.grant_blocks, sid, table, grant_id, num_tokens=PREFILL, **kwargs)
            for w in words:
                assert w in message, (kwargs, message)
            assert grant_id not in message, message  # a grant's name is a secret: never echoed
            pools.unchanged(f"{code.name} {kwargs}")
        # A bad target is refused before anything is looked up: a space never opened is not reached.
        message = refused_call(INVALID, c.grant_blocks, "no-such-space", table, name, target="nowhere")
        assert "is not an address" in message
        pools.unchanged("bad target, no space")
        # The names in use are still their grants', each taken once.
        b2.copy_blocks(b_space.space_id, [1], grant_id=open_there)
        b1.copy_blocks(b1_space.space_id, [0], grant_id=open_here)
        b2.close_block_space(b_space.space_id)
        b1.close_block_space(b1_space.space_id)
    # Every refusal left the name free on both sides: the grant goes through now.
    assert c.grant_blocks(sid, table, name, num_tokens=PREFILL, **to_s2).records == len(live_records(PREFILL, 10))
    with at(s2) as c2:
        dest = c2.open_block_space(DEST)
        ids = shuffled(len(table), DEST, seed=40)
        c2.copy_blocks(dest.space_id, ids, grant_id=name)
        same(a_space.decode(PREFILL, seed=41), a_space.moved(c2, dest.space_id, ids, DEST).decode(PREFILL, seed=41))
        c2.close_block_space(dest.space_id)
    assert grant_metrics(s2) == (0, 0)
    m = server.metrics()
    for status in ("INVALID_ARGUMENT", "ALREADY_EXISTS", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"):
        assert counter(m, "chunkattn_handoffs_total", op="grant", code=status) >= 1, status


def test_a_grant_sent_belongs_to_the_tenant_its_token_names_there(
    server: ServerProcess, s2: ServerProcess, a_space: Held
) -> None:
    c, sid, table = a_space.c, a_space.space_id, a_space.table
    n = len(table)
    to_b, to_b_and_many = grant_name(), grant_name()
    c.grant_blocks(sid, table, to_b, num_tokens=PREFILL, target=s2.target, target_token=TOKENS["b"])
    c.grant_blocks(
        sid, table, to_b_and_many, num_tokens=PREFILL, target=s2.target, target_token=TOKENS["b"], to_tenant="many"
    )
    assert grant_metrics(s2) == (2, 2 * n * LAYERS)
    with at(s2, "a") as a2, at(s2, "many") as many2, at(s2, "b") as b2:
        # The grantor's tenant on S2, and a third tenant, find neither (nor would "a" on S1: nothing stays there).
        for other, names in ((a2, (to_b, to_b_and_many)), (many2, (to_b,))):
            space = other.open_block_space(DEST)
            for name in names:
                message = refused_call(NOT_FOUND, other.copy_blocks, space.space_id, list(range(n)), grant_id=name)
                assert "does not exist for your tenant" in message
            other.close_block_space(space.space_id)
        assert grant_metrics(s2) == (2, 2 * n * LAYERS)
        for taker, name, seed in ((b2, to_b, 42), (many2, to_b_and_many, 43)):
            dest = taker.open_block_space(DEST)
            ids = shuffled(n, DEST, seed=seed)
            assert taker.copy_blocks(dest.space_id, ids, grant_id=name).num_tokens == PREFILL
            taken = a_space.moved(taker, dest.space_id, ids, DEST)
            same(a_space.decode(PREFILL, seed=seed), taken.decode(PREFILL, seed=seed))
            taker.close_block_space(dest.space_id)
        # Taken by "many": its grantor's tenant on S2 ("b") cannot take it again.
        space = b2.open_block_space(DEST)
        refused_call(NOT_FOUND, b2.copy_blocks, space.space_id, list(range(n)), grant_id=to_b_and_many)
        b2.close_block_space(space.space_id)
    assert grant_metrics(s2) == (0, 0)
    refused_call(NOT_FOUND, c.copy_blocks, sid, list(range(n)), grant_id=to_b)  # nothing on S1 either


# -- hostile grant streams ----------------------------------------------------------------------------------------


@dataclass
class Forger:
    """A grant's stream built from the proto's words (not by a server): a GrantHeader for a grant of ``blocks``
    blocks holding ``tokens`` tokens of this server's model, the records with K/V drawn from ``seed`` (float32
    [HKV, BS, D] each) and their checksums, and a trailer."""

    info: pb.InfoResponse
    name: str
    blocks: int = 10
    tokens: int = PREFILL
    seed: int = 0
    kv: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        for key in sorted(live_records(self.tokens, self.blocks)):
            self.kv[key] = (
                rng.standard_normal((HKV, BS, D), np.float32),
                rng.standard_normal((HKV, BS, D), np.float32),
            )

    def model(self, **changes: Any) -> pb.KVModel:
        i = self.info
        model = pb.KVModel(
            num_heads=i.num_heads,
            num_kv_heads=i.num_kv_heads,
            head_size=i.head_size,
            block_size=i.block_size,
            chunk_sizes=[x.chunk_size for x in i.layers],
            kv_sources=[x.kv_source if x.HasField("kv_source") else -1 for x in i.layers],
            cache_dtype=i.cache_dtype,
        )
        for key, value in changes.items():
            if isinstance(value, list):
                del getattr(model, key)[:]
                getattr(model, key).extend(value)
            else:
                setattr(model, key, value)
        return model

    def header(self, *, model: pb.KVModel | None = None, **changes: Any) -> bytes:
        fields: dict[str, Any] = {
            "grant_id": self.name,
            "model": model or self.model(),
            "layer_planes": list(range(LAYERS)),
            "num_planes": LAYERS,
            "num_blocks": self.blocks,
            "num_tokens": self.tokens,
            "ttl_s": 0.0,
            "num_records": len(self.kv),
        }
        fields.update(changes)
        return bytes(pb.KVChunk(grant=pb.GrantHeader(**fields)).SerializeToString())

    def record(
        self, plane: int, block: int, *, nan: bool = False, damaged: bool = False, size: int = 0
    ) -> tuple[int, int, int, list[bytes], list[bytes]]:
        k, v = self.kv.get((plane, block), (np.ones((HKV, BS, D), np.float32),) * 2)
        if nan:
            k = k.copy()
            k[1, 2, 3] = np.nan
        kb, vb = k.tobytes(), v.tobytes()
        if size:  # K of ``size`` bytes, V the rest: a record of the right bytes in all, cut wrong
            kb, vb = (kb + vb)[:size], (kb + vb)[size:]
        digest = checksum(plane, block, [kb, vb])
        if damaged:
            kb = bytes([kb[0] ^ 0x40]) + kb[1:]
        return plane, block, digest, [kb], [vb]

    def records(self, keys: list[tuple[int, int]] | None = None) -> bytes:
        return wire.encode_kv_blocks([self.record(p, b) for p, b in (sorted(self.kv) if keys is None else keys)])

    def stream(self, **changes: Any) -> list[bytes]:
        """The well-formed stream (``changes`` to its header): header, all records in two messages, trailer."""
        keys = sorted(self.kv)
        return [self.header(**changes), self.records(keys[:7]), self.records(keys[7:]), trailer(len(keys))]


def trailer(n: int) -> bytes:
    return bytes(pb.KVChunk(trailer=pb.KVTrailer(num_records=n)).SerializeToString())


def import_kv(s: ServerProcess, tenant: str, messages: list[bytes]) -> tuple[grpc.StatusCode, str, bytes]:
    """Raw bytes into ``s``'s ImportKV under ``tenant``'s token: the status, its details and the answer."""
    with grpc.insecure_channel(s.target, options=BIG) as channel:
        importing: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(SERVICE + "ImportKV")
        try:
            answer = importing(iter(messages), metadata=(("authorization", f"Bearer {TOKENS[tenant]}"),), timeout=30)
        except grpc.RpcError as e:
            return e.code(), e.details() or "", b""
    return grpc.StatusCode.OK, "", answer


def test_hostile_grant_streams_are_refused_and_leave_the_target_as_it_was(s2: ServerProcess) -> None:
    with grpc.insecure_channel(s2.target) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(SERVICE + "Info")
        info = pb.InfoResponse.FromString(call(b"", metadata=(("authorization", f"Bearer {TOKENS['a']}"),)))
    name = grant_name()
    f = Forger(info, name, seed=50)
    keys = sorted(f.kv)
    assert len(keys) == 3 * 2 + 10  # chunked layers: blocks 8, 9 (the chunk 32 .. 47); global: 0 .. 9
    head, first, rest, end = f.stream()
    probe = client(s2, "a")
    probe_space = probe.open_block_space(1)  # where a take of the name would land: none must find it
    pools = Pools([(s2, "a")])

    def records(*items: tuple[int, int, int, list[bytes], list[bytes]]) -> bytes:
        return wire.encode_kv_blocks(list(items))

    # A negative plane, through protobuf (a 10-byte varint; wire.encode_kv_blocks writes none).
    _, _, digest, (k_bytes,), (v_bytes,) = f.record(-1, 9)
    negative = pb.KVChunk(
        blocks=pb.KVBlocks(blocks=[pb.KVBlock(layer=-1, logical=9, k=k_bytes, v=v_bytes, checksum=digest)])
    ).SerializeToString()

    cases: list[tuple[str, grpc.StatusCode, list[bytes], list[str]]] = [
        ("empty", DATA_LOSS, [], ["empty"]),
        ("damaged", DATA_LOSS, [head, first, records(f.record(*keys[7], damaged=True)), rest, end], ["checksum"]),
        ("no trailer", DATA_LOSS, [head, first, rest], ["cut short"]),
        ("records missing", DATA_LOSS, [head, first, end], ["missing", "cut short"]),
        ("header only", DATA_LOSS, [head], ["cut short"]),
        (
            "not live",
            INVALID,
            [head, records(f.record(0, 0)), first, rest, end],
            ["(plane 0, block 0)", "not expected"],
        ),
        ("block past", INVALID, [head, records(f.record(3, 10)), first, rest, end], ["(plane 3, block 10)"]),
        ("plane past", INVALID, [head, records(f.record(4, 9)), first, rest, end], ["(plane 4, block 9)"]),
        ("negative", INVALID, [head, negative, first, rest, end], ["block 9)", "not expected"]),
        ("twice", INVALID, [head, first, rest, records(f.record(*keys[0])), end], ["came twice"]),
        ("twice in one", INVALID, [head, records(f.record(*keys[0]), f.record(*keys[0])), end], ["came twice"]),
        ("NaN", INVALID, [head, first, records(f.record(*keys[7], nan=True)), end], ["NaN"]),
        (
            "short record",
            INVALID,
            [head, records(f.record(*keys[0]), f.record(*keys[1], size=100)), end],
            ["wrong size"],
        ),
        ("after trailer", INVALID, [head, first, rest, end, end], ["after its trailer"]),
        ("blocks first", INVALID, [first, rest, end], ["header"]),
        ("two headers", INVALID, [head, head, first, rest, end], ["unexpected"]),
        ("num_records", INVALID, [f.header(num_records=len(keys) + 1), first, rest, end], ["announces"]),
        ("num_records 0", INVALID, [f.header(num_records=0), end], ["announces"]),
        ("planes: count", INVALID, [f.header(layer_planes=[0, 1, 2]), first, rest, end], ["layout"]),
        ("planes: past", INVALID, [f.header(layer_planes=[0, 1, 2, 4]), first, rest, end], ["layout"]),
        ("planes: shared", INVALID, [f.header(layer_planes=[0, 0, 0, 1]), first, rest, end], ["layout"]),
        ("num_planes", INVALID, [f.header(num_planes=5), first, rest, end], ["layout"]),
        ("num_planes 0", INVALID, [f.header(num_planes=0), first, rest, end], ["layout"]),
        ("num_blocks 0", INVALID, [f.header(num_blocks=0), first, rest, end], ["0 blocks"]),
        ("num_blocks past", INVALID, [f.header(num_blocks=POOL + 1), first, rest, end], [f"{POOL + 1} blocks"]),
        ("num_blocks huge", INVALID, [f.header(num_blocks=2**62), first, rest, end], ["blocks"]),
        ("num_tokens past", INVALID, [f.header(num_tokens=41), first, rest, end], ["41 tokens in 10 blocks"]),
        ("num_tokens -1", INVALID, [f.header(num_tokens=-1), first, rest, end], ["-1 tokens"]),
        ("head_size", INVALID, [f.header(model=f.model(head_size=32)), first, rest, end], ["head_size"]),
        ("chunks", INVALID, [f.header(model=f.model(chunk_sizes=[8, 8, 8, 0])), first, rest, end], ["chunk"]),
        ("dtype", INVALID, [f.header(model=f.model(cache_dtype=pb.DTYPE_FLOAT16)), first, rest, end], ["dtype"]),
        ("bad name", INVALID, f.stream(grant_id="short"), ["grant_id"]),
        ("ttl NaN", INVALID, f.stream(ttl_s=float("nan")), ["ttl_s"]),
        ("to_tenant", INVALID, f.stream(to_tenant="t" * 300), ["to_tenant"]),
    ]
    for what, code, messages, words in cases:
        got, details, _ = import_kv(s2, "a", messages)
        assert got == code, (what, got, details)
        for w in words:
            assert w in details, (what, details)
        assert name not in details, (what, details)
        pools.unchanged(what)
        refused_call(NOT_FOUND, probe.copy_blocks, probe_space.space_id, [0], grant_id=name, source_block_ids=[0])

    # The well-formed forgery of the same name goes through: the forgeries failed for their fault alone.
    got, details, data = import_kv(s2, "a", [head, first, rest, end])
    assert got == grpc.StatusCode.OK, details
    answer = pb.ImportKVResponse.FromString(data)
    assert (answer.seq_id, answer.blocks, answer.records, answer.bytes) == (
        "",
        10 * LAYERS,
        len(keys),
        len(keys) * RECORD,
    )
    assert grant_metrics(s2) == (1, 10 * LAYERS)
    # Taken, it decodes as the reference says over the K/V the stream carried (the planes not sent: zeros, unread).
    with at(s2) as c2:
        dest = c2.open_block_space(DEST)
        ids = shuffled(10, DEST, seed=51)
        assert c2.copy_blocks(dest.space_id, ids, grant_id=name).num_tokens == PREFILL
        taken = Held(c2, dest.space_id, KVCacheManager(DEST, BS))
        taken.kv.tables[0, "s"] = list(ids)
        taken.kv.free = [b for b in taken.kv.free if b not in ids]
        ref = ReferenceModel.for_server(c2.info())
        zeros = np.zeros((HKV, BS, D), np.float32)
        for layer in range(LAYERS):  # [tokens, HKV, D] from the records' [HKV, BS, D]
            pages = [f.kv.get((layer, b), (zeros, zeros)) for b in range(10)]
            keys_of, values_of = (np.concatenate([p[i].transpose(1, 0, 2) for p in pages]) for i in (0, 1))
            ref.attend(layer, [BatchEntry("s", 0, PREFILL)], np.zeros((PREFILL, 4, D), np.float32), keys_of, values_of)
        rng = np.random.default_rng(52)
        for layer, out in enumerate(taken.decode(PREFILL, seed=52)):
            q, k, v = qkv(rng, 1)
            close_enough(out, ref.attend(layer, [BatchEntry("s", PREFILL, 1)], q, k, v))
        c2.close_block_space(dest.space_id)
    assert grant_metrics(s2) == (0, 0)
    pools.unchanged("the forgery taken")
    probe.close_block_space(probe_space.space_id)
    probe.close()


# -- float8 -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess]]:
    """Two e4m3 servers with the same --kv-scales, and a third with others."""
    d = tmp_path_factory.mktemp("fp8-scales")
    ours, theirs = d / "ours.json", d / "theirs.json"
    ours.write_text(json.dumps({"k_scale": 0.02, "v_scale": [0.05, 0.03, 0.02, 0.01]}))
    theirs.write_text(json.dumps({"k_scale": 0.02, "v_scale": [0.05, 0.03, 0.04, 0.01]}))
    flags = [*SMALL, "--num-blocks", "256", "--idle-timeout-s", "0", "--kv-cache-dtype", "fp8_e4m3", "--kv-scales"]
    with contextlib.ExitStack() as stack:
        f1, f2, f3 = (stack.enter_context(ServerProcess(*flags, str(path))) for path in (ours, ours, theirs))
        yield f1, f2, f3


def test_a_float8_grant_between_servers_of_the_same_scales_decodes_bitwise_and_others_refuse_it(
    fp8: tuple[ServerProcess, ServerProcess, ServerProcess],
) -> None:
    f1, f2, f3 = fp8
    with at(f1, None) as c1, at(f2, None) as c2:
        assert c1.info().cache_dtype == "float8_e4m3"
        space = c1.open_block_space(SPACE)
        held = Held(c1, space.space_id, KVCacheManager(SPACE, BS, seed=60))
        held.prefill(PREFILL, seed=61)
        pools = Pools([(f1, None), (f2, None), (f3, None)])
        name = grant_name()
        message = grant_refused(
            INVALID, c1.grant_blocks, space.space_id, held.table, name, num_tokens=PREFILL, target=f3.target
        )
        for w in ("float8 KV is held over scales", "layer 2", "--kv-scales", f3.target):
            assert w in message, message
        pools.unchanged("other scales")
        grant = c1.grant_blocks(space.space_id, held.table, name, num_tokens=PREFILL, target=f2.target)
        live = live_records(PREFILL, len(held.table))
        assert (grant.records, grant.network_bytes) == (len(live), len(live) * 2 * HKV * BS * D)  # a byte a value
        dest = c2.open_block_space(DEST)
        ids = shuffled(len(held.table), DEST, seed=62)
        c2.copy_blocks(dest.space_id, ids, grant_id=name)
        taken = held.moved(c2, dest.space_id, ids, DEST)
        same(held.decode(PREFILL, seed=63), taken.decode(PREFILL, seed=63))
        same(held.decode(PREFILL + 1, seed=64), taken.decode(PREFILL + 1, seed=64))
        assert [(x.k_scale, x.v_scale) for x in c2.info().layers] == [(x.k_scale, x.v_scale) for x in c1.info().layers]
        c2.close_block_space(dest.space_id)
        c1.close_block_space(space.space_id)
    assert [grant_metrics(s) for s in fp8] == [(0, 0)] * 3


# -- review of #38: a push cut short leaves nothing; whole grants -------------------------------------------------


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A target that accepts connections and never answers (a host that froze): a push to it runs into the
    caller's deadline, mid-connection."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_pushes_cut_short_by_their_deadline_leave_nothing_parked(server: ServerProcess, a_space: Held) -> None:
    """A client that gives up on a push (its deadline, at any moment of it) leaves no grant, no name and no block
    on the grantor: the grant is released as the call ends, whether it ended normally or was cancelled."""
    with at(server) as c:
        free = c.info().free_blocks
    names = []
    with black_hole() as nowhere:
        for i, deadline in enumerate([0.005, 0.02, 0.05, 0.1, 0.2, 0.3]):
            with ChunkAttnClient(server.target, token=TOKENS["a"], timeout_s=deadline) as hurried:
                names.append(grant_name())
                with pytest.raises(ChunkAttnError) as e:
                    hurried.grant_blocks(a_space.space_id, a_space.table, names[-1], num_tokens=PREFILL, target=nowhere)
                assert e.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, UNAVAILABLE), (i, e.value)

    def clean() -> bool:
        with at(server) as c:
            return c.info().free_blocks == free and grant_metrics(server) == (0, 0)

    wait_for(clean, message="a push cut short left blocks parked on the grantor")
    for name in names:  # every name free again: a grant of it goes through
        with at(server) as c:
            c.grant_blocks(a_space.space_id, a_space.table[:1], name, ttl_s=1)
    assert counter(server.metrics(), "chunkattn_handoffs_total", op="grant", code="INTERNAL") == 0


def test_a_whole_grant_sends_every_plane_of_every_block(server: ServerProcess, s2: ServerProcess) -> None:
    """whole: every (plane, block) record, so that a taker may read past the window of the last token (a prefix
    cache serving the blocks to another prompt): a position of an earlier chunk decodes as at home."""
    with at(server) as c1, at(s2) as c2:
        space = c1.open_block_space(SPACE)
        held = Held(c1, space.space_id, KVCacheManager(SPACE, BS, seed=11))
        held.prefill(PREFILL, seed=12)
        blocks = len(held.table)
        name = grant_name()
        sent = c1.grant_blocks(
            space.space_id, held.table, name, num_tokens=PREFILL, target=s2.target, target_token=TOKENS["a"], whole=True
        )
        assert (sent.records, sent.network_bytes) == (blocks * LAYERS, blocks * LAYERS * RECORD)
        dest = c2.open_block_space(DEST)
        ids = shuffled(blocks, DEST, seed=13)
        c2.copy_blocks(dest.space_id, ids, grant_id=name)
        there = held.moved(c2, dest.space_id, ids, DEST)
        # Position 20 is in the chunk [16, 32): a live-only grant of 40 tokens carries no chunked plane of it.
        same(held.decode(20, seed=14), there.decode(20, seed=14))
        c1.close_block_space(space.space_id)
        c2.close_block_space(dest.space_id)
