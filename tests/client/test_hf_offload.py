"""Remote attention offload for transformers (chunkattn_client.hf), through a real server subprocess.

The model is the example's (examples/hf_offload.py): a random-weight Llama 4 text model, 3 chunked layers
with C = 16 and a global NoPE layer whose temperature tuning acts from position 7. The reference is the
same model run by transformers alone with its own KV cache, one row at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from chunkattn_client import ChunkAttnClient, ChunkAttnError
from chunkattn_client.hf import (
    MESSAGE_HEADROOM,
    NAME,
    Generation,
    OffloadSession,
    SessionError,
    Transport,
    generate_locally,
)
from chunkattn_client.hfconfig import HFConfigError
from examples.hf_offload import build_model, example_config, max_logit_difference, prompts_of
from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.server

PROMPTS = [20, 7, 33]  # rows of different lengths; the prefill crosses the boundaries at 16 and 32
NEW = 20  # decoding to 40, 27 and 53 tokens crosses the next boundaries (32, 16 and 48)
LAYERS = 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(seed=0)


@pytest.fixture(scope="module")
def prompts(model: Any) -> list[list[int]]:
    return prompts_of(PROMPTS, model.config.vocab_size)


@pytest.fixture(scope="module")
def local(model: Any, prompts: list[list[int]]) -> Generation:
    return generate_locally(model, prompts, NEW, keep_logits=True)


def _server_for(config: Any, folder: Path, *flags: str) -> ServerProcess:
    config.save_pretrained(folder)
    return ServerProcess("--hf-config", str(folder / "config.json"), "--kv-memory-mib", "8", *flags)


@pytest.fixture(scope="module")
def server(model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with _server_for(model.config, tmp_path_factory.mktemp("hf")) as s:
        yield s


@pytest.fixture
def client(server: ServerProcess) -> Iterator[ChunkAttnClient]:
    with ChunkAttnClient(server.target, timeout_s=60) as c:
        yield c
        info = c.info()  # every test leaves the server as it found it
        assert (info.active_sequences, info.free_blocks) == (0, info.num_blocks)


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_offloaded_generation_equals_the_local_model(
    model: Any, prompts: list[list[int]], local: Generation, client: ChunkAttnClient, transport: Transport
) -> None:
    with OffloadSession(client, model, transport=transport) as session:
        assert model.config._attn_implementation == NAME
        result = session.generate(prompts, NEW, keep_logits=True)
        held = client.info()
        assert held.active_sequences == len(PROMPTS)
        assert held.free_blocks < held.num_blocks
    assert result.tokens == local.tokens
    assert max_logit_difference(result, local) <= 1e-4
    assert result.calls == LAYERS * NEW  # one call per layer per forward: the prefill and NEW - 1 decodes
    assert model.config._attn_implementation != NAME  # switched back on close
    info = client.info()
    assert (info.active_sequences, info.free_blocks) == (0, info.num_blocks)  # closing freed every block


def test_rows_may_bring_different_numbers_of_tokens_in_later_forwards_too(
    model: Any, prompts: list[list[int]], local: Generation, client: ChunkAttnClient
) -> None:
    """A forward where one row brings 9 tokens, one none and one a single token equals the local model.
    9 tokens at once: the model assumes positions 0..8 for the NoPE layer's temperature tuning, which
    changes from position 7 on (floor_scale 8), so the session's correction is exercised both ways."""
    assert local.logits is not None
    with OffloadSession(client, model, transport="unary") as session:
        session.forward(prompts)
        logits = session.forward([local.tokens[0][:9], [], local.tokens[2][:1]])
    assert [tuple(x.shape) for x in logits] == [(9, 512), (0, 512), (1, 512)]
    for j in range(8):  # the logits after token j chose token j + 1
        assert torch.allclose(logits[0][j], local.logits[0][j + 1], atol=1e-4), j
    assert torch.allclose(logits[2][0], local.logits[2][1], atol=1e-4)


def test_a_prefill_larger_than_a_message_goes_in_several_calls(
    model: Any, prompts: list[list[int]], local: Generation, server: ServerProcess
) -> None:
    """With 30 tokens' worth of q/k/v per message, the 60-token prefill takes 2 calls per layer."""
    per_token = (8 + 2 + 2) * 32 * 4
    with ChunkAttnClient(server.target, max_message_bytes=MESSAGE_HEADROOM + 30 * per_token) as small:
        with OffloadSession(small, model, transport="stream") as session:
            result = session.generate(prompts, NEW, keep_logits=True)
        assert small.info().active_sequences == 0
    assert result.calls == LAYERS * 2 + LAYERS * (NEW - 1)
    assert result.tokens == local.tokens
    assert max_logit_difference(result, local) <= 1e-4


