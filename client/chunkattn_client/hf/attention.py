"""The transformers attention implementation "chunkattn": the function transformers calls (registered on
import), which hands each layer to the open OffloadSession, and the per-layer tensor work the session does
with it: rows' tokens cut into Attend calls under the message limit, Llama 4 NoPE layers' query temperature
corrected to the true positions, and the server's answers back as torch tensors."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface

from chunkattn_client import work

if TYPE_CHECKING:
    from chunkattn_client.hf.session import OffloadSession

NAME = "chunkattn"
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # attention variants some models pass; none served here
MESSAGE_HEADROOM = 64 << 10  # an Attend request's bytes beyond q, k and v: entries and framing

active: contextvars.ContextVar[OffloadSession | None] = contextvars.ContextVar("chunkattn_hf_session", default=None)


class SessionError(RuntimeError):
    """The session cannot go on: used outside ``forward``, out of step after a failed forward, or closed."""


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
    session = active.get()
    if session is None:
        raise SessionError(f"attention {NAME!r} ran outside an OffloadSession; open one around the model's calls")
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise SessionError(f"the model asks for attention with {name}={kwargs[name]!r}; chunkattn does not have it")
    return session.attend_layer(module, query, key, value, scaling), None


AttentionInterface.register(NAME, _attention)


def split_calls(
    lengths: list[int], budget: int, positions: list[int] | None = None, chunk_size: int = 0, max_work: int = 0
) -> list[list[tuple[int, int, int]]]:
    """Rows' tokens cut into calls of at most ``budget`` tokens and, with ``max_work``, at most that much work
    (Info's max_call_work, chunkattn_client.work; row r's tokens start at ``positions[r]`` in a layer of chunk
    size ``chunk_size``): per call, (row, first token, count). A token that alone costs more than ``max_work``
    is a call of its own: the server refuses it, saying why."""
    calls: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = spent = 0
    for r, total in enumerate(lengths):
        done = 0
        while done < total:
            want = min(total - done, budget - used)
            n = want
            if max_work and positions is not None:
                n = _fitting(positions[r] + done, want, chunk_size, max_work - spent)
                if not n and not current:
                    n = 1  # alone past the bound
                spent += work.entry_work(positions[r] + done, n, chunk_size)
            if n:
                current.append((r, done, n))
                used, done = used + n, done + n
            if n < want or used == budget:  # the call is full (its tokens or its work): a row once per call
                calls.append(current)
                current, used, spent = [], 0, 0
    if current:
        calls.append(current)
    return calls


def _fitting(position: int, most: int, chunk_size: int, room: int) -> int:
    """The most tokens (up to ``most``) from ``position`` on whose work fits in ``room``."""
    lo, hi = 0, most  # work.entry_work grows with the token count: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if work.entry_work(position, mid, chunk_size) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def temperature_corrected(module: torch.nn.Module, query: torch.Tensor, starts: list[int]) -> torch.Tensor:
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
