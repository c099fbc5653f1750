"""Every bad request raises a typed error that says what was wrong and changes nothing.

Each case runs on an engine with live sequences, then checks that (1) the sequences, block tables and
pool are exactly as before, and (2) a valid continuation gives bit-identical outputs to a twin engine
that never saw the bad request.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_client.work import PIECE_WORK
from chunkattn_server import CacheConfig, Engine, EngineConfig
from chunkattn_server.errors import (
    EngineError,
    InvalidArgument,
    InvalidBatch,
    InvalidTensor,
    OutOfBlocks,
    PositionMismatch,
    UnknownLayer,
    UnknownSequence,
)
from chunkattn_server.service.status import status_code
from tests.helpers.harness import MODELS, Exploding, Harness, snapshot
from tests.helpers.tensors import torch_qkv

MODEL = MODELS["sharing"]  # layers: 0 (C=8), 1 shares 0, 2 (global), 3 shares 2; 4 heads, 2 KV heads, D=8
H, HKV, D = MODEL.num_heads, MODEL.num_kv_heads, MODEL.head_size


def _q(t: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(t, H, D).to(dtype)


def _kv(t: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(t, HKV, D).to(dtype)


def _history(h: Harness) -> None:
    """Two live sequences: 'a' with 10 tokens (past a chunk boundary), 'b' with 3."""
    h.step([BatchEntry("a", 0, 10), BatchEntry("b", 0, 3)])


def _continue(h: Harness) -> list[torch.Tensor]:
    h.seed = 1000  # same inputs on both engines
    outs = []
    for layer in range(MODEL.num_layers):
        outs.append(h.call(layer, [BatchEntry("b", 3, 6), BatchEntry("a", 10, 1), BatchEntry("c", 0, 2)]))
    return outs


BAD: dict[str, tuple[Callable[[Engine], object], type[EngineError], str]] = {
    "unknown layer": (
        lambda e: e.attend(7, [BatchEntry("b", 3, 1)], _q(1), _kv(1), _kv(1), tenant=""),
        UnknownLayer,
        "layers 0..3",
    ),
    "negative layer": (
        lambda e: e.attend(-1, [BatchEntry("b", 3, 1)], _q(1), _kv(1), _kv(1), tenant=""),
        UnknownLayer,
        "layer -1",
    ),
    "empty batch": (lambda e: e.attend(0, [], _q(0), _kv(0), _kv(0), tenant=""), InvalidBatch, "empty"),
    "zero tokens": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1), BatchEntry("a", 10, 0)], _q(1), _kv(1), _kv(1), tenant=""),
        InvalidBatch,
        "num_tokens must be an integer >= 1",
    ),
    "negative position": (
        lambda e: e.attend(0, [BatchEntry("z", -1, 1)], _q(1), _kv(1), _kv(1), tenant=""),
        InvalidBatch,
        ">= 0",
    ),
    "not a BatchEntry": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1), ("a", 10, 1)], _q(2), _kv(2), _kv(2), tenant=""),  # type: ignore[list-item]
        InvalidBatch,
        "entry 1 is a tuple; expected a BatchEntry",
    ),
    "empty id": (
        lambda e: e.attend(0, [BatchEntry("", 0, 1)], _q(1), _kv(1), _kv(1), tenant=""),
        InvalidBatch,
        "non-empty",
    ),
    "duplicate sequence": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1), BatchEntry("b", 3, 1)], _q(2), _kv(2), _kv(2), tenant=""),
        InvalidBatch,
        "appears twice",
    ),
    "q token count": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 2)], _q(3), _kv(2), _kv(2), tenant=""),
        InvalidTensor,
        "expected [2, 4, 8]",
    ),
    "k head count": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 2)], _q(2), torch.randn(2, 4, D), _kv(2), tenant=""),
        InvalidTensor,
        "expected [2, 2, 8]",
    ),
    "v head size": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 2)], _q(2), _kv(2), torch.randn(2, HKV, 4), tenant=""),
        InvalidTensor,
        "v has shape",
    ),
    "q dtype": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1)], _q(1, torch.float64), _kv(1), _kv(1), tenant=""),
        InvalidTensor,
        "expected float32, float16 or bfloat16",
    ),
    "k dtype differs from q": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1)], _q(1), _kv(1, torch.float16), _kv(1), tenant=""),
        InvalidTensor,
        "expected q's dtype",
    ),
    "missing k/v": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1)], _q(1), tenant=""),
        InvalidTensor,
        "k and v are required",
    ),
    "k/v to a KV-sharing layer": (
        lambda e: e.attend(1, [BatchEntry("b", 3, 1)], _q(1), _kv(1), _kv(1), tenant=""),
        InvalidTensor,
        "KV sharing",
    ),
    "unknown sequence": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1), BatchEntry("ghost", 5, 1)], _q(2), _kv(2), _kv(2), tenant=""),
        UnknownSequence,
        "'ghost' does not exist",
    ),
    "position behind": (
        lambda e: e.attend(0, [BatchEntry("b", 3, 1), BatchEntry("a", 9, 1)], _q(2), _kv(2), _kv(2), tenant=""),
        PositionMismatch,
        "next position is 10; got position 9",
    ),
    "position ahead": (
        lambda e: e.attend(2, [BatchEntry("a", 11, 1)], _q(1), _kv(1), _kv(1), tenant=""),
        PositionMismatch,
        "next position is 10",
    ),
    "KV-sharing layer ahead of its source": (
        lambda e: e.attend(3, [BatchEntry("b", 3, 1)], _q(1), tenant=""),
        PositionMismatch,
        "layer 2 to be called first",
    ),
    "out of blocks": (
        # 'b' fits; the 400-token newcomer on the global layer needs 100 blocks of 4 and the pool has 64.
        lambda e: e.attend(
            2, [BatchEntry("b", 3, 1), BatchEntry("big", 0, 400)], _q(401), _kv(401), _kv(401), tenant=""
        ),
        OutOfBlocks,
        "needs 100 new KV blocks",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_refused_and_changes_nothing(case: str) -> None:
    bad, error, message = BAD[case]
    h = Harness.build(MODEL, num_blocks=64)
    twin = Harness.build(MODEL, num_blocks=64)
    _history(h)
    _history(twin)
    before = snapshot(h.engine)

    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        bad(h.engine)

    assert snapshot(h.engine) == before
    for ours, theirs in zip(_continue(h), _continue(twin), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidBatch("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (InvalidTensor("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (UnknownLayer("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (UnknownSequence("x"), grpc.StatusCode.NOT_FOUND),
        (PositionMismatch("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (OutOfBlocks("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_one_table_maps_errors_to_status_codes(error: Exception, code: grpc.StatusCode) -> None:
    assert status_code(error) == code


def test_every_request_error_is_an_invalid_argument_or_has_its_own_status() -> None:
    for _, error, _ in BAD.values():
        assert status_code(error("x")) != grpc.StatusCode.INTERNAL
        assert issubclass(error, EngineError)
    assert issubclass(UnknownLayer, InvalidArgument)


def test_failure_inside_the_call_rolls_back() -> None:
    h = Harness.build(MODEL, num_blocks=64)
    twin = Harness.build(MODEL, num_blocks=64)
    _history(h)
    _history(twin)
    before = snapshot(h.engine)
    backend = h.engine.backend
    h.engine.backend = Exploding(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="fell over"):
        # New sequence + growth into new blocks (K/V already written): all must be undone.
        h.engine.attend(0, [BatchEntry("b", 3, 9), BatchEntry("new", 0, 5)], _q(14), _kv(14), _kv(14), tenant="")
    assert snapshot(h.engine) == before
    h.engine.backend = backend
    for ours, theirs in zip(_continue(h), _continue(twin), strict=True):
        assert torch.equal(ours, theirs)


def test_a_generator_of_entries_is_read_once_and_served() -> None:
    h = Harness.build(MODEL, num_blocks=64)
    out = h.engine.attend(0, (BatchEntry(s, 0, 2) for s in ("x", "y")), _q(4), _kv(4), _kv(4), tenant="")  # type: ignore[arg-type]
    assert out.shape == (4, H, D)
    assert h.engine.kv.sequence("y", tenant="").lengths[0] == 2


def test_release_unknown_is_refused_unless_missing_ok() -> None:
    h = Harness.build(MODEL, num_blocks=64)
    _history(h)
    before = snapshot(h.engine)
    with pytest.raises(UnknownSequence, match="nothing was released"):
        h.engine.kv.release(["a", "nope"], tenant="")
    assert snapshot(h.engine) == before
    assert h.engine.kv.release(["a", "nope"], missing_ok=True, tenant="") == 1
    assert h.engine.kv.sequence_ids(tenant="") == ["b"]


@pytest.mark.parametrize("wire", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compute", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_fails_its_own_call_of_a_merged_step_in_every_dtype(
    wire: torch.dtype, compute: str, value: float
) -> None:
    """Issue 27.7 and its review: a float16/bfloat16 inf under another compute dtype once crashed the check
    (IndexError) and failed every call merged into the step. Each bad call fails alone, naming its row."""
    from chunkattn_server.engine.types import AttendCall

    h = Harness.build(MODEL, compute_dtype=compute)
    good = AttendCall((BatchEntry("good", 0, 3),), _q(3, wire), _kv(3, wire), _kv(3, wire), "")
    for tensor in ("q", "k", "v"):
        q, k, v = _q(2, wire), _kv(2, wire), _kv(2, wire)
        {"q": q, "k": k, "v": v}[tensor][1, 0, 3] = value
        bad = AttendCall((BatchEntry("bad", 0, 2),), q, k, v, "")
        before = snapshot(h.engine)
        out = h.engine.attend_step(0, [bad, good])
        assert isinstance(out[0], InvalidTensor), out[0]
        assert f"{tensor} row 1 (sequence 'bad' at position 1) holds {value}" in str(out[0])
        assert isinstance(out[1], torch.Tensor)
        assert torch.isfinite(out[1]).all()
        h.engine.kv.release(["good"], tenant="")
        assert snapshot(h.engine) == before


def test_a_call_past_the_work_bound_is_refused_and_changes_nothing() -> None:
    """Issue 35.4: a long global prefill holds the engine while every other call waits. With max_call_work
    PIECE_WORK + 100, 14 new tokens at 0 on the global layer (1 + 2 + ... + 14 = 105 query-key pairs, one piece)
    are refused, naming both counts, and nothing changes; 13 (91 pairs) are served. On the chunked layer (C = 4)
    4 tokens in one chunk are one piece, 5 over two chunks two: past it; decodes pay no piece."""
    model = MODELS["mqa"]  # layer 0: C = 4, layer 1: global
    bound = PIECE_WORK + 100
    config = EngineConfig(model, CacheConfig(block_size=4, num_blocks=64), device="cpu", max_call_work=bound)
    engine = Engine(config)
    rng = np.random.default_rng(35)
    shape = {"heads": model.num_heads, "kv_heads": model.num_kv_heads, "head_size": model.head_size}
    before = snapshot(engine)
    with pytest.raises(InvalidBatch, match=rf"call's work is {PIECE_WORK + 105:,} .* at most {bound:,} per call"):
        engine.attend(1, [BatchEntry("s", 0, 14)], *torch_qkv(rng, 14, **shape), tenant="")
    assert snapshot(engine) == before
    engine.attend(1, [BatchEntry("s", 0, 13)], *torch_qkv(rng, 13, **shape), tenant="")
    engine.attend(0, [BatchEntry("c", 0, 4)], *torch_qkv(rng, 4, **shape), tenant="")
    with pytest.raises(InvalidBatch, match=rf"call's work is {2 * PIECE_WORK + 11:,}"):
        engine.attend(0, [BatchEntry("c", 4, 5)], *torch_qkv(rng, 5, **shape), tenant="")  # keys 1, 2, 3, 4 | 1
    for position in range(4, 40):  # decodes: their keys only
        engine.attend(0, [BatchEntry("c", position, 1)], *torch_qkv(rng, 1, **shape), tenant="")
