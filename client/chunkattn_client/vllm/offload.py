"""One vLLM worker's link to a chunkattn server: its configuration (from the environment), the check of the
server against vLLM's model and cache, its block space, and each layer's call. No vLLM import here: the
vLLM classes (backend.py) describe the model as ``LayerShape`` values.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from chunkattn_client import dtypes
from chunkattn_client._torch import to_torch
from chunkattn_client._types import BlockSpace
from chunkattn_client.batch import BlockRows
from chunkattn_client.client import ChunkAttnClient, ChunkAttnError, ServerInfo
from chunkattn_client.limits import MAX_LEASE_S, MIN_LEASE_S
from chunkattn_client.split import block_calls, message_limit

Transport = Literal["stream", "unary"]
# The client's data plane setting (ChunkAttnClient's data_plane), from the variable the client reads too.
DATA_PLANE_ENV = "CHUNKATTN_DATA_PLANE"
DATA_PLANES = ("auto", "grpc", "zmq")
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_LEASE_S = 30.0

log = logging.getLogger("chunkattn_client.vllm")


class Stream(Protocol):
    """What the worker needs of its client's stream (``ChunkAttnClient.stream()``: gRPC's AttendStream, or the
    data plane's): block calls in order, and closing."""

    def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Any:
        """One layer's block call: the output [T, H, D]."""

    def close(self) -> None:
        """Close the stream."""


class OffloadError(RuntimeError):
    """The server cannot serve this vLLM instance (another model, cache or block size, too small a pool), or
    a call failed; the message says what and what to change."""


@dataclass(frozen=True)
class PluginConfig:
    """What the plugin is pointed at, from the environment (all optional but the target):

    CHUNKATTN_VLLM_TARGET     host:port of the server (or Envoy); unset: the plugin is off
    CHUNKATTN_VLLM_TOKEN      bearer token (servers with --auth-tokens)
    CHUNKATTN_VLLM_TLS_CA     PEM file: connect over TLS, trusting it; CHUNKATTN_VLLM_TLS_CERT / _KEY: a
                              client certificate (mutual TLS)
    CHUNKATTN_VLLM_TIMEOUT_S  per call (default 60): a server that stops answering fails the step, no hang
    CHUNKATTN_VLLM_TRANSPORT  stream (default: one AttendStream per worker) or unary
    CHUNKATTN_VLLM_ROUTE      routing key behind Envoy (default: one random key per worker, so that its
                              space and calls stay on one replica)
    CHUNKATTN_VLLM_PROFILE    a file: the worker writes where its layer calls' time went there (JSON) when it
                              closes (benchmarks/vllm_offload.py reads it)
    CHUNKATTN_VLLM_LEASE_S    the space's lease (default 30): the worker renews it every third of that, so a
                              worker killed without closing its space leaves it on the server that long at most
    CHUNKATTN_VLLM_KV_BLOCKS  the block space's size in blocks: vLLM schedules with exactly that many KV blocks
                              (its own kv_cache_memory_bytes / gpu_memory_utilization no longer size its KV)
    CHUNKATTN_VLLM_KV_BYTES   or a byte budget on the server, in blocks of Info's bytes_per_block times the pool
                              blocks a space block takes; neither: vLLM sizes its KV cache and the space follows
    CHUNKATTN_DATA_PLANE      the client's data plane for the layer calls: auto (default: the server's data plane
                              where it offers one, else gRPC), grpc or zmq (the data plane, or an error)
    """

    target: str
    token: str | None = None
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: Transport = "stream"
    route: str = ""
    profile: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    kv_blocks: int | None = None
    kv_bytes: int | None = None
    data_plane: str = "auto"

    @property
    def sizes_kv(self) -> bool:
        """Whether the plugin sizes vLLM's KV cache (CHUNKATTN_VLLM_KV_BLOCKS or _KV_BYTES), not vLLM."""
        return self.kv_blocks is not None or self.kv_bytes is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PluginConfig | None:
        """The configuration, or None when CHUNKATTN_VLLM_TARGET is unset (the plugin stays out of the way).
        OffloadError naming the variable for a value it cannot use."""
        target = env.get("CHUNKATTN_VLLM_TARGET", "").strip()
        if not target:
            return None
        transport = env.get("CHUNKATTN_VLLM_TRANSPORT", "stream")
        if transport not in ("stream", "unary"):
            raise OffloadError(f"CHUNKATTN_VLLM_TRANSPORT must be stream or unary, got {transport!r}")
        timeout_s = _seconds(env, "CHUNKATTN_VLLM_TIMEOUT_S", DEFAULT_TIMEOUT_S, 0.0, math.inf)
        lease_s = _seconds(env, "CHUNKATTN_VLLM_LEASE_S", DEFAULT_LEASE_S, MIN_LEASE_S, MAX_LEASE_S)
        kv_blocks = _count(env, "CHUNKATTN_VLLM_KV_BLOCKS")
        kv_bytes = _count(env, "CHUNKATTN_VLLM_KV_BYTES")
        if kv_blocks is not None and kv_bytes is not None:
            raise OffloadError("set CHUNKATTN_VLLM_KV_BLOCKS or CHUNKATTN_VLLM_KV_BYTES, not both")
        data_plane = env.get(DATA_PLANE_ENV, "") or "auto"
        if data_plane not in DATA_PLANES:
            raise OffloadError(f"{DATA_PLANE_ENV} must be one of {', '.join(DATA_PLANES)}, got {data_plane!r}")
        return cls(
            target=target,
            token=env.get("CHUNKATTN_VLLM_TOKEN") or None,
            root_certificates=_read(env, "CHUNKATTN_VLLM_TLS_CA"),
            certificate_chain=_read(env, "CHUNKATTN_VLLM_TLS_CERT"),
            private_key=_read(env, "CHUNKATTN_VLLM_TLS_KEY"),
            timeout_s=timeout_s,
            transport="unary" if transport == "unary" else "stream",
            route=env.get("CHUNKATTN_VLLM_ROUTE") or f"vllm-{uuid.uuid4().hex[:16]}",
            profile=env.get("CHUNKATTN_VLLM_PROFILE") or None,
            lease_s=lease_s,
            kv_blocks=kv_blocks,
            kv_bytes=kv_bytes,
            data_plane=data_plane,
        )


