"""CUDA shared memory on a server with `--frontend-workers 2`: registrations made through one worker are seen by
every worker, inputs in a client's CUDA region reach the model and outputs land in one, over HTTP and gRPC, with the
single process's errors. No GPU here: the server runs on the stand-in CUDA runtime and NVML (tests/standins), whose
"device memory" is POSIX shared memory, so the CUDA IPC between the client, the engine and the workers is real
inter-process traffic. On a GPU, tests/test_gpu.py runs the same round trip against the real runtime."""

from __future__ import annotations

import base64
import ctypes
import importlib.util
import shutil

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from helpers import ROOT, NaiadProcess
from test_frontend_workers import make_repo, wait_for, worker_pids
from tritonclient.utils import InferenceServerException

STANDINS = ROOT / "tests" / "standins"


def _standin_runtime():
    """The stand-in runtime, loaded under a private name: this process allocates "device memory" with it."""
    spec = importlib.util.spec_from_file_location(
        "naiad_standin_cudart", STANDINS / "cuda" / "bindings" / "runtime.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


rt = _standin_runtime()


class Region:
    """A client's "device" allocation and its IPC handle, as tritonclient's cuda_shared_memory makes them."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = rt.cudaMalloc(nbytes)[1]
        handle = rt.cudaIpcGetMemHandle(self.ptr)[1]
        self.b64 = base64.b64encode(ctypes.string_at(handle.getPtr(), 64))

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data)
        ctypes.memmove(self.ptr + offset, data.ctypes.data, data.nbytes)

    def read(self, dtype, shape, offset: int = 0) -> np.ndarray:
        out = np.empty(shape, dtype)
        ctypes.memmove(out.ctypes.data, self.ptr + offset, out.nbytes)
        return out

    def free(self) -> None:
        rt.cudaFree(self.ptr)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = make_repo(tmp_path_factory.mktemp("workers_cuda_repo"))
    shutil.copytree(repo / "identity_fp32", repo / "identity_cached")  # the same model, its responses cached
    config = (
        (repo / "identity_cached" / "config.pbtxt").read_text().replace("identity_fp32", "identity_cached")
    )
    (repo / "identity_cached" / "config.pbtxt").write_text(config + "response_cache { enable: true }\n")
    path = tmp_path_factory.mktemp("standins")
    shutil.copytree(STANDINS / "cuda", path / "cuda", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(STANDINS / "pynvml.py", path / "pynvml.py")
    proc = NaiadProcess(
        repo,
        "--frontend-workers",
        "2",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "identity_fp32",
        "--load-model",
        "identity_cached",
        "--cache-config",
        "local,size=1048576",
        env={"PYTHONPATH": str(path)},
    )
    proc.start()
    wait_for(lambda: len(worker_pids(proc)) == 2, what="two frontend workers")
    yield proc
    code = proc.stop()
    assert code == 0, proc.output()


def clients(server):
    """Clients on fresh connections (each lands on either worker), HTTP and gRPC, several of each."""
    for _ in range(3):
        yield httpclient, httpclient.InferenceServerClient(server.http)
        yield grpcclient, grpcclient.InferenceServerClient(server.grpc)


def names(mod, client) -> set[str]:
    status = client.get_cuda_shared_memory_status()
    return {r["name"] for r in status} if mod is httpclient else set(status.regions)


def test_every_worker_lists_the_extension(server):
    for _ in range(4):
        md = requests.get(f"http://{server.http}/v2").json()
        assert "cuda_shared_memory" in md["extensions"], md


def test_inputs_and_outputs_in_cuda_regions_through_every_worker(server):
    data = np.arange(32, dtype=np.float32).reshape(2, 16)
    src, dst = Region(data.nbytes), Region(2 * data.nbytes)
    src.write(data)
    first = httpclient.InferenceServerClient(server.http)
    try:
        first.register_cuda_shared_memory("cu_in", src.b64, 0, src.nbytes)
        first.register_cuda_shared_memory("cu_out", dst.b64, 0, dst.nbytes)
        for i, (mod, client) in enumerate(clients(server)):
            assert names(mod, client) == {"cu_in", "cu_out"}
            inp = mod.InferInput("INPUT0", [2, 16], "FP32")
            inp.set_shared_memory("cu_in", data.nbytes)
            out = mod.InferRequestedOutput("OUTPUT0")
            offset = (i % 2) * data.nbytes
            out.set_shared_memory("cu_out", data.nbytes, offset=offset)
            result = client.infer("identity_fp32", [inp], outputs=[out])
            entry = result.get_output("OUTPUT0")
            if mod is httpclient:
                assert entry == {"name": "OUTPUT0", "datatype": "FP32", "shape": [2, 16]}
            else:
                assert list(entry.shape) == [2, 16] and not result.get_response().raw_output_contents[0]
            np.testing.assert_array_equal(dst.read(np.float32, (2, 16), offset), data)
            dst.write(np.zeros_like(data), offset)
            client.close()
        first.unregister_cuda_shared_memory("cu_in")
        for mod, client in clients(server):
            assert names(mod, client) == {"cu_out"}
            client.close()
    finally:
        first.unregister_cuda_shared_memory()
        first.close()
        src.free()
        dst.free()


def test_a_cuda_input_with_a_plain_output(server):
    """The input is read by the engine from the client's region; the output comes back in the response."""
    data = np.linspace(0, 1, 16, dtype=np.float32).reshape(1, 16)
    src = Region(data.nbytes)
    src.write(data)
    g = grpcclient.InferenceServerClient(server.grpc)
    try:
        g.register_cuda_shared_memory("cu_only_in", src.b64, 0, src.nbytes)
        for mod, client in clients(server):
            inp = mod.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_shared_memory("cu_only_in", data.nbytes)
            got = client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(got, data)
            client.close()
    finally:
        g.unregister_cuda_shared_memory("cu_only_in")
        g.close()
        src.free()


def test_a_cached_response_written_to_a_cuda_region_stays_whole_in_the_cache(server):
    """The engine writes an output to the client's region and sends the worker its span; the response cache's
    copy of that output must stay the tensor (a hit is answered from the same cached tensors)."""
    data = np.arange(16, dtype=np.float32).reshape(1, 16) * 3
    dst = Region(data.nbytes)
    h = httpclient.InferenceServerClient(server.http)
    try:
        h.register_cuda_shared_memory("cu_cached", dst.b64, 0, dst.nbytes)
        for _ in range(3):  # a miss (cached), then hits: each written to the region
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(data)
            out = httpclient.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("cu_cached", data.nbytes)
            h.infer("identity_cached", [inp], outputs=[out])
            np.testing.assert_array_equal(dst.read(np.float32, (1, 16)), data)
            dst.write(np.zeros_like(data))
        stats = h.get_inference_statistics("identity_cached")["model_stats"][0]["inference_stats"]
        assert stats["cache_hit"]["count"] == 2 and stats["cache_miss"]["count"] == 1
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(data)
        np.testing.assert_array_equal(h.infer("identity_cached", [inp]).as_numpy("OUTPUT0"), data)
    finally:
        h.unregister_cuda_shared_memory("cu_cached")
        h.close()
        dst.free()


def test_errors_are_the_single_process_ones(server):
    src = Region(64)
    key = "/naiad_cuda_workers_sys"
    sys_region = shm.create_shared_memory_region("sys", key, 64)
    h = httpclient.InferenceServerClient(server.http)
    try:
        h.register_cuda_shared_memory("cu_err", src.b64, 0, 64)
        # one name space with system shared memory, whichever worker is asked
        for _mod, client in clients(server):
            with pytest.raises(InferenceServerException, match="already in manager"):
                client.register_system_shared_memory("cu_err", key, 64)
            with pytest.raises(InferenceServerException, match="already in manager"):
                client.register_cuda_shared_memory("cu_err", src.b64, 0, 64)
            client.close()
        h.register_system_shared_memory("sys", key, 64)
        with pytest.raises(InferenceServerException, match="already in manager"):
            h.register_cuda_shared_memory("sys", src.b64, 0, 64)
        # a span past the region's end; a byte size that is not the tensor's
        for mod, client in clients(server):
            inp = mod.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_shared_memory("cu_err", 64, offset=32)
            with pytest.raises(InferenceServerException, match="past the end of the registered region"):
                client.infer("identity_fp32", [inp])
            inp = mod.InferInput("INPUT0", [1, 8], "FP32")
            inp.set_shared_memory("cu_err", 64)
            with pytest.raises(InferenceServerException, match="does not match the tensor's 32 bytes"):
                client.infer("identity_fp32", [inp])
            client.close()
        # an output region too small for the output
        data = np.ones((1, 16), np.float32)
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(data)
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("cu_err", 32)
        with pytest.raises(InferenceServerException, match="holds 32 bytes, the tensor needs 64"):
            h.infer("identity_fp32", [inp], outputs=[out])
        # a handle no process exported
        with pytest.raises(InferenceServerException, match="cudaIpcOpenMemHandle on device 0 failed"):
            h.register_cuda_shared_memory("bogus", base64.b64encode(bytes(64)), 0, 64)
        with pytest.raises(InferenceServerException, match="device 3 does not exist"):
            h.register_cuda_shared_memory("far", src.b64, 3, 64)
        h.unregister_cuda_shared_memory("cu_err")
        for mod, client in clients(server):
            inp = mod.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_shared_memory("cu_err", 64)
            with pytest.raises(
                InferenceServerException, match="Unable to find shared memory region: 'cu_err'"
            ):
                client.infer("identity_fp32", [inp])
            client.close()
    finally:
        h.unregister_cuda_shared_memory()
        h.unregister_system_shared_memory()
        h.close()
        shm.destroy_shared_memory_region(sys_region)
        src.free()


def test_stand_in_mappings_are_closed(server):
    """Unregistering closes the engine's IPC mappings: no stand-in segment of this process stays mapped there."""
    src = Region(64)
    h = httpclient.InferenceServerClient(server.http)
    try:
        h.register_cuda_shared_memory("cu_close", src.b64, 0, 64)
        segment = "naiad-standin-cuda-"
        assert wait_for(lambda: _mapped(server.proc.pid, segment), what="the engine maps the region")
        h.unregister_cuda_shared_memory("cu_close")
        wait_for(lambda: not _mapped(server.proc.pid, segment), what="the engine unmaps the region")
        for pid in worker_pids(server):  # workers never map a CUDA region
            assert not _mapped(pid, segment)
    finally:
        h.close()
        src.free()


def _mapped(pid: int, prefix: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any(prefix in line for line in f)
