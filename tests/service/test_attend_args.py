"""The service's side of an Attend call: a request becomes domain types (AttendArgs: checked Entries, the
ids to release after it) where it is parsed, checked in the order the engine checks."""

from __future__ import annotations

import numpy as np
import pytest

from chunkattn_client import codec
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_server.engine.entries import Entries
from chunkattn_server.errors import InvalidBatch, InvalidTensor, UnknownLayer
from chunkattn_server.service.attend import AttendArgs, read_attend_request
from tests.helpers.harness import MODELS

MODEL = MODELS["gqa"]
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


def request(
    layer: int = 0, entries: tuple[tuple[str, int, int, bool], ...] = (("a", 0, 1, True),), **kw: bool
) -> bytes:
    tokens = sum(e[2] for e in entries)
    q = np.zeros((tokens, MODEL.num_heads, MODEL.head_size), np.float32)
    kv = np.zeros((tokens, MODEL.num_kv_heads, MODEL.head_size), np.float32)
    r = pb.AttendRequest(
        request_id=7,
        layer=layer,
        entries=[pb.SequenceEntry(seq_id=s, position=p, num_tokens=n, end_of_sequence=end) for s, p, n, end in entries],
    )
    if not kw.get("no_q"):
        r.q.CopyFrom(codec.encode(q))
    r.k.CopyFrom(codec.encode(kv))
    if not kw.get("no_v"):
        r.v.CopyFrom(codec.encode(kv))
    return r.SerializeToString()


def test_a_request_becomes_checked_entries_and_the_ids_it_ends() -> None:
    request_id, args = read_attend_request(request(entries=(("a", 0, 2, False), ("b", 3, 1, True))), MODEL, "")
    assert request_id == 7
    assert isinstance(args, AttendArgs)
    assert isinstance(args.entries, Entries)
    assert [(e.seq_id, e.position, e.num_tokens) for e in args.entries] == [("a", 0, 2), ("b", 3, 1)]
    assert args.ending == frozenset({"b"})
    assert args.q.shape == (3, MODEL.num_heads, MODEL.head_size)


def test_a_request_that_fails_its_checks_keeps_its_id() -> None:
    request_id, args = read_attend_request(request(entries=(("a", 0, 1, False), ("a", 1, 1, False))), MODEL, "")
    assert request_id == 7
    assert isinstance(args, InvalidBatch)
    assert "appears twice" in str(args)


def test_checks_run_in_the_engines_order() -> None:
    """Tensors present first, then the layer, then the entries."""
    twice = (("a", 0, 1, False), ("a", 1, 1, False))
    _, missing_q = read_attend_request(request(layer=99, entries=twice, no_q=True), MODEL, "")
    assert isinstance(missing_q, InvalidTensor)
    assert "q is missing" in str(missing_q)
    _, half_kv = read_attend_request(request(layer=99, entries=twice, no_v=True), MODEL, "")
    assert isinstance(half_kv, InvalidTensor)
    _, layer = read_attend_request(request(layer=99, entries=twice), MODEL, "")
    assert isinstance(layer, UnknownLayer)
