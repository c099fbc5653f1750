"""The RPC scaffolding's parts on their own: admission, parsing and its explanations, the limits' texts."""

from __future__ import annotations

import asyncio

import pytest

from chunkattn_client import wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import bounded, dial_target, id_problem, quote, some, target_problem
from chunkattn_server.errors import InvalidArgument, Overloaded
from chunkattn_server.service.rpc import SMALL_REQUEST_BYTES, Admission, parse_now

MIB = 1 << 20


def test_admission_refuses_past_the_calls_and_the_bytes_and_frees_on_release() -> None:
    a = Admission(max_calls=2, max_bytes=10 * MIB)
    first = a.admit(6 * MIB)
    with pytest.raises(Overloaded, match="--max-inflight-mib"):
        a.admit(6 * MIB)
    small = a.admit(SMALL_REQUEST_BYTES)  # small requests are never refused for bytes
    with pytest.raises(Overloaded, match="--max-concurrent-rpcs 2"):
        a.admit(0)
    a.admit(0, refusable=False).release()  # a stream already admitted goes on
    first.release()
    first.release()  # idempotent
    small.release()
    assert (a.calls, a.bytes) == (0, 0)


def test_a_streams_next_message_waits_for_room_and_then_goes_on() -> None:
    async def main() -> list[str]:
        a = Admission(max_calls=0, max_bytes=10 * MIB)
        held = a.admit(8 * MIB)
        order: list[str] = []

        async def later() -> None:
            with await a.admit_when_room(4 * MIB):
                order.append("admitted")

        task = asyncio.ensure_future(later())
        await asyncio.sleep(0.01)
        order.append("waiting")
        held.release()
        await task
        assert (a.calls, a.bytes) == (0, 0)
        return order

    assert asyncio.run(main()) == ["waiting", "admitted"]


def test_parse_names_the_field_and_bounds_the_fields_it_reads() -> None:
    with pytest.raises(InvalidArgument, match="seq_ids: not valid UTF-8"):
        parse_now(pb.ReleaseRequest, b"\x0a\x01\xff")
    many = b"\x0a\x01a" * 9000
    with pytest.raises(InvalidArgument, match="more than 8208 fields"):
        parse_now(pb.ReleaseRequest, many, 8208)
    assert len(parse_now(pb.ReleaseRequest, many).seq_ids) == 9000
    # A fault after more fields than explain reads is placed, not searched for.
    why = wire.explain(pb.ReleaseRequest.DESCRIPTOR, b"\x10\x00" * 100_000 + b"\x0a\x01\xff")
    assert why == f"the first {wire.EXPLAIN_FIELDS} fields parse; the fault lies past byte {2 * wire.EXPLAIN_FIELDS}"


def test_messages_quote_a_prefix_and_a_few_ids() -> None:
    assert quote("abc") == "'abc'"
    assert quote("x" * 1000) == f"{'x' * 64!r}... (1000 bytes)"
    assert some(["a", "b", "c", "d", "e"]) == "'a', 'b', 'c' and 2 more"
    assert len(bounded("y" * 100_000)) <= 2048
    assert id_problem("ok") is None
    assert "at most 256 bytes of UTF-8, got 257" in (id_problem("é" * 128 + "a") or "")
    assert "non-empty" in (id_problem("") or "")


@pytest.mark.parametrize(
    ("target", "ok"),
    [
        ("localhost:50051", True),
        ("decode_1:50051", True),  # Docker's container names
        ("10.0.0.2:1", True),
        ("[::1]:65535", True),
        ("dns:///prefill.example:443", True),
        ("ipv4:127.0.0.1:80", True),
        ("ipv6:[::1]:80", True),
        ("", False),
        ("host", False),
        ("host:0", False),
        ("host:65536", False),
        ("host:+1", False),
        ("ipv4:999", False),
        ("ipv4:localhost:1", False),
        ("dns:///", False),
        ("unix:/tmp/socket", False),
        ("unix:50051", False),  # gRPC reads it as the Unix socket "50051", not host "unix"
        ("UNIX-abstract:1", False),
        ("vsock:1:2", False),
        ("unixhost:1", True),
        ("[nonsense]:1", False),
        ("a b:1", False),
        ("a" * 600 + ":1", False),
    ],
)
def test_targets(target: str, ok: bool) -> None:
    assert (target_problem(target) is None) == ok, target_problem(target)


@pytest.mark.parametrize(
    ("target", "dialed"),
    [
        ("dns:1", "dns:///dns:1"),  # host "dns", port 1, as checked (gRPC alone: the DNS name "1", port 443)
        ("fake:1", "dns:///fake:1"),  # gRPC alone: its test resolver "fake"
        ("google-c2p-experimental:443", "dns:///google-c2p-experimental:443"),
        ("[::1]:5", "dns:///[::1]:5"),
        ("dns:///h:1", "dns:///h:1"),
        ("ipv4:127.0.0.1:80", "ipv4:127.0.0.1:80"),
        ("ipv6:[::1]:80", "ipv6:[::1]:80"),
    ],
)
def test_a_bare_target_is_dialed_as_the_host_and_port_it_was_checked_as(target: str, dialed: str) -> None:
    assert target_problem(target) is None
    assert dial_target(target) == dialed
