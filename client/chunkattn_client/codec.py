"""Tensors <-> ``chunkattn.v1.Tensor`` messages: raw little-endian C-order bytes, no per-element work.

The dtypes that travel (float32, float16, bfloat16) are those of ``dtypes.WIRE``. numpy has no bfloat16,
so bfloat16 travels (and decodes) as raw uint16 words; ``bf16_to_float32`` and
``float32_to_bf16`` convert. torch tensors are accepted too when torch happens to be installed (this
module never imports it unless handed one).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError, Message

from chunkattn_client import dtypes, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import SMALL_MESSAGE_BYTES
from chunkattn_client.wire import Buffer, RawTensor

M = TypeVar("M", bound=Message)

__all__ = [
    "WIRE_DTYPES",
    "CodecError",
    "bf16_to_float32",
    "check",
    "decode",
    "dtype_name",
    "encode",
    "float32_to_bf16",
    "from_parts",
    "numpy_dtype",
    "parse_tensors",
    "read_header",
    "to_raw",
    "to_raw_fast",
]

# Wire dtype -> the little-endian numpy dtype its bytes decode to.
_NUMPY: dict[int, np.dtype[Any]] = {d.wire: d.numpy for d in dtypes.WIRE}
# Dtype name -> wire dtype, for every dtype tensors travel in.
WIRE_DTYPES: dict[str, pb.DType] = {d.name: d.wire for d in dtypes.WIRE}  # type: ignore[misc]
_EXPECTED = dtypes.names(dtypes.WIRE)
# numpy arrays whose dtype names their wire dtype (bfloat16's uint16 words must say dtype="bfloat16").
_OF_NUMPY = {d.numpy.newbyteorder("="): d.name for d in dtypes.WIRE if d.numpy.kind == "f"}


class CodecError(ValueError):
    """A tensor or message that cannot be encoded or decoded; the message says what and why."""


def dtype_name(dtype: int) -> str:
    """ "float32", "float16" or "bfloat16" for a wire dtype; CodecError otherwise (a cache-only dtype too)."""
    name = dtypes.wire_name(dtype)
    if dtype in _NUMPY:
        return name
    if dtype not in dtypes.BY_WIRE:
        raise CodecError(f"unknown tensor dtype {dtype}; expected {_EXPECTED}")
    raise CodecError(f"tensor dtype {dtype} ({name}) is a KV cache dtype only; tensors travel in {_EXPECTED}")


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a wire dtype's bytes decode to ("bfloat16": uint16 words)."""
    return _NUMPY[WIRE_DTYPES[name]]


def to_raw(x: Any, dtype: str | None = None) -> RawTensor:
    """The wire form of a numpy array (float32 / float16, or uint16 words with dtype="bfloat16") or a torch
    tensor (float32 / float16 / bfloat16): a view of its bytes, copied only if it was not little-endian
    C-contiguous already."""
    if type(x).__module__.split(".")[0] == "torch":
        return _torch_raw(x)
    arr = np.asarray(x)
    if dtype is None:
        dtype = _OF_NUMPY.get(arr.dtype.newbyteorder("="))
        if dtype is None:
            raise CodecError(
                f"cannot send a {arr.dtype} array: use float32 or float16, or uint16 bfloat16 words with"
                " dtype='bfloat16' (see float32_to_bf16)"
            )
    wire = WIRE_DTYPES.get(dtype)
    if wire is None:
        raise CodecError(f"dtype {dtype!r} cannot be sent; expected one of {_EXPECTED}")
    if dtype == "bfloat16" and arr.dtype.newbyteorder("=") != np.dtype("uint16"):
        raise CodecError(f"bfloat16 is sent as uint16 words, got a {arr.dtype} array (see float32_to_bf16)")
    data = np.ascontiguousarray(arr, dtype=_NUMPY[wire])
    return RawTensor(wire, tuple(arr.shape), data.reshape(-1).view(np.uint8).data)


def _torch_raw(t: Any) -> RawTensor:
    import torch  # only reached when the caller already has torch

    name = _TORCH_NAMES.get(str(t.dtype))
    if name is None:
        raise CodecError(f"cannot send a {t.dtype} tensor: use one of {_EXPECTED}")
    if t.is_cpu and not t.requires_grad and t.is_contiguous():  # the server's outputs: no torch op but a view
        raw = (t.view(torch.int16) if name == "bfloat16" else t).numpy().reshape(-1).view(np.uint8)
    else:
        raw = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().reshape(-1)
    return RawTensor(WIRE_DTYPES[name], tuple(t.shape), raw.data)


_TORCH_NAMES = {f"torch.{d.torch}": d.name for d in dtypes.WIRE}


# (the dtype argument, a native numpy array's dtype) -> wire dtype, for the arrays ``to_raw_fast`` sends as they are.
_AS_THEY_ARE: dict[tuple[str | None, np.dtype[Any]], int] = {}
for _d in dtypes.WIRE:
    # The wire is little-endian: only arrays already in its byte order go as they are (on a big-endian host,
    # native arrays miss this table and take to_raw's conversion).
    _native = _d.numpy.newbyteorder("<")
    _AS_THEY_ARE[(_d.name, _native)] = _d.wire
    if _native.kind == "f":
        _AS_THEY_ARE[(None, _native)] = _d.wire


