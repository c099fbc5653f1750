"""Frozen, validated configuration: the model's attention shape, the KV pool, the device, and the server's
network and limits.

Everything here is checked once at start-up with a message that says what is wrong and what is
expected; the engine then trusts it. No torch here: the config is plain data.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cached_property

from chunkattn_client import dtypes
from chunkattn_client.limits import quote, target_problem, token_problem
from chunkattn_server.errors import ConfigError, UnknownLayer
from chunkattn_server.kv.scales import KVScales

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "native", "triton")


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer.

    chunk_size: C; the query at position i sees key j iff j <= i and j // C == i // C. 0 = global causal.
    kv_source: index of another layer whose KV cache this layer reads (KV sharing, as vLLM's
        kv_sharing_target_layer_name); such a layer writes no K/V of its own.
    scale: softmax scale; None means 1 / sqrt(head_size).
    alibi_slopes: optional per-query-head slopes; slope * (j - i) is added to each score.
    """

    chunk_size: int = 0
    kv_source: int | None = None
    scale: float | None = None
    alibi_slopes: tuple[float, ...] | None = None


# Bounds that keep every finite input's attention finite in every backend (they compute scores in float32,
# largest 2^128): |scale * q.k| stays below 2^SCORE_LOG2, which leaves 2^28 for each path's own intermediate
# values (a float8 scale folded into q, ALiBi's bias, the order of a sum); a sum of up to 2^31 keys' weighted
# values stays below it too. No trained model comes near them; an activation that does is a bug upstream.
SCORE_LOG2 = 100
V_LIMIT = 2.0**64  # the largest |v| a call may bring
MAX_SCALE = 2.0**8  # the largest softmax scale a layer may have
MAX_SLOPE = 2.0**32  # the largest |ALiBi slope|: its bias stays below 2^63 over 2^31 positions


