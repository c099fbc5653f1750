"""Tensors <-> ``chunkattn.v1.Tensor`` messages: raw little-endian C-order bytes, no per-element work.

numpy has no bfloat16, so bfloat16 travels (and decodes) as raw uint16 words; ``bf16_to_float32`` and
``float32_to_bf16`` convert. torch tensors are accepted too when torch happens to be installed (this
module never imports it unless handed one).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb

__all__ = ["CodecError", "bf16_to_float32", "decode", "dtype_name", "encode", "float32_to_bf16", "itemsize"]

# Wire dtype -> the little-endian numpy dtype its bytes decode to.
_NUMPY: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}
_BY_NAME = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16}
_NAMES: dict[int, str] = {v: k for k, v in _BY_NAME.items()}


class CodecError(ValueError):
    """A tensor or message that cannot be encoded or decoded; the message says what and why."""


def dtype_name(dtype: int) -> str:
    """ "float32", "float16" or "bfloat16" for a wire dtype; CodecError otherwise."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CodecError(f"unknown tensor dtype {dtype}; expected float32, float16 or bfloat16") from None


def itemsize(dtype: int) -> int:
    dtype_name(dtype)
    return _NUMPY[dtype].itemsize


def encode(x: Any, dtype: str | None = None) -> pb.Tensor:
    """A Tensor message from a numpy array (float32 / float16, or uint16 words with dtype="bfloat16")
    or a torch tensor (float32 / float16 / bfloat16). The bytes are copied once, into the message."""
    if type(x).__module__.split(".")[0] == "torch":
        return _encode_torch(x)
    arr = np.asarray(x)
    if dtype is None:
        dtype = {np.dtype("float32"): "float32", np.dtype("float16"): "float16"}.get(arr.dtype.newbyteorder("="))
        if dtype is None:
            raise CodecError(
                f"cannot send a {arr.dtype} array: use float32 or float16, or uint16 bfloat16 words with"
                " dtype='bfloat16' (see float32_to_bf16)"
            )
    wire = _BY_NAME.get(dtype)
    if wire is None:
        raise CodecError(f"unknown dtype {dtype!r}; expected float32, float16 or bfloat16")
    want = _NUMPY[wire]
    if dtype == "bfloat16" and arr.dtype.newbyteorder("=") != np.dtype("uint16"):
        raise CodecError(f"bfloat16 is sent as uint16 words, got a {arr.dtype} array (see float32_to_bf16)")
    data = np.ascontiguousarray(arr, dtype=want).tobytes()
    return pb.Tensor(dtype=wire, shape=arr.shape, data=data)


def _encode_torch(t: Any) -> pb.Tensor:
    import torch  # only reached when the caller already has torch

    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if t.dtype not in names:
        raise CodecError(f"cannot send a {t.dtype} tensor: use float32, float16 or bfloat16")
    raw = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return pb.Tensor(dtype=_BY_NAME[names[t.dtype]], shape=list(t.shape), data=raw)


def decode(t: pb.Tensor) -> npt.NDArray[Any]:
    """A read-only numpy view of the message's bytes (no copy): float32 / float16, or uint16 for bfloat16.

    Raises CodecError when the dtype is unknown, a dimension is negative, or the byte count is not
    product(shape) * itemsize.
    """
    dt = _NUMPY.get(t.dtype)
    if dt is None:
        raise CodecError(f"unknown tensor dtype {t.dtype}; expected float32, float16 or bfloat16")
    shape = tuple(t.shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"tensor shape {list(shape)} has a negative dimension")
    want = math.prod(shape) * dt.itemsize
    if len(t.data) != want:
        raise CodecError(
            f"tensor of shape {list(shape)} and dtype {_NAMES[t.dtype]} needs {want} bytes, got {len(t.data)}"
        )
    arr: npt.NDArray[Any] = np.frombuffer(t.data, dtype=dt)
    return arr.reshape(shape)


def float32_to_bf16(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """bfloat16 words of float32 values, rounded to nearest even (NaN stays NaN)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_to_float32(words: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """float32 values of bfloat16 words (exact)."""
    w = np.ascontiguousarray(words, dtype=np.uint16)
    return (w.astype(np.uint32) << 16).view(np.float32)
