"""--grpc-restricted-protocol: the API group of each GRPCInferenceService method and the metadata check, for
Naiad's HTTP/2 server (its `authorize` hook) and for grpc.aio (an interceptor)."""

from __future__ import annotations

import hmac

import grpc

_GROUPS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def api_group(method: str) -> str | None:
    """The restricted-protocol group of a GRPCInferenceService method name."""
    return "shared-memory" if "SharedMemory" in method else _GROUPS.get(method)


def _same(given: str | bytes, expected: str) -> bool:
    """Constant-time comparison of a credential."""
    given = given if isinstance(given, bytes) else given.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected.encode("utf-8", "surrogateescape"))


def denial(rules: dict[str, tuple[str, str]], group: str | None, metadata) -> str | None:
    rule = rules.get(group) if group is not None else None
    if rule is None:
        return None
    key, value = rule
    if any(k == key and _same(v, value) for k, v in metadata):
        return None
    return f"This API is restricted, expecting header '{key}'"


class RestrictInterceptor(grpc.aio.ServerInterceptor):
    """--grpc-restricted-protocol: calls of a restricted group need the configured metadata key/value."""

    def __init__(self, rules: dict[str, tuple[str, str]]):
        self.rules = rules

    async def intercept_service(self, continuation, details):
        method = details.method.rsplit("/", 1)[-1]
        message = denial(self.rules, api_group(method), details.invocation_metadata or ())
        if message is None:
            return await continuation(details)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

        async def deny_stream(request_iterator, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            yield  # pragma: no cover - abort raises

        if method == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)
