"""The x-chunkattn-route header: what each client sends, as a server sees it (an in-process recorder)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from chunkattn_client import ChunkAttnClient
from chunkattn_client._channel import ROUTE_HEADER
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.cli import main
from chunkattn_client.limits import MAX_ROUTE_CHARS


@pytest.fixture(scope="module")
def recorder() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A server whose Fork records each call's metadata and answers 0 shared blocks."""
    seen: list[dict[str, str]] = []

    def fork(request: pb.ForkRequest, context: grpc.ServicerContext) -> pb.ForkResponse:
        seen.append(dict(context.invocation_metadata()))  # type: ignore[arg-type]
        return pb.ForkResponse()

    handler = grpc.method_handlers_generic_handler(
        "chunkattn.v1.ChunkAttn",
        {
            "Fork": grpc.unary_unary_rpc_method_handler(
                fork,
                request_deserializer=pb.ForkRequest.FromString,
                response_serializer=pb.ForkResponse.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", seen
    server.stop(None)


def _routes(target: str, seen: list[dict[str, str]], client: Any) -> str | None:
    seen.clear()
    client.fork("a", "b")
    return seen[0].get(ROUTE_HEADER)


def test_each_client_has_its_own_key_unless_told(recorder: tuple[str, list[dict[str, str]]]) -> None:
    target, seen = recorder
    with ChunkAttnClient(target) as a, ChunkAttnClient(target) as b:
        key_a, key_b = _routes(target, seen, a), _routes(target, seen, b)
        assert key_a and key_b and key_a != key_b  # noqa: PT018 (one claim: two distinct keys)
        assert _routes(target, seen, a) == key_a  # stable for the client's life
    with ChunkAttnClient(target, route="session-7", token="t0k") as c:
        assert _routes(target, seen, c) == "session-7"
        assert seen[0]["authorization"] == "Bearer t0k"
        view = c.with_route("session-8")
        assert _routes(target, seen, view) == "session-8"
        assert seen[0]["authorization"] == "Bearer t0k"
        view.close()  # the view does not own the channel: the client still works
        assert _routes(target, seen, c) == "session-7"
    with ChunkAttnClient(target, route="") as c:
        assert _routes(target, seen, c) is None


@pytest.mark.parametrize("route", ["é", " x", "a\nb", "x" * (MAX_ROUTE_CHARS + 1)])
def test_a_key_that_cannot_travel_is_refused_before_any_call(route: str) -> None:
    with pytest.raises(ValueError, match="route"):
        ChunkAttnClient("127.0.0.1:1", route=route)


def test_the_cli_routes_a_fork_by_its_parent(
    recorder: tuple[str, list[dict[str, str]]], capsys: pytest.CaptureFixture[str]
) -> None:
    target, seen = recorder
    seen.clear()
    assert main(["kv", "fork", "--target", target, "parent-1", "child-1"]) == 0
    assert seen[0][ROUTE_HEADER] == "parent-1"
    assert main(["kv", "fork", "--target", target, "--route", "mine", "p", "c"]) == 0
    assert seen[1][ROUTE_HEADER] == "mine"
    assert main(["kv", "fork", "--target", target, "--route", "bad key ", "p", "c"]) == 2
    assert "route" in capsys.readouterr().err


def test_kv_import_of_a_file_that_is_not_an_export_is_a_usage_error(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"\x03\x00\x00\x00\xff\xff\xff")  # one 3-byte message that is no KVChunk
    assert main(["kv", "import", str(bad), "--target", "127.0.0.1:1"]) == 2
    assert "not a KV export file" in capsys.readouterr().err
