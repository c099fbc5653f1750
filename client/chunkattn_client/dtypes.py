"""The one table of dtypes: names, wire enum, numpy storage, item size, and where each may be used.

Everything else derives from it: the codec (which dtypes travel as q/k/v and outputs), the server's torch
dtypes, config checks, Info, KV transfer's record sizes, the bench and the reference. No torch, gRPC or
protobuf here (the server's core imports it).

- *wire*: q, k, v and outputs may travel in it (``chunkattn.v1.Tensor``);
- *cache*: the KV cache may store it (``chunkattn-server --kv-cache-dtype``);
- *compute*: attention may run in it (``chunkattn-server --dtype``).

float8 is a cache dtype only, as vLLM's ``kv_cache_dtype="fp8"``: K and V are stored as
``round(x / scale)`` saturated to the format's range, read back as ``stored * scale``, and queries and
outputs stay in a wire dtype. ``e4m3`` keeps 3 mantissa bits (max 448), ``e5m2`` 2 bits (max 57344);
neither has an infinity that a saturating write could produce. numpy has no float8: its bytes are uint8
codes, and ``fp8_round`` / ``fp8_decode`` give their values in float64 (for the reference and tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

__all__ = [
    "BY_WIRE",
    "CACHE",
    "COMPUTE",
    "TABLE",
    "WIRE",
    "DType",
    "DTypeError",
    "all_finite",
    "fp8_decode",
    "fp8_round",
    "lookup",
    "max_abs",
    "of_wire",
    "wire_name",
]


class DTypeError(ValueError):
    """A dtype name or enum value that is unknown, or not allowed where it was given."""


@dataclass(frozen=True)
class DType:
    """One element type.

    name: the canonical name ("bfloat16", "float8_e4m3"); aliases: other names accepted for it ("fp8").
    wire: its ``chunkattn.v1.DType`` value, ``DTYPE_<NAME>`` (every dtype has one: a KV stream names its cache
        dtype).
    storage: the numpy dtype its little-endian bytes decode to (bfloat16: uint16 words; float8: uint8 codes).
    torch: the name of its ``torch`` dtype attribute.
    on_wire, in_cache, compute: where it may be used (see the module docstring).
    exponent_bits, mantissa_bits: the float8 formats' layout (0 otherwise).
    max, tiny: the largest finite value and the smallest positive normal one.
    nonfinite: (mask, bits): a value is NaN or infinite iff its little-endian word & mask == bits.
    """

    name: str
    wire: int
    storage: str
    torch: str
    on_wire: bool
    in_cache: bool
    compute: bool
    aliases: tuple[str, ...] = ()
    exponent_bits: int = 0
    mantissa_bits: int = 0
    max: float = 0.0
    tiny: float = 0.0
    nonfinite: tuple[int, int] = (0, 1)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.storage).itemsize

    @property
    def numpy(self) -> np.dtype[np.generic]:
        return np.dtype(self.storage)

    @property
    def fp8(self) -> bool:
        return self.exponent_bits > 0


# wire: the proto's DTYPE_<NAME> numbers, written as plain ints so that this table needs no protobuf or stubs
# (tests/client/test_dtypes.py checks they are the proto's).
TABLE: tuple[DType, ...] = (
    DType(
        "float32", 1, "<f4", "float32", True, True, True,
        max=(2 - 2**-23) * 2.0**127, tiny=2.0**-126, nonfinite=(0x7F800000, 0x7F800000),
    ),
    DType(
        "float16", 2, "<f2", "float16", True, True, True,
        max=65504.0, tiny=2.0**-14, nonfinite=(0x7C00, 0x7C00),
    ),
    DType(
        "bfloat16", 3, "<u2", "bfloat16", True, True, True,
        max=(2 - 2**-7) * 2.0**127, tiny=2.0**-126, nonfinite=(0x7F80, 0x7F80),
    ),
    # torch's float8_e4m3fn: "fn", finite (no infinity; one NaN code per sign), as NVIDIA and vLLM use on CUDA.
    DType(
        "float8_e4m3", 4, "u1", "float8_e4m3fn", False, True, False,
        aliases=("fp8", "fp8_e4m3", "float8_e4m3fn"), exponent_bits=4, mantissa_bits=3, max=448.0, tiny=2.0**-6,
        nonfinite=(0x7F, 0x7F),  # NaN only: S.1111.111
    ),
    DType(
        "float8_e5m2", 5, "u1", "float8_e5m2", False, True, False,
        aliases=("fp8_e5m2",), exponent_bits=5, mantissa_bits=2, max=57344.0, tiny=2.0**-14,
        nonfinite=(0x7C, 0x7C),  # exponent all ones: infinities and NaNs
    ),
)  # fmt: skip

BY_NAME: dict[str, DType] = {n: d for d in TABLE for n in (d.name, *d.aliases)}
BY_WIRE: dict[int, DType] = {d.wire: d for d in TABLE}
WIRE = tuple(d for d in TABLE if d.on_wire)
CACHE = tuple(d for d in TABLE if d.in_cache)
COMPUTE = tuple(d for d in TABLE if d.compute)


def names(dtypes: tuple[DType, ...]) -> str:
    """ "float32, float16 or bfloat16": for messages."""
    listed = [d.name for d in dtypes]
    return listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " or " + listed[-1]


def lookup(name: str, allowed: tuple[DType, ...] = TABLE, what: str = "dtype") -> DType:
    """The dtype called ``name`` (or one of its aliases); DTypeError naming the choices when it is unknown
    or not one of ``allowed``."""
    d = BY_NAME.get(name)
    if d is None or d not in allowed:
        choices = ", ".join(n for a in allowed for n in (a.name, *a.aliases))
        raise DTypeError(f"{what} must be one of {choices}; got {name!r}")
    return d


def of_wire(value: int, allowed: tuple[DType, ...] = TABLE, what: str = "tensor dtype") -> DType:
    """The dtype of a wire enum value; DTypeError when it is unknown or not one of ``allowed``."""
    d = BY_WIRE.get(value)
    if d is None or d not in allowed:
        name = "unknown" if d is None else d.name
        raise DTypeError(f"{what} {value} ({name}) is not one of {names(allowed)}")
    return d


def wire_name(value: int) -> str:
    """A wire enum value's name, never failing: "unknown(N)" for one this version does not know (a newer
    peer's). The one mapping of wire values to names: ``of_wire`` and ``codec.dtype_name`` are the strict
    lookups, for values that must be known."""
    d = BY_WIRE.get(value)
    return f"unknown({value})" if d is None else d.name


def max_abs(raw: bytes | memoryview, d: DType) -> float:
    """The largest |value| of ``d`` in ``raw`` (little-endian; 0 for none; NaN where one is NaN), read from
    the bits: bfloat16 as the top half of float32, float8 through its code table."""
    if not len(raw):
        return 0.0
    words = np.frombuffer(raw, dtype=d.storage)
    if d.fp8:
        values = np.abs(fp8_values(d.name))[words]
    elif d.name == "bfloat16":
        values = np.abs((words.astype(np.uint32) << 16).view(np.float32))
    else:
        values = np.abs(words)
    return float(values.max())


def all_finite(raw: bytes | memoryview, d: DType) -> bool:
    """Whether the little-endian values of ``d`` in ``raw`` are all finite (read from their bits: no float8 or
    bfloat16 in numpy)."""
    mask, bits = d.nonfinite
    words = np.frombuffer(raw, dtype=f"<u{d.itemsize}")
    return not bool(np.any((words & mask) == bits))


# -- float8 values in numpy (the server stores them with torch; tests check the two agree bit for bit) ------


@cache
def fp8_values(name: str) -> npt.NDArray[np.float64]:
    """The value of each of the 256 codes of a float8 format, float64 (NaN codes: NaN; e5m2's: +-inf too)."""
    d = BY_NAME[name]
    e_bits, m_bits = d.exponent_bits, d.mantissa_bits
    bias = (1 << (e_bits - 1)) - 1
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> m_bits) & ((1 << e_bits) - 1)
    fraction = (codes & ((1 << m_bits) - 1)).astype(np.float64)
    normal = (1.0 + fraction / (1 << m_bits)) * np.exp2(exponent.astype(np.float64) - bias)
    subnormal = fraction * 2.0 ** (1 - bias - m_bits)
    values = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << e_bits) - 1
    if d.name == "float8_e4m3":  # finite: only S.1111.111 is NaN
        values[top & ((codes & 7) == 7)] = np.nan
    else:  # IEEE-like: S.11111.00 is infinity, the rest of that exponent NaN
        values[top] = np.where((codes[top] & 3) == 0, sign[top] * np.inf, np.nan)
    return values


def fp8_decode(codes: npt.ArrayLike, name: str) -> npt.NDArray[np.float64]:
    """float64 values of float8 codes (uint8 bytes as the cache stores them)."""
    return fp8_values(name)[np.asarray(codes, dtype=np.uint8)]


def fp8_round(x: npt.ArrayLike, name: str) -> npt.NDArray[np.float64]:
    """Values rounded to the nearest float8 value (ties to even), saturated to +-max; NaN stays NaN.

    This is what the server stores for ``x / scale`` (``x`` in float32), read back before the scale is
    applied again."""
    d = BY_NAME[name]
    bias = (1 << (d.exponent_bits - 1)) - 1
    a = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        _, e = np.frexp(a)  # a = m * 2^e with m in [0.5, 1): its binade starts at 2^(e - 1)
        binade = np.maximum(e - 1, 1 - bias)  # below the smallest normal, subnormals share its spacing
        step = np.exp2(binade.astype(np.float64) - d.mantissa_bits)
        rounded = np.minimum(np.round(a / step) * step, d.max)  # np.round: half to even
    rounded = np.where(np.isnan(a), np.nan, np.where(np.isinf(a), d.max, rounded))
    out: npt.NDArray[np.float64] = np.copysign(rounded, x)
    return out
