"""Which scales a float8 KV cache may be held over, and the scales a calibrating layer takes from its first write.

A float8 cache holds ``x / scale`` and gives back ``stored * scale`` in the compute dtype (torchtypes). A
scale is held as a float32 (by the kernels, Info and KV streams), so it must be a *normal* float32: a smaller
one rounds to a denormal or to 0, and every value read back is then 0. And the format's largest value times
the scale must be finite in the compute dtype, or a saturated value reads back as inf: float8_e5m2's 57344 x 2
is past float16's 65504. And the format's largest value must read back as a normal number of the compute
dtype, or everything reads back as 0 there. So for a cache format ``cache`` read in ``compute``:

    max(2^-126, compute.tiny / cache.max) <= scale <= compute.max / cache.max
    (float16 over e4m3: 1.4e-7 .. 146.2; over e5m2: 1.1e-9 .. 1.142; float32 or bfloat16: 1.2e-38 .. ~1e35)

Here too: ``KVScales``, the scales a server is given (--kv-scales: a file, or calibrate), and ``KVScaleTable``,
the scales a cache holds. Plain Python: no torch, no grpc. ``ScaleRange``'s problems come back as strings
for the caller to raise as its own error (ConfigError at start, InvalidTensor for a write, IncompatibleKV
for an import).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from chunkattn_client.dtypes import DType
from chunkattn_server import jsonfile
from chunkattn_server.errors import ConfigError

FLOAT32_TINY = 2.0**-126  # float32's smallest normal number

# The largest float8 scale: 448 * 2^48 is past every |k| and |v| Attend takes (config.ModelShape.value_limits),
# and the native kernel folds the scale into the query, whose product with it must stay far from float32's max.
MAX_SCALE = 2.0**48
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: a calibrated layer's largest |k| is stored as 200 (of
# e4m3's 448), leaving room for larger values later.
K_RANGE = 200.0
V_RANGE = 100.0


def float32(x: float) -> float:
    """``x`` rounded to float32, as the kernels and the protocol's float fields hold it (+-inf past its range)."""
    try:
        value: float = struct.unpack("<f", struct.pack("<f", float(x)))[0]
    except OverflowError:  # past float32's range, or (an int) past float64's
        return math.inf if x > 0 else -math.inf
    return value


def float32_problem(scale: float, what: str = "the scale") -> str | None:
    """Why ``scale`` (float32-rounded) is not a positive normal float32 number, or None when it is."""
    if math.isfinite(scale) and scale >= FLOAT32_TINY:
        return None
    return (
        f"{what} must be a positive finite number of at least {FLOAT32_TINY:.4g} (float32's smallest normal: a"
        f" smaller scale is held as 0 or a denormal, and every value read back would be 0), got {scale:g}"
    )