def _count(env: Mapping[str, str], name: str) -> int | None:
    """A positive whole number variable (blocks, bytes; "1_000" and "1000" alike), None when unset; OffloadError
    naming it otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise OffloadError(f"{name} must be a whole number > 0, got {raw!r}") from None
    if value <= 0:
        raise OffloadError(f"{name} must be a whole number > 0, got {value}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    """A duration variable: ``default`` when unset; OffloadError naming it unless a number in (low, high] for
    low 0, else [low, high]."""
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise OffloadError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (0 < value <= high if low == 0 else low <= value <= high):  # NaN fails both
        bounds = "> 0" if low == 0 and high == math.inf else f"{low:g} to {high:g} seconds"
        raise OffloadError(f"{name} must be {bounds}, got {value}")
    return value


def _read(env: Mapping[str, str], name: str) -> bytes | None:
    path = env.get(name)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise OffloadError(f"{name}={path}: {e.strerror}") from None


@dataclass(frozen=True)
class LayerShape:
    """One of vLLM's attention layers as the server must serve it. cache_dtype: vLLM's kv_cache_dtype
    ("auto": the model's dtype); k_scale, v_scale: its float8 scales; kv_source: the layer it reads KV from
    (KV sharing), or None."""

    index: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    chunk_size: int
    kv_source: int | None
    alibi_slopes: tuple[float, ...]
    cache_dtype: str
    model_dtype: str
    k_scale: float = 1.0
    v_scale: float = 1.0


def first_difference(info: ServerInfo, layers: Sequence[LayerShape], block_size: int) -> str | None:
    """What keeps the server from serving these layers exactly as vLLM's own backend would, or None."""
    if len(layers) != len(info.layers):
        return f"vLLM's model has {len(layers)} attention layers, the server's {len(info.layers)}"
    if block_size != info.block_size:
        return (
            f"vLLM's KV blocks hold {block_size} tokens, the server's {info.block_size}"
            f" (start it with --block-size {block_size})"
        )
    for mine, theirs in zip(layers, info.layers, strict=True):
        i = mine.index
        checks = [
            ("query heads", mine.num_heads, info.num_heads),
            ("KV heads", mine.num_kv_heads, info.num_kv_heads),
            ("head size", mine.head_size, info.head_size),
            ("chunk size", mine.chunk_size, theirs.chunk_size),
            ("KV source", mine.kv_source, theirs.kv_source),
        ]
        for what, want, got in checks:
            if want != got:
                return f"layer {i}'s {what}: vLLM's is {want}, the server's {got}"
        if not math.isclose(mine.scale, theirs.scale, rel_tol=1e-6):
            return f"layer {i}'s softmax scale: vLLM's is {mine.scale}, the server's {theirs.scale}"
        if tuple(mine.alibi_slopes) != tuple(theirs.alibi_slopes):
            return f"layer {i}'s ALiBi slopes: vLLM's are {mine.alibi_slopes}, the server's {theirs.alibi_slopes}"
        cache = mine.model_dtype if mine.cache_dtype == "auto" else dtypes.lookup(mine.cache_dtype).name
        if cache != info.cache_dtype:
            return (
                f"vLLM caches KV in {cache}, the server in {info.cache_dtype} (start it with --kv-cache-dtype {cache})"
            )
        if dtypes.lookup(cache).fp8 and (mine.k_scale, mine.v_scale) != (theirs.k_scale, theirs.v_scale):
            return (
                f"layer {i}'s float8 scales: vLLM's are ({mine.k_scale}, {mine.v_scale}), the server's"
                f" ({theirs.k_scale}, {theirs.v_scale}) (give the server the same with --kv-scales)"
            )
    computes = info.compute_dtype or info.cache_dtype
    if layers and layers[0].model_dtype != computes:
        dtype = layers[0].model_dtype
        return f"the model computes in {dtype}, the server's attention in {computes} (start it with --dtype {dtype})"
    return None


def connect(config: PluginConfig) -> ChunkAttnClient:
    """A client for ``config``'s server, on the data plane ``config.data_plane`` asks for. A client without the
    data plane (an older chunkattn-client) serves "auto" over gRPC and refuses "zmq"."""
    options: dict[str, Any] = {}
    if "data_plane" in inspect.signature(ChunkAttnClient).parameters:
        options["data_plane"] = config.data_plane
    elif config.data_plane == "zmq":
        raise OffloadError(f"{DATA_PLANE_ENV}=zmq: this chunkattn-client has no data plane (use auto or grpc)")
    return ChunkAttnClient(
        config.target,
        token=config.token,
        root_certificates=config.root_certificates,
        certificate_chain=config.certificate_chain,
        private_key=config.private_key,
        timeout_s=config.timeout_s,
        route=config.route,
        **options,
    )


def server_info(config: PluginConfig) -> ServerInfo:
    """The server's Info, on a connection of its own (the worker sizes vLLM's KV cache before it opens its
    Offload); OffloadError naming the server when it cannot be reached."""
    try:
        with connect(config) as client:
            return client.info()
    except ChunkAttnError as e:
        raise OffloadError(f"the chunkattn server at {config.target}: {e}") from None


def space_blocks(config: PluginConfig, info: ServerInfo, planes: int) -> int:
    """The blocks of the space the plugin sizes (its sizes_kv property): CHUNKATTN_VLLM_KV_BLOCKS, or
    CHUNKATTN_VLLM_KV_BYTES over one space block's bytes on the server
    (``ServerInfo.pool_blocks_per_space_block`` blocks of Info's bytes_per_block). OffloadError when that is no
    block, or more than the server's pool has free (the message says how many it has and what to set); the
    tenant's quota is the server's to check, when the space opens."""
    per_block = info.pool_blocks_per_space_block(planes)
    if config.kv_blocks is not None:
        blocks, asked = config.kv_blocks, f"CHUNKATTN_VLLM_KV_BLOCKS={config.kv_blocks}"
    elif config.kv_bytes is not None:
        cost = per_block * info.bytes_per_block
        blocks, asked = config.kv_bytes // max(1, cost), f"CHUNKATTN_VLLM_KV_BYTES={config.kv_bytes}"
        if blocks == 0:
            raise OffloadError(
                f"{asked} is less than one KV block on the chunkattn server at {config.target} ({cost} bytes:"
                f" {per_block} pool block(s) of {info.bytes_per_block} bytes for the model's {planes} planes)"
            )
    else:
        raise OffloadError("the plugin sizes vLLM's KV cache only with CHUNKATTN_VLLM_KV_BLOCKS or _KV_BYTES")
    needed = blocks * per_block
    if needed > info.free_blocks:
        raise OffloadError(
            f"{asked} asks for a block space of {blocks} blocks, which take {needed} of the server's blocks"
            f" ({per_block} each for the model's {planes} planes), and the pool of the chunkattn server at"
            f" {config.target} has {info.free_blocks} free of {info.num_blocks}: set CHUNKATTN_VLLM_KV_BLOCKS to at"
            f" most {info.free_blocks // per_block}, or start the server with a larger pool (--kv-memory-mib)"
        )
    return blocks


class Offload:
    """A worker's server link: checks the server against ``layers`` and opens a block space of
    ``num_blocks`` blocks of ``block_size`` tokens laid out in ``planes`` (per layer; vLLM's KV tensors:
    layers that alias one buffer share one plane), on one route. OffloadError when the server cannot."""

    def __init__(
        self,
        config: PluginConfig,
        layers: Sequence[LayerShape],
        num_blocks: int,
        block_size: int,
        planes: Sequence[int],
    ) -> None:
        self.config = config
        self.client = connect(config)
        self._stream: Stream | None = None
        self.space_id = ""
        self._renewer: threading.Thread | None = None
        self._closing = threading.Event()
        # Where the layer calls' time goes, in seconds: vLLM's metadata to arrays; the calls (request encoding,
        # the round trip, the answer's decoding, the answer into vLLM's output).
        self.profile = {"calls": 0, "tokens": 0, "metadata_s": 0.0, "call_s": 0.0}
        try:
            self.info = self.client.info()
            problem = first_difference(self.info, layers, block_size)
            if problem:
                raise OffloadError(
                    f"the chunkattn server at {config.target} does not serve this model: {problem}."
                    " Start it with: chunkattn-server --hf-config <the model's config.json>"
                    f" --block-size {block_size}"
                )
            space = self._open(num_blocks, planes)
            self.space_id = space.space_id
            if space.lease_s:
                self._renewer = threading.Thread(
                    target=self._renew, args=(space.lease_s / 3,), name="chunkattn-lease", daemon=True
                )
                self._renewer.start()
            if config.transport == "stream":
                self._stream = self.client.stream()
        except ChunkAttnError as e:
            self.close()
            raise OffloadError(f"the chunkattn server at {config.target}: {e}") from None
        except BaseException:
            self.close()
            raise

    def _open(self, num_blocks: int, planes: Sequence[int]) -> BlockSpace:
        try:
            return self.client.open_block_space(num_blocks, layer_planes=planes, lease_s=self.config.lease_s)
        except ChunkAttnError as e:
            if e.code.name != "RESOURCE_EXHAUSTED":
                raise
            raise OffloadError(self._refusal(num_blocks, planes, e.message)) from None

    def _refusal(self, num_blocks: int, planes: Sequence[int], message: str) -> str:
        """What the server's RESOURCE_EXHAUSTED for the space says, and what to change: which bound it hit (the
        tenant's opening rate, its number of spaces, its block quota, the pool) and how to size the space."""
        server = f"the chunkattn server at {self.config.target}"
        if "retry in" in message:  # the tenant's opening rate, not the pool: waiting is the fix
            return f"{server} refused a block space for now: {message}"
        if "block spaces open" in message:
            return f"{server} refused a block space: {message} (ListBlockSpaces lists them)"
        per_block = self.info.pool_blocks_per_space_block(max(planes) + 1 if planes else 1)
        smaller = (
            "set CHUNKATTN_VLLM_KV_BLOCKS (or _KV_BYTES) smaller"
            if self.config.sizes_kv
            else "give vLLM a smaller KV cache (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE on the CPU) or set"
            " CHUNKATTN_VLLM_KV_BLOCKS"
        )
        bound, larger = (
            ("your tenant's block quota (max_kv_blocks)", "ask the operator for a larger max_kv_blocks")
            if "max_kv_blocks" in message
            else ("the server's pool", "start the server with a larger pool (--kv-memory-mib)")
        )
        return (
            f"vLLM's KV cache has {num_blocks} blocks of {self.info.block_size} tokens, which take"
            f" {num_blocks * per_block} of the server's blocks, past {bound} on {server} ({message}): {smaller},"
            f" or {larger}"
        )

    def _renew(self, every_s: float) -> None:
        """The lease thread: renew the space every ``every_s`` seconds until closed (a failure is logged and
        tried again: the space's next call says whether it is gone)."""
        while not self._closing.wait(every_s):
            try:
                self.client.renew_block_space(self.space_id)
            except ChunkAttnError as e:
                if e.code.name == "NOT_FOUND":  # gone (its lease ran out, or the server restarted): nothing to keep
                    log.error("chunkattn: block space %s is gone from the server: %s", self.space_id, e.message)
                    return
                log.warning("chunkattn: could not renew block space %s: %s", self.space_id, e)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        metadata: Any,
        output: torch.Tensor,
    ) -> None:
        """One layer's step: vLLM's attention metadata (query_start_loc, seq_lens, block_table, slot_mapping,
        num_actual_tokens) and its q/k/v rows; the answer goes into ``output``'s first rows, in place. A step
        larger than a message (the server's or the client's limit), or than the work the server takes in one call
        (Info's max_call_work), goes in several calls, in token order (``split.block_calls``)."""
        started = time.perf_counter()
        n = int(metadata.num_actual_tokens)
        if n == 0:
            return
        seq_lens = metadata.seq_lens.cpu().numpy().astype(np.int64)
        rows = len(seq_lens)
        starts = metadata.query_start_loc[: rows + 1].cpu().numpy().astype(np.int64)
        if int(starts[-1]) != n:
            raise OffloadError(
                f"layer {layer}: vLLM's rows hold {int(starts[-1])} tokens (query_start_loc), its step {n}"
                " (num_actual_tokens): the plugin sends the rows as they are, and cannot tell which to drop"
            )
        calls = block_calls(
            self.space_id,
            metadata.slot_mapping[:n].cpu().numpy(),
            starts,
            seq_lens,
            # the columns past the widest row's blocks are never read: not copied from the device
            metadata.block_table[:rows, : -(-int(seq_lens.max(initial=0)) // self.info.block_size)].cpu().numpy(),
            block_size=self.info.block_size,
            per_token=(q.shape[1] + (0 if k is None else 2 * k.shape[1])) * q.shape[2] * q.element_size(),
            limit=message_limit(self.info.max_message_bytes, self.client.max_message_bytes),
            max_work=self.info.max_call_work,
        )
        prepared = time.perf_counter()
        for first, last, block_rows in calls:
            qs = q[first:last]
            ks = None if k is None else k[first:last]
            vs = None if v is None else v[first:last]
            try:
                if self._stream is not None:
                    out = self._stream.attend_blocks(layer, block_rows, qs, ks, vs)
                else:
                    out = self.client.attend_blocks(layer, block_rows, qs, ks, vs)
            except ChunkAttnError as e:
                raise OffloadError(f"layer {layer}: the chunkattn server at {self.config.target}: {e}") from None
            output[first:last].copy_(to_torch(np.asarray(out), output.dtype))
        p = self.profile
        p["calls"] += len(calls)
        p["tokens"] += n
        p["metadata_s"] += prepared - started
        p["call_s"] += time.perf_counter() - prepared

    def close(self) -> None:
        """Close the stream and the space (its blocks back to the server's pool) and the channel, and write
        the profile where asked; never raises (it runs at exit, whatever state the server is in)."""
        if self.config.profile and self.profile["calls"]:
            with contextlib.suppress(OSError), open(self.config.profile, "w") as f:
                json.dump(self.profile, f)
        self._closing.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self.space_id:
            with contextlib.suppress(ChunkAttnError):  # a server that is gone, or evicted the space: nothing held
                self.client.close_block_space(self.space_id)
            self.space_id = ""
        self.client.close()
