"""The block API's test server and callers, shared by tests/service/test_block_api_*.py: its tenants and
their tokens, a client or a raw caller under a tenant's token, block requests built from the proto's words, and
the checks of an answer (the server itself is the ``server`` fixture of tests/service/conftest.py)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import torch

from chunkattn_client import BlockRows, ChunkAttnClient, codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import MAX_MESSAGE_CHARS
from chunkattn_client.reference import within_tolerance
from chunkattn_server.service.auth import token_digest
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.rawrpc import BIG, SERVICE, Answer
from tests.helpers.server_process import ServerProcess, counter

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


def tenants_file(tmp_path: Path, *names: str) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tenants": {n: {"tokens_sha256": [token_digest(TOKENS[n])]} for n in names}}))
    path.chmod(0o600)
    return str(path)
