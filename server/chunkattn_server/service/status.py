"""The one table from domain errors (errors.py) to gRPC status codes; nothing else decides a status."""

from __future__ import annotations

import asyncio

import grpc
import torch

from chunkattn_server.errors import (
    DataLoss,
    GrantExists,
    GrantMismatch,
    InvalidArgument,
    NotOffered,
    OutOfBlocks,
    Overloaded,
    PositionMismatch,
    SequenceChanged,
    SequenceExists,
    ShuttingDown,
    StreamStalled,
    Unauthenticated,
    UnknownGrant,
    UnknownSequence,
    UnknownSpace,
)


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
    UnknownSpace: grpc.StatusCode.NOT_FOUND,
    UnknownGrant: grpc.StatusCode.NOT_FOUND,
    GrantExists: grpc.StatusCode.ALREADY_EXISTS,
    GrantMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    SequenceExists: grpc.StatusCode.ALREADY_EXISTS,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    SequenceChanged: grpc.StatusCode.ABORTED,
    PositionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    OutOfBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StreamStalled: grpc.StatusCode.DEADLINE_EXCEEDED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    NotOffered: grpc.StatusCode.FAILED_PRECONDITION,
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


def outcome_code(error: BaseException) -> grpc.StatusCode:
    """What a call that ended with ``error`` is counted as: CANCELLED when its client went away (the handler
    cancelled, or a stream's generator closed), else the status the caller gets."""
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return status_code(error)
