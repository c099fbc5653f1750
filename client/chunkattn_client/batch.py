"""The scheduling metadata of one call, shared by the client, the reference and the server's engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's part of a batch.

    seq_id: the sequence's id, chosen by the client.
    position: absolute position of its first new token = the tokens it already has in the called layer.
    num_tokens: how many new tokens it brings (1 for a decode step).
    """

    seq_id: str
    position: int
    num_tokens: int
