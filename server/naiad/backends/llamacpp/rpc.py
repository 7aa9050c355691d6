"""llama.cpp's RPC backend for the llamacpp engine: `rpc-server` processes (on other pods or nodes) as devices a
model's layers are offloaded to, registered once per endpoint through ggml's registry (libggml-rpc).

ggml-rpc aborts the process when it cannot connect to a server, so a server is first known to accept TCP
connections (from here, in Python) before ggml is given its address. One server may lend several devices (its GPUs):
each becomes a device of the model."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from pathlib import Path

from ...errors import InvalidArgument, Unavailable

# The backend's process-wide RPC servers (a model's `rpc_servers` parameter wins): what a LeaderWorkerSet's leader
# gets from the operator, its workers' addresses.
RPC_SERVERS_ENV = "NAIAD_LLAMACPP_RPC_SERVERS"

_lock = threading.Lock()
_devices: dict[str, list[int]] = {}  # endpoint -> its ggml_backend_dev_t's, registered once per process
_libs: tuple[ctypes.CDLL, ctypes.CDLL] | None = None


def parse_rpc_servers(raw: str) -> list[str]:
    """`host:port[,host:port...]`, or `env:<VARIABLE>` naming a variable that holds such a list ('' for none)."""
    value = raw.strip()
    if value.startswith("env:"):
        name = value[len("env:") :]
        if not name:
            raise InvalidArgument("parameter 'rpc_servers': env: names no variable")
        value = os.environ.get(name, "").strip()
    endpoints = [e.strip() for e in value.split(",") if e.strip()]
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"parameter 'rpc_servers': {endpoint!r} is not host:port")
    if len(set(endpoints)) != len(endpoints):
        raise InvalidArgument(f"parameter 'rpc_servers' names a server twice: {value!r}")
    return endpoints


def _load_libs(llama_cpp_module) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    global _libs
    if _libs is None:
        lib_dir = Path(llama_cpp_module.__file__).parent / "lib"
        rpc_path = lib_dir / "libggml-rpc.so"
        if not llama_cpp_module.llama_supports_rpc() or not rpc_path.exists():
            raise Unavailable(
                "this llama-cpp-python was built without GGML_RPC: rebuild it with tools/llama_cpp/build.sh"
            )
        ggml = ctypes.CDLL(str(lib_dir / "libggml.so"))
        rpc = ctypes.CDLL(str(rpc_path))
        rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
        rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p  # ggml_backend_reg_t: the server's devices
        rpc.ggml_backend_rpc_get_device_memory.argtypes = [
            ctypes.c_char_p,
            ctypes.c_uint32,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        rpc.ggml_backend_rpc_get_device_memory.restype = None
        ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_register.restype = None
        ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
        ggml.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        ggml.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
        _libs = (ggml, rpc)
    return _libs


def _accepts(endpoint: str) -> bool:
    """Whether something listens at host:port (a connection opened and closed at once: rpc-server, which serves one
    client at a time, goes back to accepting the next)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def _reachable(rpc: ctypes.CDLL, endpoint: str) -> bool:
    if not _accepts(endpoint):
        return False
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    rpc.ggml_backend_rpc_get_device_memory(endpoint.encode(), 0, ctypes.byref(free), ctypes.byref(total))
    return total.value > 0


def rpc_devices(llama_cpp_module, endpoints: list[str], wait_seconds: float) -> list[int]:
    """The ggml devices of these RPC servers (every device each one lends), registered once per process. A server
    not answering yet (a worker pod still starting) is asked again until `wait_seconds` have passed, then the load
    fails with Unavailable."""
    with _lock:
        ggml, rpc = _load_libs(llama_cpp_module)
        deadline = time.monotonic() + wait_seconds
        devices = []
        for endpoint in endpoints:
            if endpoint not in _devices:
                while not _reachable(rpc, endpoint):
                    if time.monotonic() >= deadline:
                        raise Unavailable(f"llama.cpp RPC server {endpoint} does not answer")
                    time.sleep(0.5)
                reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())  # None: the server lends no device
                n = ggml.ggml_backend_reg_dev_count(reg) if reg else 0
                found = [ggml.ggml_backend_reg_dev_get(reg, i) for i in range(n)]
                if not found or not all(found):
                    raise Unavailable(f"llama.cpp could not add the RPC server {endpoint}'s devices")
                ggml.ggml_backend_register(reg)  # (and its devices)
                _devices[endpoint] = found
            devices.extend(_devices[endpoint])
        return devices