def qk_limit(head_size: int, scale: float) -> float:
    """The largest |q| and |k| a layer of ``head_size`` and softmax ``scale`` takes: the largest power of two B
    with head_size * B^2 * max(1, scale) <= 2^SCORE_LOG2, so that no score scale * q.k can overflow (2^46,
    about 7e13, for a head size of 128 and a scale below 1)."""
    return 2.0 ** math.floor((SCORE_LOG2 - math.log2(head_size * max(1.0, scale))) / 2)


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per sequence (same chunk size), as vLLM's hybrid allocator does.

    ``layers`` write K/V; layer ``layers[r]`` keeps its pages in plane r of the cache. ``sharers`` read the
    cache of one of ``layers`` and write nothing.
    """

    index: int
    chunk_size: int
    layers: tuple[int, ...]
    sharers: tuple[int, ...]


@dataclass(frozen=True)
class ModelShape:
    """The attention shape the server serves: heads, head size and every layer's spec."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.layers:
            raise ConfigError("the model needs at least one layer")
        for i, spec in enumerate(self.layers):
            self._check_layer(i, spec)

    def scale_of(self, layer: int) -> float:
        """The softmax scale a layer uses: its own, or 1 / sqrt(head_size)."""
        return self.layers[layer].scale or 1.0 / math.sqrt(self.head_size)

    def value_limits(self, layer: int) -> tuple[float, float]:
        """The largest |q| or |k|, and |v|, a layer takes (``qk_limit``, V_LIMIT): larger finite values could
        overflow its scores or its weighted sums."""
        return qk_limit(self.head_size, self.scale_of(layer)), V_LIMIT

    def _check_layer(self, i: int, spec: LayerSpec) -> None:
        if spec.chunk_size < 0:
            raise ConfigError(f"layer {i}: chunk_size must be >= 0 (0 = global), got {spec.chunk_size}")
        if spec.scale is not None and not 0 < spec.scale <= MAX_SCALE:  # NaN fails too
            raise ConfigError(f"layer {i}: scale must be a number in (0, {MAX_SCALE:g}], got {spec.scale}")
        if spec.alibi_slopes is not None and len(spec.alibi_slopes) != self.num_heads:
            raise ConfigError(
                f"layer {i}: alibi_slopes needs one slope per query head ({self.num_heads}),"
                f" got {len(spec.alibi_slopes)}"
            )
        if spec.alibi_slopes is not None and not all(abs(x) <= MAX_SLOPE for x in spec.alibi_slopes):
            raise ConfigError(
                f"layer {i}: alibi_slopes must be finite numbers of at most {MAX_SLOPE:g} in magnitude,"
                f" got {list(spec.alibi_slopes)}"
            )
        src = spec.kv_source
        if src is None:
            return
        if not 0 <= src < len(self.layers) or src == i:
            raise ConfigError(f"layer {i}: kv_source must be another layer in [0, {len(self.layers)}), got {src}")
        source = self.layers[src]
        if source.kv_source is not None:
            raise ConfigError(
                f"layer {i}: kv_source {src} is itself a KV-sharing layer; point at the layer that writes the"
                f" cache ({source.kv_source})"
            )
        if source.chunk_size != spec.chunk_size:
            raise ConfigError(
                f"layer {i}: a KV-sharing layer must have its source's chunk size"
                f" ({source.chunk_size}), got {spec.chunk_size}"
            )

    @classmethod
    def interleaved(
        cls,
        *,
        num_layers: int,
        chunk_size: int,
        global_every: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
    ) -> ModelShape:
        """Llama 4's layout: every ``global_every``-th layer (3, 7, 11, ... for 4) is global, the rest chunked.

        ``global_every=0`` makes every layer chunked.
        """
        if num_layers <= 0:
            raise ConfigError(f"num_layers must be positive, got {num_layers}")
        if global_every < 0:
            raise ConfigError(f"global_every must be >= 0, got {global_every}")
        layers = tuple(
            LayerSpec(chunk_size=0 if global_every and (i + 1) % global_every == 0 else chunk_size)
            for i in range(num_layers)
        )
        return cls(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, layers=layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_sources(self) -> tuple[int | None, ...]:
        """Per layer, the layer whose KV cache it reads (KV sharing), None for its own."""
        return tuple(spec.kv_source for spec in self.layers)

    def spec(self, layer: object) -> LayerSpec:
        """The spec of layer ``layer``; UnknownLayer (a client's error) when there is no such layer."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(self.layers):
            raise UnknownLayer(f"layer {quote(layer)} does not exist; the model has layers 0..{len(self.layers) - 1}")
        return self.layers[layer]


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool: fixed-size blocks, sized by a block count or a memory budget (bytes of K and V pages).

    dtype: what the cache stores (``dtypes.CACHE``: a float dtype, or float8 "fp8" / "fp8_e4m3" /
        "fp8_e5m2" over per-layer ``scales``); "auto" is the engine's compute dtype.
    spec_window: tokens a chunked layer keeps before its current chunk, so that a sequence can be
        truncated that far back across a chunk boundary (speculative decoding's rejected drafts).
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = 1 << 30
    dtype: str = "auto"
    scales: KVScales | None = None
    spec_window: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.num_blocks is None and (self.memory_bytes is None or self.memory_bytes <= 0):
            raise ConfigError(f"give num_blocks or a positive memory_bytes, got {self.memory_bytes!r}")
        if self.dtype != "auto":
            try:
                dtypes.lookup(self.dtype, dtypes.CACHE, "the KV cache dtype")
            except dtypes.DTypeError as e:
                raise ConfigError(f"{e} (or auto: the compute dtype)") from None
        if self.scales is not None and not self.fp8:
            raise ConfigError("KV scales apply to a float8 cache only: give --kv-cache-dtype fp8 (or fp8_e5m2) too")
        if isinstance(self.spec_window, bool) or not isinstance(self.spec_window, int) or self.spec_window < 0:
            raise ConfigError(f"spec_window must be an integer >= 0, got {self.spec_window!r}")

    @property
    def fp8(self) -> bool:
        return self.dtype != "auto" and dtypes.BY_NAME[self.dtype].fp8


# The most work one Attend call may ask for (--max-call-work; Info's max_call_work; chunkattn_client.work: its
# query-key pairs, plus 8,192 per piece computed apart): what one call can hold the engine for, while every
# other tenant's steps wait (docs/results.md, "Neighbours", has what the heaviest such calls cost on the dev
# machines); a GPU does the same work in milliseconds.
DEFAULT_CALL_WORK = {"cpu": 1 << 22, "cuda": 1 << 30}
MAX_CALL_WORK = 1 << 62  # what Info's int64 field holds, with room


def default_call_work(device_type: str) -> int:
    """The default bound on one call's work on a device of this type (a CUDA GPU's, elsewhere)."""
    return DEFAULT_CALL_WORK.get(device_type, DEFAULT_CALL_WORK["cuda"])


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs.

    device: "auto" (CUDA when available, else CPU), "cpu" or "cuda[:N]".
    backend: "auto" (triton on CUDA, native on the CPU), "torch", "native" (the torch backend with the native
        CPU decode kernel; torch where it cannot be built) or "triton".
    dtype: the compute dtype (``dtypes.COMPUTE``): queries, and K/V read from the cache, are converted to
        it; "auto" is bfloat16 on CUDA and float32 on the CPU.
    max_call_work: the most work one call may ask for (chunkattn_client.work: query-key pairs, and 8,192 per
        piece computed apart; 0: no bound, as in-process callers have by default; None: ``default_call_work``
        for the device, as the server has).
    """

    model: ModelShape
    cache: CacheConfig = field(default_factory=CacheConfig)
    device: str = "auto"
    backend: str = "auto"
    dtype: str = "auto"
    max_call_work: int | None = 0

    def __post_init__(self) -> None:
        if self.max_call_work is not None and not 0 <= self.max_call_work <= MAX_CALL_WORK:
            raise ConfigError(f"max_call_work must be 0 (no bound) to {MAX_CALL_WORK} (2^62), got {self.max_call_work}")
        if self.dtype != "auto":
            try:
                dtypes.lookup(self.dtype, dtypes.COMPUTE, "the compute dtype")
            except dtypes.DTypeError as e:
                raise ConfigError(f"{e} (or auto: bfloat16 on CUDA, float32 on the CPU)") from None
        if self.cache.scales is not None:
            self.cache.scales.per_layer(self.model.kv_sources)  # checked now
        bs = self.cache.block_size
        for i, spec in enumerate(self.model.layers):
            if spec.chunk_size % bs:
                raise ConfigError(
                    f"layer {i}: chunk_size {spec.chunk_size} is not a multiple of block_size {bs};"
                    f" use a chunk size that is, or a block size that divides {spec.chunk_size}"
                )
        base = self.device.split(":", 1)[0]
        if base not in DEVICES or (base != "cuda" and ":" in self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")

    def dtypes_on(self, device_type: str) -> tuple[str, str]:
        """(compute, cache) dtype names, canonical, on a device of this type ("cpu", "cuda").

        The compute dtype "auto" is the cache's when the cache may be computed in (``--dtype float16``
        alone sets both), else bfloat16 on CUDA and float32 on the CPU; the cache dtype "auto" is the
        compute dtype."""
        cache = self.cache.dtype
        compute = self.dtype
        if compute == "auto":
            if cache != "auto" and dtypes.BY_NAME[cache].compute:
                compute = cache
            else:
                compute = "bfloat16" if device_type == "cuda" else "float32"
        compute = dtypes.BY_NAME[compute].name
        return compute, compute if cache == "auto" else dtypes.BY_NAME[cache].name

    @cached_property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV groups, each of ``group_size`` writing layers.

        Layers of one chunk size are split into groups of equal size (the gcd of the per-chunk-size
        layer counts), so that every group uses all of a block's storage slots and no memory is idle:
        vLLM's hybrid allocator does the same. E.g. Llama-4-Scout (36 chunked, 12 global layers) gives
        three chunked groups and one global group of 12 layers each.
        """
        by_chunk: dict[int, list[int]] = {}
        for i, spec in enumerate(self.model.layers):
            if spec.kv_source is None:
                by_chunk.setdefault(spec.chunk_size, []).append(i)
        size = math.gcd(*(len(layers) for layers in by_chunk.values()))
        groups: list[KVGroup] = []
        for chunk_size, layers in by_chunk.items():
            for start in range(0, len(layers), size):
                members = tuple(layers[start : start + size])
                sharers = tuple(
                    i
                    for i, spec in enumerate(self.model.layers)
                    if spec.kv_source is not None and spec.kv_source in members
                )
                groups.append(KVGroup(len(groups), chunk_size, members, sharers))
        return tuple(groups)

    @property
    def group_size(self) -> int:
        """Writing layers per KV group = storage slots per block."""
        return len(self.kv_groups[0].layers)


def demo_model() -> ModelShape:
    """What ``chunkattn-server`` serves with no arguments: 4 layers as Llama 4 interleaves them (3 chunked
    with C = 1024, then 1 global), 8 query and 2 KV heads of size 64."""
    return ModelShape.interleaved(
        num_layers=4, chunk_size=1024, global_every=4, num_heads=8, num_kv_heads=2, head_size=64
    )


# -- the server around the engine --------------------------------------------------------------------------

# The largest message. gRPC Python builds each received message on the event loop, every other call waiting,
# so this also bounds the longest pause one client can cause (docs/results.md, "Message size and pauses").
# 16 MiB holds a 1,024-token Llama-4-Scout prefill in bf16 (14 MiB of q, k and v).
DEFAULT_MAX_MESSAGE_MIB = 16
# Calls open at once, idle streams and calls still being received included (gRPC's own limit, which refuses
# health checks too): the only bound on what gRPC buffers before the service sees a request, at most this
# many largest messages.
DEFAULT_MAX_OPEN_CALLS = 1024
DEFAULT_IMPORT_STALL_S = 60.0  # an import that sends nothing this long is abandoned and its blocks returned
DEFAULT_STREAM_IDLE_S = 300.0  # a stream that makes no progress this long is closed
DEFAULT_TRANSFER_KEEPALIVE_S = 30.0  # TransferKV's channels ping their target after this long without news
DEFAULT_MAX_BATCH_TOKENS = 8192  # tokens one engine step merges from queued Attend calls of one layer
DEFAULT_DATA_PLANE_SESSION_S = 3600.0  # a data-plane session lives this long (OpenDataPlane's expires_in_s)
MAX_DATA_PLANE_SESSION_S = 7 * 86400.0


def default_inflight_bytes(max_message_bytes: int) -> int:
    """The request bytes a server holds at once unless told: an eighth of the machine's memory (each request
    in flight costs about 2-4x its size while it is parsed, served and answered), at least one largest
    message, at most 32 GiB."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        memory = 16 << 30
    return max(max_message_bytes, min(memory // 8, 32 << 30))


@dataclass(frozen=True)
class ServerConfig:
    """Network and limits (docs/server.md, "Limits and errors", lists them with their statuses).

    metrics_port 0 disables /metrics; idle_timeout_s 0 disables eviction; max_concurrent_rpcs and max_open_calls
    0 set no limit;
    stream_idle_s and kv_import_stall_s 0 let streams wait for ever (the client's deadline still applies);
    transfer_keepalive_s 0 sends no keepalive pings to TransferKV's targets (else see
    chunkattn_client.client.check_keepalive); max_inflight_bytes None: ``default_inflight_bytes``.
    batching: merge queued Attend calls of one layer into one engine step, up to max_batch_tokens tokens,
    waiting up to max_batch_delay_us for more (0: batch what is queued, never wait). inline_steps: on the
    CPU, let the event loop's thread run small steps itself while the engine thread is idle (see
    scheduler.Scheduler).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_MIB << 20
    max_concurrent_rpcs: int = 64
    max_open_calls: int = DEFAULT_MAX_OPEN_CALLS
    max_inflight_bytes: int | None = None
    idle_timeout_s: float = 600.0
    grace_s: float = 10.0
    drain_delay_s: float = 0.0
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S
    kv_import_stall_s: float = DEFAULT_IMPORT_STALL_S
    transfer_keepalive_s: float = DEFAULT_TRANSFER_KEEPALIVE_S
    batching: bool = True
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_batch_delay_us: int = 0
    inline_steps: bool = True
    # Security (docs/security.md): TLS files, the token file, and how TransferKV reaches its targets.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_tokens: str | None = None
    transfer_token: str = ""
    transfer_tls_ca: str | None = None
    transfer_tls_cert: str | None = None
    transfer_tls_key: str | None = None
    transfer_targets: tuple[str, ...] = ()
    # The data plane (service/dataplane.py): Attend over ZeroMQ, on a TCP HOST:PORT and/or an ipc socket path
    # ("auto": one in a fresh folder of the runtime directory); the host tcp endpoints are given out with
    # (None: the bound host, or this machine's name when bound to every address); how long a session lives.
    data_plane_tcp: str | None = None
    data_plane_ipc: str | None = None
    data_plane_advertise: str | None = None
    data_plane_session_s: float = DEFAULT_DATA_PLANE_SESSION_S

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together: give both to serve TLS, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca (mutual TLS) needs TLS: give --tls-cert and --tls-key too")
        problem = self.transfer_token and token_problem(self.transfer_token, "--transfer-token")
        if problem:
            raise ConfigError(problem)
        for target in self.transfer_targets:
            problem = target_problem(target)
            if problem:
                raise ConfigError(f"--transfer-targets: {problem}")
        if (self.transfer_token or self.transfer_tls_cert) and not self.transfer_targets:
            raise ConfigError(
                "--transfer-token and --transfer-tls-cert are the server's own credentials: name the targets they"
                " may go to with --transfer-targets (a tenant names the target of its transfer, so to any other"
                " it could take them); requests can always bring their own target_token"
            )
        if self.max_batch_tokens < 1 or self.max_batch_delay_us < 0:
            raise ConfigError(
                f"max_batch_tokens must be >= 1 and max_batch_delay_us >= 0, got {self.max_batch_tokens} and"
                f" {self.max_batch_delay_us}"
            )
        if self.max_inflight_bytes is not None and self.max_inflight_bytes < self.max_message_bytes:
            raise ConfigError(
                f"the bytes in flight ({self.max_inflight_bytes >> 20} MiB) must hold at least one largest message"
                f" ({self.max_message_bytes >> 20} MiB): raise --max-inflight-mib or lower --max-message-mib"
            )
        self._check_data_plane()

    def _check_data_plane(self) -> None:
        if self.data_plane_tcp is not None:
            data_plane_host_port(self.data_plane_tcp)
        if self.data_plane_ipc is not None and not self.data_plane_ipc:
            raise ConfigError("--data-plane-ipc needs a socket path, or the word auto")
        if self.data_plane_advertise is not None:
            if self.data_plane_tcp is None:
                raise ConfigError("--data-plane-advertise names the host of the tcp data plane: give --data-plane-tcp")
            if not self.data_plane_advertise or any(c in self.data_plane_advertise for c in "/ :[]"):
                raise ConfigError(
                    f"--data-plane-advertise must be a host name or an IPv4 address, got {self.data_plane_advertise!r}"
                    " (an IPv6 address goes in brackets in --data-plane-tcp; it is advertised as bound)"
                )
        if not 0 < self.data_plane_session_s <= MAX_DATA_PLANE_SESSION_S:
            raise ConfigError(
                f"--data-plane-session-s must be > 0 and at most {MAX_DATA_PLANE_SESSION_S:g} (a week), got"
                f" {self.data_plane_session_s}"
            )

    @property
    def data_plane(self) -> bool:
        """Whether the server offers a data plane (--data-plane-tcp or --data-plane-ipc)."""
        return self.data_plane_tcp is not None or self.data_plane_ipc is not None

    def trusts(self, target: str) -> bool:
        """Whether ``target`` may receive the server's own credentials (--transfer-targets): a tenant names the
        target of its transfer, so to any other it could take them."""
        return target in self.transfer_targets

    def transfer_token_for(self, target: str) -> str:
        """The token TransferKV presents to ``target`` when the request brings none."""
        return self.transfer_token if self.trusts(target) else ""

    @property
    def inflight_bytes(self) -> int:
        """max_inflight_bytes, or the default for this machine."""
        if self.max_inflight_bytes is not None:
            return self.max_inflight_bytes
        return default_inflight_bytes(self.max_message_bytes)


def data_plane_host_port(value: str) -> tuple[str, int]:
    """--data-plane-tcp's HOST:PORT ([IPv6]:PORT) as (host, port); port 0: any free one. ConfigError saying
    what was expected."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address without brackets: refused below
    if not sep or not host or not port.isdigit() or int(port) > 65535 or any(c in host for c in "/ []"):
        raise ConfigError(
            f"--data-plane-tcp must be HOST:PORT ([IPv6]:PORT; port 0: any free one), got {value[:100]!r}"
        )
    return host, int(port)


def check_together(engine: EngineConfig, server: ServerConfig) -> None:
    """What neither config can check alone. ConfigError for --kv-scales calibrate on a server with tenants
    (--auth-tokens): a calibrating layer's first write sets the float8 scales every later write of every
    tenant is stored over, so one tenant could choose (or ruin: a first write of huge or tiny values) the
    quantization of the others' KV."""
    scales = engine.cache.scales
    calibrating = scales is not None and scales.calibrate and None in scales.per_layer(engine.model.kv_sources)
    if server.auth_tokens is not None and calibrating:
        raise ConfigError(
            "--kv-scales calibrate lets the first write of any client set the float8 scales of every tenant's KV:"
            " on a server with tenants (--auth-tokens) give the scales in a --kv-scales file (the checkpoint's,"
            " or measured on your own data), with no layer left to calibrate"
        )
