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


@dataclass(frozen=True)
class BlockRows:
    """The block API's addressing of one call (the proto's BlockBatch): rows of a block space, as a serving
    engine's attention backend sees them (vLLM's CommonAttentionMetadata).

    space_id: OpenBlockSpace's id.
    slot_mapping: [T] integers, per token of q the slot its new K/V goes to (block id * block_size + offset;
        negative: not written).
    query_start_loc: [R + 1] integers, the rows' boundaries in q's tokens (0, ..., T).
    seq_lens: [R] integers, per row its keys; its last q_len are its new tokens.
    block_table: [R, W] integers, per row the block ids holding its keys, in order.

    Each may be a numpy array, a list, or anything ``numpy.asarray`` takes (a CPU torch tensor).
    """

    space_id: str
    slot_mapping: object
    query_start_loc: object
    seq_lens: object
    block_table: object
