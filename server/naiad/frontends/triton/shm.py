"""HTTP and gRPC handlers of the shared memory extensions (system and CUDA) over `naiad.shared_memory`'s managers.

The system extension's HTTP routes are `HttpFrontend`'s own (plain JSON); the CUDA one's body carries the IPC
handle in base64 and answers as Triton does on a host whose CUDA runtime is unusable (`manager.reason`).
"""

from __future__ import annotations

import base64
import binascii

import orjson
from aiohttp import web
from tritonclient.grpc import service_pb2 as pb

from ...errors import InvalidArgument, NotFound
from ...shared_memory.cuda import CudaSharedMemoryManager
from ...shared_memory.system import SharedMemoryManager

# ---- system shared memory, gRPC ----


def system_register_grpc(manager: SharedMemoryManager, request):
    manager.register(request.name, request.key, request.offset, request.byte_size)
    return pb.SystemSharedMemoryRegisterResponse()


def system_unregister_grpc(manager: SharedMemoryManager, request):
    manager.unregister(request.name)
    return pb.SystemSharedMemoryUnregisterResponse()


def system_status_grpc(manager: SharedMemoryManager, request):
    resp = pb.SystemSharedMemoryStatusResponse()
    for s in manager.status(request.name):
        r = resp.regions[s["name"]]
        r.name, r.key, r.offset, r.byte_size = s["name"], s["key"], s["offset"], s["byte_size"]
    return resp


# ---- CUDA shared memory, HTTP: /v2/cudasharedmemory/... ----


async def cuda_http(manager: CudaSharedMemoryManager, request) -> web.Response:
    region = request.match_info.get("region", "")
    if request.method == "GET":
        if not manager.available:
            manager.check_enabled()
            if region:
                raise NotFound(f"Unable to find cuda shared memory region: '{region}'")
            return web.Response(body=b"[]", content_type="application/json")
        return web.Response(body=orjson.dumps(manager.status(region)), content_type="application/json")
    manager.check_enabled()
    if manager.reason is not None:  # as without a GPU: every POST is refused with the reason
        raise InvalidArgument(manager.reason)
    if request.path.endswith("/register"):
        body = await request.read()
        try:
            doc = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"failed to parse the request JSON buffer: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("the request body must be a JSON object")
        manager.register(
            region, _b64_handle(doc.get("raw_handle")), doc.get("device_id", 0), doc.get("byte_size", 0)
        )
        return web.Response(status=200)
    manager.unregister(region)
    return web.Response(status=200)


def _b64_handle(raw) -> bytes:
    """HTTP's `"raw_handle": {"b64": "<base64 of the 64-byte cudaIpcMemHandle_t>"}`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("b64"), str):
        raise InvalidArgument(
            "cuda shared memory registration needs 'raw_handle': {\"b64\": <base64 handle>}"
        )
    try:
        return base64.b64decode(raw["b64"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument("cuda shared memory 'raw_handle.b64' is not valid base64") from None


# ---- CUDA shared memory, gRPC ----


def cuda_status_grpc(manager: CudaSharedMemoryManager, request):
    resp = pb.CudaSharedMemoryStatusResponse()
    if not manager.available:
        manager.check_enabled()
        if request.name:
            raise NotFound(f"Unable to find cuda shared memory region: '{request.name}'")
        return resp
    for s in manager.status(request.name):
        r = resp.regions[s["name"]]
        r.name, r.device_id, r.byte_size = s["name"], s["device_id"], s["byte_size"]
    return resp


def cuda_register_grpc(manager: CudaSharedMemoryManager, request):
    manager.register(request.name, bytes(request.raw_handle), request.device_id, request.byte_size)
    return pb.CudaSharedMemoryRegisterResponse()


def cuda_unregister_grpc(manager: CudaSharedMemoryManager, request):
    if manager.available:
        manager.unregister(request.name)
    else:
        manager.check_enabled()
    return pb.CudaSharedMemoryUnregisterResponse()
