"""--verify judges each row of a batched call on its own scale: in bfloat16 a decode row whose outputs are small
beside a prefill row's large ones is not let off by the call's scale (the sequences workload's calls carry one
sequence each, so there a call was a row)."""

from __future__ import annotations

import asyncio

import numpy as np

from chunkattn_client import codec
from chunkattn_client.bench.verify import Verifier
from tests.client.test_bench_units import _info


def test_a_small_row_beside_a_large_one_is_judged_on_its_own_scale() -> None:
    want = np.concatenate([np.full((8, 4, 16), 3.0), np.full((1, 4, 16), 0.06)])  # a prefill's rows, then a decode
    wrong = want.copy()
    wrong[8] = 0.0  # the decode answered with zeros: 0.06 off, 2% of the call's scale (3.0) but all of its own
    out = codec.float32_to_bf16(wrong.astype(np.float32))  # what a bfloat16 call's answer holds
    q = codec.float32_to_bf16(np.zeros((9, 4, 16), np.float32))
    for rows, mismatches in (((), 0), ((8, 1), 1)):
        v = Verifier(_info(), "bfloat16", 1, 0)
        asyncio.run(v.compare(0, q, None, None, out, lambda *_: want, {"rows": rows}, rows))
        assert (v.checked, len(v.mismatches)) == (1, mismatches), rows