def test_a_prefill_past_the_servers_work_bound_goes_in_calls_within_it(
    model: Any, prompts: list[list[int]], local: Generation, tmp_path: Path
) -> None:
    """Issue 35.4: a server bounds the work of one call (--max-call-work, Info's max_call_work: query-key pairs,
    and 8,192 per piece computed apart). At 3 pieces' worth, the 60-token prefill (6 pieces on a chunked layer,
    C = 16; 3 on the global one) goes in several calls per layer, within the bound; decodes pay no piece and go
    one call each; the tokens are the local model's."""
    with _server_for(model.config, tmp_path, "--max-call-work", "24576") as s, ChunkAttnClient(s.target) as c:
        assert c.info().max_call_work == 24576
        with OffloadSession(c, model, transport="stream") as session:
            result = session.generate(prompts, NEW, keep_logits=True)
        assert c.info().active_sequences == 0
    assert result.calls > LAYERS * 2 + LAYERS * (NEW - 1)
    assert result.tokens == local.tokens
    assert max_logit_difference(result, local) <= 1e-4


def test_a_verify_forward_and_a_truncate_equal_the_local_model_on_the_kept_tokens(
    model: Any, prompts: list[list[int]], local: Generation, tmp_path: Path
) -> None:
    """Speculative decoding through the session: one forward of each row's right tokens followed by wrong
    drafts, the drafts truncated (row 1's verify crosses the chunk boundary at 16 and goes back over it: the
    server keeps 8 tokens before the chunk), then the right tokens: logits as the local model's."""
    assert local.logits is not None
    accepted = [3, 4, 2]  # right tokens per row, then wrong ones
    wrong = [2, 7, 4]
    with _server_for(model.config, tmp_path, "--spec-window", "8") as s, ChunkAttnClient(s.target) as c:
        with OffloadSession(c, model, transport="stream") as session:
            session.forward(prompts)
            vocab = model.config.vocab_size
            drafts = [
                local.tokens[r][: accepted[r]]
                + [(t + 1) % vocab for t in local.tokens[r][accepted[r] : accepted[r] + wrong[r]]]
                for r in range(len(PROMPTS))
            ]
            verified = session.forward(drafts)
            for r in range(len(PROMPTS)):  # the accepted prefix is what the local model computed
                for j in range(accepted[r]):
                    assert torch.allclose(verified[r][j], local.logits[r][j + 1], atol=1e-4), (r, j)
            with pytest.raises(ValueError, match=r"row 0 holds 25 tokens; it can be truncated to 0\.\.25, not 26"):
                session.truncate([26, 0, 0])
            kept = [p + a for p, a in zip(PROMPTS, accepted, strict=True)]
            session.truncate(kept)
            assert c.info().active_sequences == len(PROMPTS)
            logits = session.forward([local.tokens[r][accepted[r] : accepted[r] + 3] for r in range(len(PROMPTS))])
            for r in range(len(PROMPTS)):
                for j in range(3):
                    assert torch.allclose(logits[r][j], local.logits[r][accepted[r] + j + 1], atol=1e-4), (r, j)
        assert c.info().active_sequences == 0


def test_generate_starts_from_a_fresh_session(model: Any, prompts: list[list[int]], client: ChunkAttnClient) -> None:
    with OffloadSession(client, model) as session:
        session.forward(prompts)
        with pytest.raises(SessionError, match="open a new session"):
            session.generate(prompts, 2)