@dataclass(frozen=True)
class KVScales:
    """The scales of each layer's K and V in a float8 cache: the cache holds x / scale, read back as
    stored * scale (vLLM's k_scale and v_scale).

    k, v: one per layer (a KV-sharing layer's equal to its source's, or None for "its source's"); empty:
    every scale 1. calibrate: a layer with no scale given takes its scales from the first K/V written to it
    (the first prefill or import), as vLLM's calculate_kv_scales (kv/scales.py). Which values a scale may
    take: kv/scales.py; each is checked once rounded to float32, as it is held.
    """

    k: tuple[float | None, ...] = ()
    v: tuple[float | None, ...] = ()
    calibrate: bool = False

    FIELDS = ("k_scale", "v_scale", "calibrate")

    @classmethod
    def read(cls, path: str) -> KVScales:
        """A scales file: JSON {"k_scale": S or [S per layer], "v_scale": ..., "calibrate": false} (null in a
        list for a KV-sharing layer: its source's; "calibrate": true calibrates the layers left null); or the
        word "calibrate" instead of a file. ConfigError when unreadable or malformed: an unknown or repeated
        key, a value of the wrong type, an empty list, a scale that float32 cannot hold as a normal number."""
        if path == "calibrate":
            return cls(calibrate=True)
        where = f"--kv-scales {path}"
        try:
            with open(path) as f:
                data = jsonfile.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
        if not isinstance(data, dict) or not {"k_scale", "v_scale"} <= data.keys():
            raise ConfigError(
                f'{where}: expected a JSON object {{"k_scale": ..., "v_scale": ...}}, each a number or a'
                " list of one per layer"
            )
        unknown = sorted(data.keys() - set(cls.FIELDS))
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; expected {list(cls.FIELDS)}")
        calibrate = data.get("calibrate", False)
        if not isinstance(calibrate, bool):
            raise ConfigError(f'{where}: "calibrate" must be true or false, got {json.dumps(calibrate)[:40]}')

        def number(name: str, x: object) -> float | None:
            if x is None:
                return None
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ConfigError(f"{where}: {name} must be a number or a list of numbers (or null)")
            value = float32(x)
            problem = float32_problem(value, name)
            if problem:
                raise ConfigError(f"{where}: {problem} as a float32 (the file says {str(x)[:40]})")
            return value

        def scales(name: str) -> tuple[float | None, ...]:
            value = data[name]
            if not isinstance(value, list):
                scale = number(name, value)
                if scale is None:
                    raise ConfigError(f"{where}: {name} must be a number or a list of numbers (or null)")
                return (scale,)
            if not value:
                raise ConfigError(f"{where}: {name} is an empty list; give one number, or one per layer")
            return tuple(number(f"{name}[{i}]", x) for i, x in enumerate(value))

        return cls(scales("k_scale"), scales("v_scale"), calibrate)

    def per_layer(self, kv_sources: Sequence[int | None]) -> list[tuple[float, float] | None]:
        """Each layer's (k scale, v scale), float32-rounded, for a model whose layers read ``kv_sources``' caches
        (config.ModelShape.kv_sources: per layer its source, None for its own); None where none is given (1, or
        calibrated); a KV-sharing layer's are its source's. ConfigError for a wrong count, a scale that is not a normal
        float32 number, or a sharer's scale that differs from its source's."""
        n = len(kv_sources)
        out: list[tuple[float, float] | None] = []
        for name, given in (("k_scale", self.k), ("v_scale", self.v)):
            if len(given) not in (0, 1, n):
                raise ConfigError(f"{name}: give one scale, or one per layer ({n}); got {len(given)}")
            for x in given:
                problem = None if x is None else float32_problem(float32(x), name)
                if problem:
                    raise ConfigError(problem)
        k = self.k * n if len(self.k) == 1 else self.k
        v = self.v * n if len(self.v) == 1 else self.v
        for i, source in enumerate(kv_sources):
            ki, vi = (k[i] if k else None), (v[i] if v else None)
            if (ki is None) != (vi is None):
                raise ConfigError(f"layer {i}: give both its k_scale and its v_scale, or neither")
            if ki is None and (k or v) and source is None and not self.calibrate:
                raise ConfigError(
                    f'layer {i} writes its own cache but its scales are null: give them, or add "calibrate": true'
                    " to have its first write set them"
                )
            out.append(None if ki is None or vi is None else (float32(ki), float32(vi)))
        for i, src in enumerate(kv_sources):
            if src is None:
                continue
            if out[i] is not None and out[i] != out[src]:
                raise ConfigError(
                    f"layer {i} reads layer {src}'s cache, so its scales are layer {src}'s ({out[src]}); got {out[i]}"
                )
            out[i] = out[src]
        return out


@dataclass(frozen=True)
class ScaleRange:
    """The scales a float8 cache of ``cache`` may be held over when it is read in ``compute`` (None: the
    compute dtype is not known yet, so only the float32 bounds apply)."""

    cache: DType
    compute: DType | None = None

    @property
    def smallest(self) -> float:
        """The smallest scale: a normal float32, and one at which the format's largest value reads back as a
        normal number of the compute dtype (float16 over e4m3: 2^-14 / 448 ~ 1.4e-7), rounded up to float32."""
        if self.compute is None:
            return FLOAT32_TINY
        low = max(FLOAT32_TINY, self.compute.tiny / self.cache.max)
        rounded = float32(low)
        return rounded if rounded >= low else _next_float32(rounded, +1)

    @property
    def largest(self) -> float:
        """compute.max / cache.max rounded down to float32 (inf when the compute dtype is not known), and at
        most MAX_SCALE."""
        if self.compute is None:
            return math.inf
        top = self.compute.max / self.cache.max
        rounded = float32(top)
        return min(MAX_SCALE, rounded if rounded <= top else _next_float32(rounded, -1))

    def problem(self, scale: float, what: str = "the scale") -> str | None:
        """Why ``scale`` cannot be one of this cache's scales, or None when it can."""
        problem = float32_problem(scale, what)
        if problem or self.compute is None:
            return problem
        if scale < self.smallest:
            return (
                f"{what} {scale:g} times {self.cache.name}'s largest value {self.cache.max:g} is below"
                f" {self.compute.name}'s smallest normal number, {self.compute.tiny:g}, so every value would read"
                f" back as 0 or a denormal: at least {_rounded(self.smallest, up=True):g} with {self.compute.name}"
                " compute"
            )
        if scale > MAX_SCALE:
            return (
                f"{what} {scale:g} is past {MAX_SCALE:g} (2^48): K/V that large are past the bounds Attend takes"
                " them within (so that attention cannot overflow; server.md, limits), and a larger scale would"
                " overflow the native kernel's scaled queries"
            )
        if scale > self.largest:
            return (
                f"{what} {scale:g} times {self.cache.name}'s largest value {self.cache.max:g} is past"
                f" {self.compute.name}'s largest, {self.compute.max:g}, so a saturated value would read back as"
                f" inf: at most {_rounded(self.largest, up=False):g} with {self.compute.name} compute"
            )
        return None

    def calibrate(self, k_top: float, v_top: float) -> tuple[float, float]:
        """The (k, v) scales a calibrating layer takes from its first write, whose largest |k| and |v| (in the
        compute dtype, as they are stored) are ``k_top`` and ``v_top``: top / K_RANGE (V_RANGE) in float32, as
        vLLM's calculate_kv_scales; 1 where the top is 0 (nothing to scale); at most ``largest`` (a larger
        scale would overflow the compute dtype, and ``largest`` already holds every value the compute dtype
        can). ValueError, saying why, when a top is not finite or so small that its scale is below
        ``smallest``: such a write would store every later write of the layer as 0."""
        out = []
        for name, top, target in (("k", k_top, K_RANGE), ("v", v_top, V_RANGE)):
            if not math.isfinite(top):
                raise ValueError(f"the largest |{name}| of the first write is {top}: it cannot set the scales")
            scale = min(float32(top / target), self.largest) if top > 0 else 1.0
            if scale < self.smallest:
                raise ValueError(
                    f"this is the first write to a calibrating float8 layer, which sets its {name}_scale to the"
                    f" largest |{name}| / {target:g}; the largest |{name}| is {top:g}, which gives a scale below"
                    f" {_rounded(self.smallest, up=True):g}, the smallest this cache can be read back over: every"
                    f" later value would be stored as 0. Send a first write whose largest nonzero |{name}| is at"
                    f" least {_rounded(self.smallest * target, up=True):g}, or start the server with a --kv-scales file"
                )
            out.append(scale)
        return out[0], out[1]