def to_raw_fast(x: Any, dtype: str | None = None) -> RawTensor:
    """``to_raw``'s result, with fewer Python steps for the common case of a per-layer call: a C-contiguous
    numpy array whose dtype is the one it travels in (float32 / float16, or uint16 words with
    dtype="bfloat16"), sent as a byte view of itself. Anything else (torch tensors included) goes through
    ``to_raw``, with its errors."""
    if type(x) is np.ndarray and x.flags.c_contiguous and x.size:  # (a view with a 0 in its shape cannot be cast)
        wire = _AS_THEY_ARE.get((dtype, x.dtype))
        if wire is not None:
            return RawTensor(wire, x.shape, memoryview(x).cast("B"))  # type: ignore[arg-type]
    return to_raw(x, dtype)


def encode(x: Any, dtype: str | None = None) -> pb.Tensor:
    """A Tensor message (see ``to_raw`` for what is accepted). For big tensors prefer ``wire``'s encoders,
    which skip protobuf's slow copy of the bytes."""
    raw = to_raw(x, dtype)
    return pb.Tensor(dtype=raw.dtype, shape=raw.shape, data=bytes(raw.data))  # type: ignore[arg-type]


def read_header(header: bytes, nbytes: int) -> tuple[int, tuple[int, ...]]:
    """(wire dtype, shape) of a tensor taken apart by ``wire.split``, checked against its nbytes of data.

    Raises CodecError as ``check`` does, or when the header does not parse.
    """
    try:
        t = pb.Tensor.FromString(header)
    except DecodeError as e:
        raise CodecError(f"the tensor does not parse: {e}") from None
    shape = tuple(t.shape)
    check(t.dtype, shape, nbytes)
    return t.dtype, shape


def parse_tensors(
    message: type[M], raw: bytes, fields: frozenset[int], max_fields: int | None = None
) -> tuple[M, dict[int, RawTensor]]:
    """A serialized message with Tensor fields, and its tensors in ``fields`` by field number (those it has).

    The small/large path of both sides: a message of at most SMALL_MESSAGE_BYTES goes through protobuf's C
    parser, its tensors copied (nothing at this size); a larger one is taken apart by ``wire.split`` without
    copying its tensors' bytes (a Python scan of its fields: at most ``max_fields`` of them, else
    wire.TooManyFields) and each tensor's header is checked against its bytes (``read_header``). Raises
    wire.WireError or DecodeError when it does not parse, CodecError for a large message's bad tensor.
    """
    tensors: dict[int, RawTensor] = {}
    if len(raw) <= SMALL_MESSAGE_BYTES:
        parsed = message.FromString(raw)
        for field in fields:
            name = parsed.DESCRIPTOR.fields_by_number[field].name
            if parsed.HasField(name):
                t = getattr(parsed, name)
                tensors[field] = RawTensor(t.dtype, tuple(t.shape), t.data)  # t.data read once: each read copies
        return parsed, tensors
    parts = wire.split(raw, fields, max_fields)
    parsed = message.FromString(parts.rest)
    for field, (header, data) in parts.tensors.items():
        tensors[field] = RawTensor(*read_header(header, len(data)), data)
    return parsed, tensors


def view(dtype: int, shape: tuple[int, ...], data: Buffer) -> npt.NDArray[Any]:
    """A read-only numpy view (no copy) of a tensor's bytes: float32 / float16, or uint16 for bfloat16.

    Raises CodecError when the dtype is unknown, a dimension is negative, or the byte count is not
    product(shape) * itemsize.
    """
    check(dtype, shape, len(data))
    arr: npt.NDArray[Any] = np.frombuffer(data, dtype=_NUMPY[dtype])
    return arr.reshape(shape)


def from_parts(header: bytes, data: Buffer) -> npt.NDArray[Any]:
    """A read-only numpy view of a tensor taken apart by ``wire.split`` (no copy); CodecError as ``view``."""
    return view(*read_header(header, len(data)), data)


def decode(t: pb.Tensor) -> npt.NDArray[Any]:
    """A read-only numpy view of the message's bytes (see ``view``)."""
    return view(t.dtype, tuple(t.shape), t.data)  # t.data read once: each read copies it out of the message


# More dimensions than any tensor of the protocol has (they have 3), and few enough that a product of int64s
# stays a number one can print.
MAX_DIMS = 8


def check(dtype: int, shape: tuple[int, ...], nbytes: int) -> None:
    """CodecError unless dtype is known, the shape has at most MAX_DIMS dimensions, none negative, and
    nbytes = product(shape) * itemsize."""
    if dtype not in _NUMPY:
        dtype_name(dtype)  # raises, saying why
    dt = _NUMPY[dtype]
    if len(shape) > MAX_DIMS:
        raise CodecError(f"tensor shape has {len(shape)} dimensions; at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise CodecError(f"tensor shape {list(shape)} has a negative dimension")
    want = math.prod(shape) * dt.itemsize
    if nbytes != want:
        name = dtypes.wire_name(dtype)
        raise CodecError(f"tensor of shape {list(shape)} and dtype {name} needs {want} bytes, got {nbytes}")


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


def to_float64(x: npt.ArrayLike, dtype: str) -> npt.NDArray[np.float64]:
    """float64 values of an array as sent or received in ``dtype`` (bfloat16: uint16 words)."""
    if dtype == "bfloat16":
        return bf16_to_float32(x).astype(np.float64)
    return np.asarray(x, dtype=np.float64)
