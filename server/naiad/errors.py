"""One error hierarchy for the whole server, and its single mapping to HTTP and gRPC status codes."""

from __future__ import annotations

import grpc


class NaiadError(Exception):
    """Base of every error a client may see. `http_status`/`grpc_status` decide how frontends report it."""

    http_status = 400
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    triton_code = "TRITONSERVER_ERROR_INVALID_ARG"
    retry_after: float | None = None  # seconds: HTTP `Retry-After`, gRPC `retry-after` trailing metadata

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(NaiadError):
    pass


class NotFound(NaiadError):
    http_status, grpc_status, triton_code = 404, grpc.StatusCode.NOT_FOUND, "TRITONSERVER_ERROR_NOT_FOUND"


class Unavailable(NaiadError):
    http_status, grpc_status, triton_code = 503, grpc.StatusCode.UNAVAILABLE, "TRITONSERVER_ERROR_UNAVAILABLE"


class TooManyRequests(NaiadError):
    """Refused for now, come back later: HTTP 429, gRPC UNAVAILABLE, both saying when (`retry_after`)."""

    http_status, grpc_status, triton_code = 429, grpc.StatusCode.UNAVAILABLE, "TRITONSERVER_ERROR_UNAVAILABLE"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Internal(NaiadError):
    http_status, grpc_status, triton_code = 500, grpc.StatusCode.INTERNAL, "TRITONSERVER_ERROR_INTERNAL"


class Unsupported(NaiadError):
    http_status, grpc_status, triton_code = (
        400,
        grpc.StatusCode.UNIMPLEMENTED,
        "TRITONSERVER_ERROR_UNSUPPORTED",
    )


class AlreadyExists(NaiadError):
    http_status, grpc_status, triton_code = (
        409,
        grpc.StatusCode.ALREADY_EXISTS,
        "TRITONSERVER_ERROR_ALREADY_EXISTS",
    )


class PermissionDenied(NaiadError):
    http_status, grpc_status, triton_code = (
        403,
        grpc.StatusCode.PERMISSION_DENIED,
        "TRITONSERVER_ERROR_UNAVAILABLE",
    )


class Cancelled(NaiadError):
    http_status, grpc_status, triton_code = 499, grpc.StatusCode.CANCELLED, "TRITONSERVER_ERROR_CANCELLED"


def as_naiad_error(exc: BaseException) -> NaiadError:
    """Wrap anything a model or backend raised into a NaiadError; keep NaiadErrors as they are."""
    if isinstance(exc, NaiadError):
        return exc
    return Internal(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
