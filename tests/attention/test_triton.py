"""The triton backend's kernels under Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).

Shapes are tiny: the interpreter runs every program of the grid in Python (milliseconds per inner-loop
step). fp32 and fp16 only: the interpreter computes bf16 wrongly (../shared/ENVIRONMENT.md); bf16 is
checked on a GPU by benchmarks/gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkattn_client import BatchEntry
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.attention.backends import TorchBackend
from chunkattn_server.attention.backends.base import AttentionBatch
from chunkattn_server.attention.backends.triton_backend import TritonBackend, TritonLaunchError
from chunkattn_server.engine.device import make_backend
from chunkattn_server.errors import ConfigError
from tests.helpers.harness import MODELS, NATIVE_PROBLEM, Harness

CPU = torch.device("cpu")


def _scenario(h: Harness, layers: tuple[int, ...] = (0, 1)) -> None:
    """Prefill across a chunk boundary, a second sequence joining, decodes at, before and after the next
    boundary (C = 8, blocks of 4: by then the first chunk's blocks are freed, so tables have holes)."""
    for layer in layers:
        h.call(layer, [BatchEntry("a", 0, 11)])  # chunks [0, 8) and [8, 11)
        h.call(layer, [BatchEntry("a", 11, 4), BatchEntry("b", 0, 3)])  # b: a fresh sequence beside a prefill
        for pos in range(15, 18):  # 15: the last of chunk 1; 16: the first of chunk 2
            h.call(layer, [BatchEntry("a", pos, 1), BatchEntry("b", pos - 12, 1)])


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_head_sizes_and_gqa_ratios_match_the_reference(head_size: int, group: int) -> None:
    model = ModelShape(
        num_heads=group, num_kv_heads=1, head_size=head_size, layers=(LayerSpec(8), LayerSpec(0))
    )  # fmt: skip
    h = Harness.build(model, impl="triton")
    _scenario(h)
    info = h.engine.kv.sequence("a", tenant="")
    assert info is not None
    assert min(info.tables[0]) >= 2  # layer 0's blocks before its current chunk are gone


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_kind_in_both_dtypes(model: str, dtype: str) -> None:
    """GQA, MQA, ALiBi (chunked and global) and KV-sharing layers."""
    h = Harness.build(MODELS[model], impl="triton", dtype=dtype)
    for entries in ([BatchEntry("a", 0, 10), BatchEntry("b", 0, 1)], [BatchEntry("a", 10, 1), BatchEntry("b", 1, 9)]):
        h.step(entries)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize(("model", "layer"), [("gqa", 2), ("gqa", 3), ("alibi", 0)])  # global; C = 16; ALiBi C = 8
def test_split_decodes_merge_exactly(splits: int, model: str, layer: int) -> None:
    """Flash-decoding: each split sees part of the context; the combine kernel merges them."""
    h = Harness.build(MODELS[model], impl="triton", splits=splits)
    h.call(layer, [BatchEntry("a", 0, 37), BatchEntry("b", 0, 5)])
    for pos in range(37, 41):  # chunked layers: 40 starts a chunk with C = 8, not with C = 16
        h.call(layer, [BatchEntry("a", pos, 1), BatchEntry("b", pos - 32, 1)])


@pytest.mark.parametrize("group", [3, 5])  # not powers of two (Llama-4-Scout has 5 query heads per KV head)
@pytest.mark.parametrize("splits", [1, 3])
def test_query_head_groups_that_are_not_powers_of_two(group: int, splits: int) -> None:
    model = ModelShape(num_heads=2 * group, num_kv_heads=2, head_size=32, layers=(LayerSpec(8), LayerSpec(0)))
    h = Harness.build(model, impl="triton", splits=splits)
    _scenario(h)


@st.composite
def batches(draw: st.DrawFn) -> list[list[tuple[str, int]]]:
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        ids = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True))
        steps.append([(i, draw(st.one_of(st.just(1), st.integers(1, 19)))) for i in ids])
    return steps