def test_a_server_of_another_shape_is_refused_naming_the_first_difference(model: Any, tmp_path: Path) -> None:
    other = example_config()
    other.attention_chunk_size = 32
    with _server_for(other, tmp_path) as s, ChunkAttnClient(s.target) as c:
        with pytest.raises(HFConfigError, match=r"layer 0's chunk size: the model has 16, the server 32"):
            OffloadSession(c, model)
        assert c.info().active_sequences == 0


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2**-6), (torch.float16, 2**-9)])
def test_half_precision_models_offload_to_a_server_of_their_dtype(
    prompts: list[list[int]], tmp_path: Path, dtype: torch.dtype, tolerance: float
) -> None:
    """Fed the tokens transformers chose, every step's logits are within two half-precision steps of its own at
    the logits' scale (~1.3); generating on its own, the offloaded model chooses the same tokens up to any
    near-tie (two choices within that tolerance: the server's attention rounds differently from
    transformers' SDPA, its native kernel accumulating in float32, and this random model has near-ties in
    bfloat16); and a float32 model is refused by such a server, naming the flag."""
    model: Any = build_model(seed=0).to(dtype)  # type: ignore[arg-type]  # (transformers types .to oddly)
    local = generate_locally(model, prompts, NEW, keep_logits=True)
    assert local.logits is not None
    name = str(dtype).removeprefix("torch.")
    with _server_for(model.config, tmp_path, "--dtype", name) as s, ChunkAttnClient(s.target) as c:
        with OffloadSession(c, model, transport="stream") as session:
            steps = [[f[-1] for f in session.forward(prompts, last_only=True)]]
            for t in range(NEW - 1):
                steps.append([f[-1] for f in session.forward([[row[t]] for row in local.tokens])])
        forced = max(float((steps[t][r] - local.logits[r][t]).abs().max()) for t in range(NEW) for r in range(3))
        assert forced <= tolerance
        with OffloadSession(c, model, transport="stream") as session:
            result = session.generate(prompts, NEW, keep_logits=True)
        assert result.logits is not None
        for r, (ours, theirs, logits) in enumerate(zip(result.tokens, local.tokens, local.logits, strict=True)):
            split = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
            if split is not None:  # from here on the two runs see different sequences
                gap = float(logits[split][theirs[split]] - logits[split][ours[split]])
                assert gap <= tolerance, f"row {r}, step {split}: chose {ours[split]}, transformers' {theirs[split]}"
            else:
                assert float((result.logits[r] - logits).abs().max()) <= tolerance
        with pytest.raises(HFConfigError, match=f"in float32 and the server's attention in {name}"):
            OffloadSession(c, build_model(seed=0))


def test_an_error_inside_the_session_still_releases_its_sequences(
    model: Any, prompts: list[list[int]], client: ChunkAttnClient
) -> None:
    class Stop(Exception):
        pass

    def prefill_then_fail() -> None:
        with OffloadSession(client, model, transport="stream") as session:
            session.forward(prompts)
            assert client.info().active_sequences == len(PROMPTS)
            raise Stop

    with pytest.raises(Stop):
        prefill_then_fail()
    assert model.config._attn_implementation != NAME


def test_a_forward_that_fails_part_way_stops_the_session_with_a_clear_error(
    model: Any, prompts: list[list[int]], client: ChunkAttnClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    with OffloadSession(client, model, transport="unary") as session:
        session.forward(prompts)
        real = session.client.attend  # the session's calls go through its routed view of the client

        def failing(layer: int, *args: Any, **kwargs: Any) -> Any:
            if layer == 2:
                raise ChunkAttnError(grpc.StatusCode.UNAVAILABLE, "injected")
            return real(layer, *args, **kwargs)

        monkeypatch.setattr(session.client, "attend", failing)
        with pytest.raises(ChunkAttnError, match="injected"):
            session.forward([[1], [2], [3]])
        monkeypatch.setattr(session.client, "attend", real)
        with pytest.raises(SessionError, match="a forward failed part-way"):
            session.forward([[1], [2], [3]])


def test_the_model_called_directly_is_refused(model: Any, prompts: list[list[int]], client: ChunkAttnClient) -> None:
    ids = torch.tensor([prompts[1]])
    with (
        OffloadSession(client, model) as session,
        pytest.raises(SessionError, match=r"outside OffloadSession\.forward"),
    ):
        session.model(input_ids=ids, use_cache=False)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        with pytest.raises(SessionError, match="outside an OffloadSession"):
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_example_runs_and_finds_the_outputs_equal(tmp_path: Path) -> None:
    out = tmp_path / "example.json"
    result = _run("examples/hf_offload.py", "--prompts", "20,7", "--new-tokens", "6", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("tokens identical: True") == 2
    data = json.loads(out.read_text())
    for transport in ("unary", "stream"):
        assert data[transport]["max_abs_logit_diff"] <= 1e-4
        assert data[transport]["attend_calls"] == LAYERS * 6
        assert data[transport]["sequences_during"] == 2
        assert data[transport]["free_blocks_after"] == data[transport]["num_blocks"]


def test_the_benchmark_smoke_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = _run("benchmarks/hf_offload.py", "--smoke", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    one, two = json.loads(out.read_text())["batches"]
    assert set(one["decode_tokens_per_s"]) == {"local", "unary", "stream"}
    assert set(two["decode_tokens_per_s"]) == {"local", "local_batched", "unary", "stream"}
    for batch, baseline in ((one, "local"), (two, "local_batched")):  # one row: nothing to batch
        assert all(v > 0 for v in batch["decode_tokens_per_s"].values())
        assert batch["baseline"] == baseline
        assert set(batch["ratio"]) == {"unary", "stream"}
        assert batch["max_abs_logit_diff"] <= 1e-4
