"""OffloadSession: a transformers model's attention offloaded to a chunkattn server while open. It checks the
server against the model, switches the model's attention implementation, keeps each row's sequence and
positions on the server, and runs forward, truncate and greedy generate; ``attend_layer`` is where the
"chunkattn" attention function sends each layer."""

from __future__ import annotations

import contextlib
import contextvars
import time
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from chunkattn_client import hfconfig
from chunkattn_client._torch import to_torch
from chunkattn_client.batch import BatchEntry
from chunkattn_client.client import AttendStream, ChunkAttnClient, ServerInfo, Truncated
from chunkattn_client.hf.attention import NAME, SessionError, active, temperature_corrected
from chunkattn_client.hf.generate import Generation, greedy
from chunkattn_client.split import entry_calls, message_limit, tokens_per_call

Transport = Literal["unary", "stream"]


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
        self._token = active.set(self)
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
                    active.reset(token)

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
        query = temperature_corrected(module, query, [held[layer] for held in self._lengths])
        per_token = (heads + 2 * key.shape[1]) * dim * query.element_size()
        limit = message_limit(self.info.max_message_bytes, self.client.max_message_bytes)
        budget = max(1, tokens_per_call(per_token, limit))  # one token past the limit: the server says why
        result = query.new_zeros((batch, width, heads, dim))
        starts = [held[layer] for held in self._lengths]
        chunk, bound = self.info.layers[layer].chunk_size, self.info.max_call_work
        for pieces in entry_calls(lengths, budget, starts, chunk, bound):
            entries = [BatchEntry(self._ids[r], self._lengths[r][layer], n) for r, _, n in pieces]

            def packed(t: torch.Tensor, pieces: list[tuple[int, int, int]] = pieces) -> torch.Tensor:
                return torch.cat([t[r, :, at : at + n].transpose(0, 1) for r, at, n in pieces]).contiguous()

            q, k, v = packed(query), packed(key), packed(value)
            if self._stream is not None:
                out = self._stream.attend(layer, entries, q, k, v)
            else:
                out = self.client.attend(layer, entries, q, k, v)
            self.calls += 1
            answer = to_torch(out, query.dtype).to(query.device)
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
