"""The one way the syncer refuses a call: `Reject`, mapped to a gRPC status at the edge."""

from __future__ import annotations

import grpc

GRPC_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "denied": grpc.StatusCode.PERMISSION_DENIED,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,  # the island retries later
    "unavailable": grpc.StatusCode.UNAVAILABLE,  # the island joins again
}


class Reject(Exception):
    """A call that must be refused; `code` maps to a gRPC status (`syncer.service`):
    invalid | precondition | not_found | unauthenticated | denied | exhausted (the
    island retries later) | unavailable (the island joins again)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> grpc.StatusCode:
        return GRPC_CODES[self.code]
