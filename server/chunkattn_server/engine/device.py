"""The device the engine owns and the attention backend that runs on it."""

from __future__ import annotations

import logging

import torch

from chunkattn_server.attention.backends import Backend, TorchBackend
from chunkattn_server.errors import ConfigError

log = logging.getLogger("chunkattn_server")


def resolve_device(name: str) -> torch.device:
    """ "auto" -> CUDA when available, else CPU. Asking for CUDA without one is a start-up error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for but torch sees no CUDA device; use --device cpu")
    return device


def make_backend(name: str, device: torch.device) -> Backend:
    """ "auto": triton on CUDA, native on the CPU; or the one named. "native" where its kernels cannot be built
    or loaded (no compiler, another device): the torch backend, with a warning saying why."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "native"
    if name == "triton":
        try:
            from chunkattn_server.attention.backends.triton_backend import TritonBackend  # imports triton
        except ImportError as e:
            raise ConfigError(
                f"--backend triton needs triton, which this install lacks ({e}): torch's CUDA build brings it;"
                " on the CPU use --backend native or torch"
            ) from None

        return TritonBackend(device)
    if name == "native":
        from chunkattn_server.attention.backends.native import build
        from chunkattn_server.attention.backends.native.backend import NativeBackend

        try:
            return NativeBackend(device)
        except build.NativeUnavailable as e:
            log.warning("the native backend is unavailable (%s): serving with the torch backend", e)
    return TorchBackend(device)