def _next_float32(x: float, direction: int) -> float:
    """The float32 next to float32 ``x`` > 0, up (+1) or down (-1)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    value: float = struct.unpack("<f", struct.pack("<I", bits + direction))[0]
    return value


def _rounded(x: float, *, up: bool, digits: int = 5) -> float:
    """``x`` > 0 to ``digits`` significant digits, rounded up or down (a bound to print that is itself within
    the range)."""
    shift = digits - 1 - math.floor(math.log10(x))
    scaled = x * 10.0**shift
    return (math.ceil(scaled) if up else math.floor(scaled)) / 10.0**shift


class KVScaleTable:
    """Per layer, the (k, v) scales its cache holds K/V over: the one table the engine's store and load path
    and KV transfer read. A KV-sharing layer's are its source's; 1 but in a float8 cache (``range`` given),
    where they come from --kv-scales or, None until then, a calibrating layer's first write (or an import).

    ``sources[layer]``: the layer whose cache it reads (itself for a writing layer)."""

    def __init__(
        self, sources: list[int], given: list[tuple[float, float] | None], scale_range: ScaleRange | None
    ) -> None:
        self.range = scale_range
        self._sources = sources
        self._scales: list[tuple[float, float] | None] = list(given) if scale_range is not None else []

    @classmethod
    def starting(
        cls, kv_sources: Sequence[int | None], scales: KVScales | None, cache: DType, compute: DType
    ) -> KVScaleTable:
        """The table of a model whose layers read ``kv_sources``' caches (see ``KVScales.per_layer``), for a
        cache of dtype ``cache`` read in ``compute``, as it starts: --kv-scales' (``scales``) for a
        float8 cache, 1 where none is given, None (to calibrate) where it says so. ConfigError for a given
        scale outside the range the cache can be read back over."""
        given = scales.per_layer(kv_sources) if scales is not None else [None] * len(kv_sources)
        unscaled = None if scales is not None and scales.calibrate else (1.0, 1.0)
        scale_range = ScaleRange(cache, compute) if cache.fp8 else None
        for i, pair in enumerate(given if scale_range is not None else ()):
            for name, scale in zip(("k_scale", "v_scale"), pair or (), strict=False):
                problem = scale_range and scale_range.problem(scale, f"layer {i}'s {name}")
                if problem:
                    raise ConfigError(f"--kv-scales: {problem} (or compute in float32 or bfloat16: --dtype)")
        sources = [i if source is None else source for i, source in enumerate(kv_sources)]
        return cls(sources, [g or unscaled for g in given], scale_range)

    @property
    def fp8(self) -> bool:
        return self.range is not None

    def of(self, layer: int) -> tuple[float, float] | None:
        """The layer's (k, v) scales; None while a calibrating layer has had no write."""
        return self._scales[self._sources[layer]] if self.range is not None else (1.0, 1.0)

    def calibrating(self, layer: int) -> bool:
        """Whether the layer's next write (or import) sets its scales."""
        return self.of(layer) is None

    def calibrated(self, layer: int, k_top: float, v_top: float) -> tuple[float, float]:
        """The layer's scales, set now from its first write's largest |k| and |v| if it is calibrating
        (ScaleRange.calibrate: ValueError for a write that cannot set them, nothing set)."""
        scales = self.of(layer)
        if scales is None:
            assert self.range is not None
            scales = self._scales[self._sources[layer]] = self.range.calibrate(k_top, v_top)
        return scales

    def adopt(self, layer: int, scales: tuple[float, float]) -> None:
        """A calibrating layer takes an import's scales (checked by the caller: ``range.problem``)."""
        assert self.calibrating(layer)
        self._scales[self._sources[layer]] = scales
