"""Domain errors and the one table that maps them to gRPC status codes.

The engine raises these; nothing but ``status_code`` decides which status a client sees. Every message
says what was wrong and what was expected. A raised request error means the request changed nothing.
"""

from __future__ import annotations

import grpc
import torch


class ConfigError(ValueError):
    """The server's configuration is invalid (raised at start-up, never per request)."""


class EngineError(Exception):
    """A request the engine cannot serve; the engine's state is exactly as before the request."""


class InvalidArgument(EngineError):
    """The request itself is malformed, whatever the server's state."""


class UnknownLayer(InvalidArgument):
    """The layer index is not one of the model's layers."""


class InvalidTensor(InvalidArgument):
    """A tensor has the wrong shape, dtype or presence for the call."""


class InvalidBatch(InvalidArgument):
    """The batch metadata is malformed: empty, bad lengths, a sequence twice."""


class UnknownSequence(EngineError):
    """The sequence does not exist and the call does not start it (position > 0)."""


class IncompatibleKV(InvalidArgument):
    """Imported KV does not fit this engine: another model shape, or a manifest that contradicts itself."""


class DataLoss(EngineError):
    """Imported KV arrived damaged or incomplete (a checksum mismatch, a truncated stream)."""


class SequenceChanged(EngineError):
    """A sequence changed while it was being exported (a call to it ran in between): export it again."""


class SequenceExists(EngineError):
    """A sequence id that is already in use where a new one is required (fork, import)."""


class PositionMismatch(EngineError):
    """The position disagrees with the sequence's state in that layer."""


class StreamStalled(EngineError):
    """A stream made no progress for longer than the server waits (its client sent nothing, or read nothing);
    it was closed and what it held returned."""


class Overloaded(EngineError):
    """The server is serving as much as its limits allow (calls at once, bytes in flight): retry later."""


class ShuttingDown(EngineError):
    """The server is draining: reconnect elsewhere."""


class OutOfBlocks(EngineError):
    """The KV pool has too few free blocks for the call. A normal condition: retry later or release."""


class QuotaExceeded(OutOfBlocks):
    """The call would take its tenant past a quota (KV blocks or sequences held): release, or ask the operator."""


class Unauthenticated(EngineError):
    """The call carries no valid credentials (a token, or a client certificate that names a tenant)."""


class TooManyCalls(Overloaded):
    """The caller's tenant is working on as many calls as its quota allows: retry later."""


class TargetError(Exception):
    """Another server (TransferKV's target) refused or failed a call; carries that server's status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc(cls, err: grpc.RpcError, target: str) -> TargetError:
        code = getattr(err, "code", lambda: None)()
        details = getattr(err, "details", lambda: None)()
        code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
        return cls(code, f"the target {target} did not import the KV: {code.name}: {details or err}")


_STATUS: dict[type[BaseException], grpc.StatusCode] = {
    # Out of device or host memory inside a call: the engine rolled back; retry smaller or later.
    torch.OutOfMemoryError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    MemoryError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSequence: grpc.StatusCode.NOT_FOUND,
    SequenceExists: grpc.StatusCode.ALREADY_EXISTS,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    SequenceChanged: grpc.StatusCode.ABORTED,
    PositionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    OutOfBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StreamStalled: grpc.StatusCode.DEADLINE_EXCEEDED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC status for an error: another server's own (TargetError), else its nearest class in the
    table, INTERNAL for anything unexpected."""
    if isinstance(error, TargetError):
        return error.code
    for cls in type(error).__mro__:
        code = _STATUS.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL
