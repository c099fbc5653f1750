"""chunkattn client: the thin side of chunkattn (numpy, grpcio, protobuf; never torch or triton).

Today it holds the float64 reference that defines the service's semantics; the gRPC client and codecs
arrive with the service.
"""

from chunkattn_client.batch import BatchEntry
from chunkattn_client.reference import ReferenceModel, chunked_attention, visible

__all__ = ["BatchEntry", "ReferenceModel", "__version__", "chunked_attention", "visible"]

__version__ = "0.1.0"
