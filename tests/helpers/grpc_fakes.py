"""A failed gRPC call as the client sees one, without a server: for tests of the error translation."""

from __future__ import annotations

import grpc


class FakeCall(grpc.RpcError):
    """What a failed gRPC call raises: an RpcError with code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
