"""The one way the syncer refuses a call: `Reject`, mapped to a gRPC status at the edge."""

from __future__ import annotations


class Reject(Exception):
    """A call that must be refused; `code` maps to a gRPC status (`syncer.service`):
    invalid | precondition | not_found | unauthenticated | denied | exhausted (the
    island retries later)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
