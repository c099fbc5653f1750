"""The transformers attention implementation "chunkattn": the function transformers calls (registered on
import), which hands each layer to the open OffloadSession, and the per-layer tensor work the session does
with it: Llama 4 NoPE layers' query temperature corrected to the true positions. (The rows' tokens are cut into
Attend calls by ``chunkattn_client.split``.)"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface

if TYPE_CHECKING:
    from chunkattn_client.hf.session import OffloadSession

NAME = "chunkattn"
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # attention variants some models pass; none served here

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
