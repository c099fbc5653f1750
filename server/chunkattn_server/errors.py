"""Domain errors: plain exceptions, no gRPC (the one table from these to status codes is the service's:
service/status.py).

The engine raises EngineErrors; the service edge raises RequestErrors (a call refused for what it is or
when it comes, whatever it asks of the engine). Every message says what was wrong and what was expected.
A raised error means the request changed nothing.
"""

from __future__ import annotations


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


class UnknownSpace(EngineError):
    """The block space does not exist: closed, evicted idle, never opened, or another tenant's."""


class UnknownGrant(EngineError):
    """A grant (GrantBlocks) that does not exist for the caller: taken, expired, never issued, another tenant's."""


class GrantMismatch(EngineError):
    """A grant whose tag is not the one its taker expects (CopyBlocks' expect_tag): it holds other KV."""


class GrantExists(EngineError):
    """A grant name already in use (GrantBlocks): each grant is named anew."""


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


class RequestError(Exception):
    """A call the service refuses for what it is or when it comes (credentials, limits, draining, a stalled
    stream), apart from anything the engine decides."""


class StreamStalled(RequestError):
    """A stream made no progress for longer than the server waits (its client sent nothing, or read nothing);
    it was closed and what it held returned."""


class Overloaded(RequestError):
    """The server is serving as much as its limits allow (calls at once, bytes in flight): retry later."""


class ShuttingDown(RequestError):
    """The server is draining: reconnect elsewhere."""


class OutOfBlocks(EngineError):
    """The KV pool has too few free blocks for the call. A normal condition: retry later or release."""


class QuotaExceeded(OutOfBlocks):
    """The call would take its tenant past a quota (KV blocks or sequences held): release, or ask the operator."""


class Unauthenticated(RequestError):
    """The call carries no valid credentials (a token, or a client certificate that names a tenant)."""


class TooManyCalls(Overloaded):
    """The caller's tenant is working on as many calls as its quota allows: retry later."""


class NotOffered(RequestError):
    """The server does not offer what the call asks for as it was started (a data plane without its flags)."""