@settings(max_examples=8)
@given(batches(), st.sampled_from(["float32", "float16"]))
def test_triton_and_torch_backends_agree_on_random_batches(steps: list[list[tuple[str, int]]], dtype: str) -> None:
    model = MODELS["gqa"]
    triton_h = Harness.build(model, impl="triton", dtype=dtype)
    torch_h = Harness.build(model, dtype=dtype)
    lengths: dict[str, int] = {}
    for step in steps:
        entries = [BatchEntry(s, lengths.get(s, 0), n) for s, n in step]
        for layer in (0, 2):  # C = 8 and global
            ours = triton_h.call(layer, entries)  # each also checked against the reference
            theirs = torch_h.call(layer, entries)
            tol = 1e-5 if dtype == "float32" else 2e-2 * float(theirs.abs().max())
            assert float((ours.double() - theirs.double()).abs().max()) <= tol
        for s, n in step:
            lengths[s] = lengths.get(s, 0) + n


def test_write_kernel_stores_rows_at_their_slots() -> None:
    backend = TritonBackend(CPU, block_n=16)
    pages = [torch.zeros(2, 6, 4, 80) for _ in range(4)]
    k, v = torch.randn(5, 2, 80), torch.randn(5, 2, 80)
    slots = torch.tensor([3, 17, 4, 22, 8])
    backend.write(pages[0], pages[1], slots, k, v)
    TorchBackend(CPU).write(pages[2], pages[3], slots, k, v)
    assert torch.equal(pages[0], pages[2])
    assert torch.equal(pages[1], pages[3])


def _batch(**change: object) -> tuple[AttentionBatch, torch.Tensor]:
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    pages = torch.zeros(2, 8, 4, 16)
    fields: dict[str, object] = {
        "q": q, "k": k, "v": k.clone(), "k_pages": pages, "v_pages": pages.clone(), "spans": [(0, 0, 3)],
        "tables": [{}], "chunk_size": 8, "block_size": 4, "scale": 0.25, "alibi_slopes": None,
    }  # fmt: skip
    fields |= change
    out = change.pop("out", None)
    return AttentionBatch(**{k_: v_ for k_, v_ in fields.items() if k_ != "out"}), (  # type: ignore[arg-type]
        out if isinstance(out, torch.Tensor) else torch.empty(3, 4, 16)
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.randn(3, 3, 16)}, "not a multiple of 2 KV heads"),
        ({"k": torch.randn(2, 2, 16)}, "k/v"),
        ({"q": torch.randn(3, 4, 16).half()}, "must share one of"),
        ({"q": torch.randn(3, 16, 4).transpose(1, 2)}, "q needs a contiguous last dimension"),
        ({"out": torch.empty(3, 4, 8)}, "out (3, 4, 8) must be q's shape"),
        ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, "alibi_slopes must be [H] float32"),
        ({"spans": [(0, 5, 3)], "tables": [{0: 1}]}, "logical block 1 is needed"),
        ({"block_size": 8}, "pages of 4 tokens, batch says 8"),
    ],
)
def test_launch_checks_refuse_bad_batches_before_running(change: dict[str, object], message: str) -> None:
    batch, out = _batch(**change)
    with pytest.raises(TritonLaunchError) as e:
        TritonBackend(CPU).attend(batch, out)
    assert message in str(e.value)


def test_the_engine_picks_triton_on_cuda_and_native_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert make_backend("auto", CPU).name == ("torch" if NATIVE_PROBLEM else "native")
    assert make_backend("triton", CPU).name == "triton"  # the interpreter is on in tests
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="--backend torch"):
        make_backend("triton", CPU)
    with pytest.raises(ConfigError, match="backend must be one of auto, torch, native, triton"):
        EngineConfig(MODELS["gqa"], CacheConfig(block_size=4), backend="cudnn")
    for bad in ({"block_n": 24}, {"num_splits": 0}, {"prefill_rows": 8}):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(ConfigError, match="must be"):
            TritonBackend(CPU, **bad)


def test_an_engine_configured_for_triton_serves_through_it() -> None:
    engines = [
        Engine(EngineConfig(MODELS["mqa"], CacheConfig(block_size=4, num_blocks=32), device="cpu", backend=name))
        for name in ("triton", "torch")
    ]
    assert [e.backend.name for e in engines] == ["triton", "torch"]
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    ours, theirs = (e.attend(0, [BatchEntry("s", 0, 5)], q, k, v, tenant="") for e in engines)
    assert float((ours - theirs).abs().max()) <= 1e-5
