"""The dtype table's wire numbers are the proto's: dtypes.py writes them as plain ints (so that the server's core
imports it without protobuf), and this keeps them from drifting."""

from __future__ import annotations

from chunkattn_client import dtypes
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb


def test_every_dtype_has_the_protos_wire_number() -> None:
    for d in dtypes.TABLE:
        assert d.wire == pb.DType.Value("DTYPE_" + d.name.upper()), d.name


def test_the_table_covers_every_wire_dtype_of_the_proto() -> None:
    named = {v for n, v in pb.DType.items() if n != "DTYPE_UNSPECIFIED"}
    assert named == set(dtypes.BY_WIRE)
