"""Remote attention offload for Hugging Face transformers: the attention implementation "chunkattn".

Install with ``pip install 'chunkattn-client[hf]'`` (adds torch and transformers; the rest of the client
never imports them). The model keeps its weights and runs everything but attention; each layer's
attention, and the KV it needs, lives on a chunkattn server started with the model's shape
(``chunkattn-server --hf-config config.json``)::

    with ChunkAttnClient("localhost:50051") as client, OffloadSession(client, model) as session:
        result = session.generate([prompt_a, prompt_b], max_new_tokens=64)

How a forward maps to the server: each batch row is a sequence of its own on the server (ids
``<session prefix>-<row>``), and rows may bring different numbers of new tokens: the model sees them
padded at the end, but only each row's real tokens go to the server (no padding is sent, nothing is
padded on the left), and padded positions get zeros. The model runs with ``use_cache=False`` and
explicit ``position_ids``: the server holds the KV, so each forward sends only the new tokens' q/k/v,
one Attend call per layer, unary or over one AttendStream per session.

Llama 4's NoPE layers scale queries by a factor of the position ("attention temperature tuning"). Without
a transformers cache the model computes it from position 0 in every forward; the attention function
corrects it to the true positions (it changes nothing below ``floor_scale - 1``, 8191 by default).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel

from chunkattn_client import hfconfig
from chunkattn_client.batch import BatchEntry
from chunkattn_client.client import AttendStream, ChunkAttnClient, ServerInfo, Truncated

NAME = "chunkattn"
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # attention variants some models pass; none served here
MESSAGE_HEADROOM = 64 << 10  # an Attend request's bytes beyond q, k and v: entries and framing
Transport = Literal["unary", "stream"]

_active: contextvars.ContextVar[OffloadSession | None] = contextvars.ContextVar("chunkattn_hf_session", default=None)


class SessionError(RuntimeError):
    """The session cannot go on: used outside ``forward``, out of step after a failed forward, or closed."""


@dataclass
class Generation:
    """Greedy generation's result.

    tokens: per row, the new tokens.
    logits: per row, float32 [new tokens, vocab]: the logits each token was chosen from (with keep_logits).
    seconds: wall time of the whole generation, prefill included; decode_seconds: the decode steps only.
    calls: Attend calls made (one per layer per forward).
    """

    tokens: list[list[int]]
    logits: list[torch.Tensor] | None
    seconds: float
    decode_seconds: float
    calls: int = 0
    decode_tokens: int = field(default=0)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention seam: query [B, H, T, D], key/value [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    session = _active.get()
    if session is None:
        raise SessionError(f"attention {NAME!r} ran outside an OffloadSession; open one around the model's calls")
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise SessionError(f"the model asks for attention with {name}={kwargs[name]!r}; chunkattn does not have it")
    return session.attend_layer(module, query, key, value, scaling), None


AttentionInterface.register(NAME, _attention)


class OffloadSession:
    """Offloads a transformers model's attention to a chunkattn server while open (a context manager).

    On open it checks the server's shape against the model's config (a ``hfconfig.HFConfigError`` naming
    the first difference) and switches the model to the "chunkattn" attention implementation; on close
    it releases the session's sequences on the server (also when leaving on an error) and switches the
    model back. One session serves one batch of rows, from the prefill to the last decode. ``route``: the
    routing key of its calls behind Envoy (default: ``prefix``, the session's id, so that a session stays on
    one replica while sessions spread).
    """

    def __init__(
        self,
        client: ChunkAttnClient,
        model: PreTrainedModel,
        *,
        transport: Transport = "stream",
        prefix: str = "",
        route: str | None = None,
    ) -> None:
        if transport not in ("unary", "stream"):
            raise ValueError(f"transport must be 'unary' or 'stream', got {transport!r}")
        self.model = model
        self.transport = transport
        self.prefix = prefix or f"hf-{uuid.uuid4().hex[:12]}"
        # Every call of the session carries one routing key (by default its prefix): behind Envoy, they all
        # reach the replica that holds the session's KV.
        self.client = client.with_route(self.prefix if route is None else route)
        self.info: ServerInfo = client.info()
        _check_server(self.info, model)
        self.calls = 0
        self._ids: list[str] = []
        self._lengths: list[list[int]] = []  # [row][layer]: tokens the server holds
        self._step: list[int] | None = None  # during a forward: each row's new tokens
        self._stream: AttendStream | None = None
        self._token: contextvars.Token[OffloadSession | None] | None = None
        self._previous = ""

    # -- life cycle ------------------------------------------------------------------------------------

    def __enter__(self) -> OffloadSession:
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(NAME)
        self._token = _active.set(self)
        if self.transport == "stream":
            self._stream = self.client.stream()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(quiet=exc is not None)

    def close(self, *, quiet: bool = False) -> None:
        """Release the sequences and restore the model. ``quiet``: a failed release is not raised (set when
        an error is already on its way out)."""
        try:
            if self._stream is not None:
                self._stream.close()
                self._stream = None
            if self._ids:
                ids, self._ids = self._ids, []
                if quiet:
                    with contextlib.suppress(Exception):
                        self.client.release(ids, missing_ok=True)
                else:
                    self.client.release(ids, missing_ok=True)
        finally:
            if self._token is not None:
                token, self._token = self._token, None
                try:
                    self.model.set_attn_implementation(self._previous)
                finally:
                    _active.reset(token)

    @property
    def seq_ids(self) -> list[str]:
        """The server's sequence id of each row (empty before the first forward)."""
        return list(self._ids)

    # -- running the model -----------------------------------------------------------------------------

    def forward(self, tokens: Sequence[Sequence[int]], *, last_only: bool = False) -> list[torch.Tensor]:
        """Run the model on each row's new tokens and append them to the row's sequence on the server.

        tokens: one list of token ids per row (the first call fixes the rows; a row may bring none).
        Returns each row's logits, float32 [its new tokens, vocab], or [1, vocab] for its last token with
        ``last_only`` (the full-vocabulary logits of a long prompt are large).
        """
        if self._token is None:
            raise SessionError("the session is not open; use it as a context manager")
        lengths = [len(t) for t in tokens]
        if not self._ids:
            self._ids = [f"{self.prefix}-{r}" for r in range(len(tokens))]
            self._lengths = [[0] * self.info_layers for _ in tokens]
        elif len(tokens) != len(self._ids):
            raise ValueError(f"this session's batch has {len(self._ids)} rows; got {len(tokens)}")
        self._check_in_step()
        width = max(lengths, default=0)
        vocab = int(getattr(self.model.config.get_text_config(), "vocab_size", 0))
        if width == 0:
            return [torch.empty((0, vocab)) for _ in lengths]
        device = self.model.device
        ids = torch.zeros((len(tokens), width), dtype=torch.long, device=device)
        for r, row in enumerate(tokens):
            ids[r, : len(row)] = torch.as_tensor(list(row), dtype=torch.long, device=device)
        start = torch.tensor([held[0] for held in self._lengths], device=device).unsqueeze(1)
        extra: dict[str, Any] = {}
        if last_only:  # per row, the position of its last token (rows differ in length)
            extra["logits_to_keep"] = torch.tensor([[max(n - 1, 0)] for n in lengths], device=device)
        before = [held[0] for held in self._lengths]
        self._step = lengths
        try:
            with torch.no_grad():
                out = self.model(
                    input_ids=ids, position_ids=start + torch.arange(width, device=device), use_cache=False, **extra
                )
        finally:
            self._step = None
        for r, n in enumerate(lengths):
            if any(x != before[r] + n for x in self._lengths[r]):
                raise SessionError(
                    f"row {r}: not every layer's attention went through this session (layers hold"
                    f" {self._lengths[r]} tokens, expected {before[r] + n}); is another session or attention"
                    " implementation using this model? Close this session"
                )
        if last_only:
            return [out.logits[r, :1].float() if n else torch.empty((0, vocab)) for r, n in enumerate(lengths)]
        return [out.logits[r, :n].float() for r, n in enumerate(lengths)]

    def truncate(self, lengths: int | Sequence[int]) -> list[Truncated]:
        """Take each row's sequence back to its first ``lengths[r]`` tokens (an int: every row's), on the server
        and here, as if the later tokens had never been forwarded: speculative decoding, after a forward of
        the last chosen token and its drafts, drops the drafts the model rejected. A row already that short
        is left as it is. Returns each row's Truncated (its blocks released, how far back it may go next).

        ValueError, with nothing sent, for a length past a row's or below 0; a server refusal (a length
        further back than it holds across a chunk boundary: start it with --spec-window) raises
        ChunkAttnError, the rows before it truncated and the rest unchanged."""
        if self._token is None:
            raise SessionError("the session is not open; use it as a context manager")
        self._check_in_step()
        wanted = [lengths] * len(self._ids) if isinstance(lengths, int) else list(lengths)
        if len(wanted) != len(self._ids):
            raise ValueError(f"this session's batch has {len(self._ids)} rows; got {len(wanted)} lengths")
        for r, (n, held) in enumerate(zip(wanted, self._lengths, strict=True)):
            if not 0 <= n <= held[0]:
                raise ValueError(f"row {r} holds {held[0]} tokens; it can be truncated to 0..{held[0]}, not {n}")
        done = []
        for r, n in enumerate(wanted):
            done.append(self.client.truncate(self._ids[r], n))
            self._lengths[r] = [min(x, n) for x in self._lengths[r]]
        return done

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, keep_logits: bool = False
    ) -> Generation:
        """Greedy generation of ``max_new_tokens`` tokens for each prompt (one row each), from a fresh
        session. The last chosen token is not run through the model; to go on, ``forward`` it."""
        if self._ids:
            raise SessionError("generate starts new sequences and this session has some; open a new session")
        if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens < 1:
            raise ValueError("give at least one prompt, every prompt a token, and max_new_tokens >= 1")
        started, calls = time.perf_counter(), self.calls
        last = [x[-1] for x in self.forward(prompts, last_only=True)]
        decode_started = time.perf_counter()

        def step(chosen: list[int]) -> list[torch.Tensor]:
            return [x[-1] for x in self.forward([[t] for t in chosen], last_only=True)]

        result = greedy(last, max_new_tokens, step)
        end = time.perf_counter()
        return Generation(
            tokens=result[0],
            logits=result[1] if keep_logits else None,
            seconds=end - started,
            decode_seconds=end - decode_started,
            calls=self.calls - calls,
            decode_tokens=len(prompts) * (max_new_tokens - 1),
        )

    @property
    def info_layers(self) -> int:
        return len(self.info.layers)

    def attend_layer(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """One layer's attention on the server: query [B, H, T, D], key/value [B, Hkv, T, D] -> [B, T, H, D].

        Rows' tokens go in as few Attend calls as the server's message limit allows (one, unless a prefill
        is too large), each row's pieces in order."""
        lengths = self._step
        if lengths is None:
            raise SessionError("the model ran outside OffloadSession.forward / generate, which track positions")
        layer = int(getattr(module, "layer_idx", -1))
        batch, heads, width, dim = query.shape
        if not 0 <= layer < self.info_layers:
            raise SessionError(f"attention came from layer {layer}; the server has layers 0..{self.info_layers - 1}")
        if key.shape[2] != width:
            raise SessionError(
                f"layer {layer} got {key.shape[2]} keys for {width} queries: run the model with use_cache=False"
                " (the server holds the KV)"
            )
        if batch != len(lengths):
            raise SessionError(f"layer {layer} got a batch of {batch} rows; the forward has {len(lengths)}")
        served = self.info.layers[layer].scale
        if scaling is not None and abs(scaling - served) > 1e-6 * served:
            raise SessionError(f"layer {layer}'s softmax scale is {scaling}; the server uses {served}")
        query = _temperature_corrected(module, query, [held[layer] for held in self._lengths])
        per_token = (heads + 2 * key.shape[1]) * dim * query.element_size()
        limit = min(self.info.max_message_bytes, self.client.max_message_bytes) - MESSAGE_HEADROOM
        result = query.new_zeros((batch, width, heads, dim))
        for pieces in _calls(lengths, max(1, limit // per_token)):
            entries = [BatchEntry(self._ids[r], self._lengths[r][layer], n) for r, _, n in pieces]

            def packed(t: torch.Tensor, pieces: list[tuple[int, int, int]] = pieces) -> torch.Tensor:
                return torch.cat([t[r, :, at : at + n].transpose(0, 1) for r, at, n in pieces]).contiguous()

            q, k, v = packed(query), packed(key), packed(value)
            if self._stream is not None:
                out = self._stream.attend(layer, entries, q, k, v)
            else:
                out = self.client.attend(layer, entries, q, k, v)
            self.calls += 1
            answer = _to_torch(out, query.dtype).to(query.device)
            offset = 0
            for r, at, n in pieces:
                self._lengths[r][layer] += n
                result[r, at : at + n] = answer[offset : offset + n]
                offset += n
        return result

    def _check_in_step(self) -> None:
        for r, held in enumerate(self._lengths):
            if len(set(held)) != 1:
                raise SessionError(
                    f"row {r}'s layers hold {held} tokens on the server: a forward failed part-way;"
                    " close this session and start again in a new one"
                )


def _calls(lengths: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Rows' tokens cut into calls of at most ``budget`` tokens: per call, (row, first token, count)."""
    calls: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for r, total in enumerate(lengths):
        done = 0
        while done < total:
            n = min(total - done, budget - used)
            current.append((r, done, n))
            used, done = used + n, done + n
            if used == budget:
                calls.append(current)
                current, used = [], 0
    if current:
        calls.append(current)
    return calls


def generate_locally(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, keep_logits: bool = False
) -> Generation:
    """The same greedy generation run by transformers alone, with its own KV cache, one row at a time
    (so no padding is involved): the reference that offloaded generation is compared against."""
    if model.config._attn_implementation == NAME:
        raise SessionError("the model is switched to chunkattn; run this outside an OffloadSession")
    tokens: list[list[int]] = []
    logits: list[torch.Tensor] = []
    started, decode_s = time.perf_counter(), 0.0
    with torch.no_grad():
        for prompt in prompts:
            row = _LocalRow(model, prompt)
            decode_started = time.perf_counter()
            row_tokens, row_logits = greedy(row.last, max_new_tokens, row.step)
            decode_s += time.perf_counter() - decode_started
            tokens += row_tokens
            logits += row_logits
    return Generation(
        tokens=tokens,
        logits=logits if keep_logits else None,
        seconds=time.perf_counter() - started,
        decode_seconds=decode_s,
        decode_tokens=len(prompts) * (max_new_tokens - 1),
    )


class _LocalRow:
    """One prompt run by transformers with its own cache: ``last`` after the prefill, then ``step``."""

    def __init__(self, model: PreTrainedModel, prompt: Sequence[int]) -> None:
        self.model = model
        out = model(input_ids=torch.tensor([list(prompt)], device=model.device), use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.last = [out.logits[0, -1].float()]

    def step(self, chosen: list[int]) -> list[torch.Tensor]:
        out = self.model(
            input_ids=torch.tensor([chosen], device=self.model.device), past_key_values=self.cache, use_cache=True
        )
        self.cache = out.past_key_values
        return [out.logits[0, -1].float()]


def greedy(
    last: list[torch.Tensor], max_new_tokens: int, step: Callable[[list[int]], list[torch.Tensor]]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding from each row's last logits; ``step(chosen tokens) -> next last logits``. Returns the
    tokens per row and, per row, the logits each was chosen from [max_new_tokens, vocab]."""
    tokens: list[list[int]] = [[] for _ in last]
    kept: list[list[torch.Tensor]] = [[] for _ in last]
    for i in range(max_new_tokens):
        chosen = [int(x.argmax()) for x in last]
        for r, t in enumerate(chosen):
            tokens[r].append(t)
            kept[r].append(last[r])
        if i + 1 < max_new_tokens:
            last = step(chosen)
    return tokens, [torch.stack(k) for k in kept]


def _check_server(info: ServerInfo, model: PreTrainedModel) -> None:
    """HFConfigError unless the server serves exactly this model's attention, in the model's dtype."""
    expected = hfconfig.layout(model.config.to_dict())
    served = hfconfig.AttentionLayout(
        info.num_heads, info.num_kv_heads, info.head_size, tuple(x.chunk_size for x in info.layers)
    )
    problem = hfconfig.first_difference(expected, served)
    if problem is None and any(x.kv_source is not None or x.alibi for x in info.layers):
        problem = "the server's layers share KV or add ALiBi, which this model's config does not"
    if problem is not None:
        raise hfconfig.HFConfigError(
            f"the server does not serve this model's attention: {problem}."
            " Start it with: chunkattn-server --hf-config <the model's config.json>"
        )
    dtype = str(model.dtype).removeprefix("torch.")
    computes = info.compute_dtype or info.cache_dtype  # an older server computes in its cache dtype
    if dtype != computes:
        raise hfconfig.HFConfigError(
            f"the model computes in {dtype} and the server's attention in {computes}: start the server with"
            f" --dtype {dtype} (a float8 KV cache, --kv-cache-dtype fp8, computes in that dtype too)"
        )


def _temperature_corrected(module: torch.nn.Module, query: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """Llama 4 NoPE layers' queries rescaled from positions 0.. (what the model assumed without a cache)
    to each row's true positions ``starts[r]``.."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    floor_scale, attn_scale = float(module.floor_scale), float(module.attn_scale)  # type: ignore[arg-type]

    def scales(positions: torch.Tensor) -> torch.Tensor:  # as modeling_llama4 computes them, in float32
        return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    width, device = query.shape[2], query.device
    assumed = scales(torch.arange(width, device=device))
    true = scales(torch.tensor(starts, device=device).unsqueeze(1) + torch.arange(width, device=device))  # [B, T]
    if torch.equal(true, assumed.expand_as(true)):
        return query
    return (query * (true / assumed)[:, None, :, None]).to(query.dtype)


def _to_torch(out: np.ndarray[Any, Any], dtype: torch.dtype) -> torch.Tensor:
    """The server's answer [N, H, D] (float32/float16, or uint16 words of bfloat16) as a torch tensor."""
    if out.dtype == np.uint16:
        return torch.from_numpy(out.copy()).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(out.copy()).to(dtype)
