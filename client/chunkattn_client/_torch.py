"""The server's answers as torch tensors, for the parts of the client that run inside a torch model (the hf
and vllm extras; ``import chunkattn_client`` never imports this)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_torch(out: np.ndarray[Any, Any], dtype: torch.dtype) -> torch.Tensor:
    """The server's answer [N, H, D] (float32/float16, or uint16 words of bfloat16) as a torch tensor."""
    if out.dtype == np.uint16:
        return torch.from_numpy(out.copy()).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(out.copy()).to(dtype)
