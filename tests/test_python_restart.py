"""A python worker process killed under load comes back by itself (Triton restarts its stub).

A two-instance python model (so: two worker processes) serves four client threads; one worker is killed with
SIGKILL. The requests it was executing fail with an error that names it; the model is not ready until the new
worker has run `initialize`; then every request succeeds again, and the restart is logged and counted.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import NaiadProcess

SLOW = r'''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Takes 1.5 s to initialize and 100 ms per execution; PID says which worker served."""

    def initialize(self, args):
        time.sleep(1.5)

    def execute(self, requests):
        time.sleep(0.1)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                for _ in requests]
'''
SLOW_CONFIG = """
name: "slow"
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

FLAKY = r'''
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """initialize fails while <model dir>/broken exists."""

    def initialize(self, args):
        if (Path(args["model_repository"]) / "broken").exists():
            raise pb_utils.TritonModelException("flaky is broken")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                for _ in requests]
'''
FLAKY_CONFIG = """
name: "flaky"
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
parameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("restart") / "models"
    for name, code, config in (("slow", SLOW, SLOW_CONFIG), ("flaky", FLAKY, FLAKY_CONFIG)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(code)
        (repo / name / "config.pbtxt").write_text(config)
    return repo


@pytest.fixture(scope="module")
def server(repo):
    with NaiadProcess(repo, timeout=120) as proc:
        deadline = time.monotonic() + 30  # the metrics endpoint starts after the inference endpoints
        while time.monotonic() < deadline:
            try:
                requests.get(f"http://{proc.metrics}/metrics", timeout=5)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        yield proc


def _request(client, model: str = "slow") -> int:
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([0], np.int32))
    return int(client.infer(model, [x]).as_numpy("PID")[0])


def _restart_counts(server) -> dict[str, float]:
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    found = re.findall(r"^nv_python_backend_stub_restart_count\{([^}]*)\} (\S+)$", text, re.M)
    return {labels: float(value) for labels, value in found}


def test_killed_worker_under_load_restarts(server):
    stop = threading.Event()
    served: list[tuple[float, int]] = []  # (time, pid)
    failed: list[tuple[float, str]] = []

    def load():
        client = httpclient.InferenceServerClient(server.http, network_timeout=60)
        try:
            while not stop.is_set():
                try:
                    served.append((time.monotonic(), _request(client)))
                except InferenceServerException as exc:
                    failed.append((time.monotonic(), exc.message()))
        finally:
            client.close()

    probe = httpclient.InferenceServerClient(server.http)
    before = {labels: n for labels, n in _restart_counts(server).items() if 'model="slow"' in labels}
    assert sorted(before.values()) == [0.0, 0.0]  # one series per instance, from the first start
    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while len({pid for _, pid in served}) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = {pid for _, pid in served}
        assert len(pids) == 2, "both workers serve"
        victim = sorted(pids)[0]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()

        # while the new worker initializes (1.5 s) the model is not ready; then it is again
        readiness = []
        while time.monotonic() < killed_at + 30:
            readiness.append(probe.is_model_ready("slow"))
            if readiness[-1] and False in readiness:
                break
            time.sleep(0.05)
        assert False in readiness, "the model looked ready while one of its workers was being restarted"
        assert readiness[-1] is True, "the model did not come back"
        ready_at = time.monotonic()
        time.sleep(1.0)  # keep the load on after the restart
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        probe.close()

    # requests in flight on the killed worker failed, naming it; nothing else failed
    assert failed, "no request was in flight on the killed worker"
    for _, message in failed:
        assert "exited unexpectedly (killed by SIGKILL)" in message, message
        assert f"pid {victim}" in message and "being restarted" in message, message
    assert all(at < ready_at for at, _ in failed)
    # the new worker serves: a pid never seen before, after the restart
    new_pids = {pid for at, pid in served if at > ready_at} - pids
    assert len(new_pids) == 1, new_pids
    assert victim not in {pid for at, pid in served if at > ready_at}
    # counted and logged
    after = {labels: n for labels, n in _restart_counts(server).items() if 'model="slow"' in labels}
    assert sorted(after.values()) == [0.0, 1.0], after
    restarted = next(labels for labels, value in after.items() if value == 1.0)
    assert 'model="slow"' in restarted and 'version="1"' in restarted and "instance=" in restarted
    log = server.output()
    assert f"replaces pid {victim}, which died" in log
    assert f"pid {victim}" in log and "killed by SIGKILL" in log


def test_a_restart_that_fails_is_retried_with_back_off(server, repo):
    client = httpclient.InferenceServerClient(server.http, network_timeout=60)
    try:
        pid = _request(client, "flaky")
        (repo / "flaky" / "broken").write_text("")
        os.kill(pid, signal.SIGKILL)
        # initialize fails in the new worker: requests fail at once with why, and the model is not ready
        deadline = time.monotonic() + 30
        message = ""
        while "could not be restarted" not in message and time.monotonic() < deadline:
            try:
                _request(client, "flaky")
            except InferenceServerException as exc:
                message = exc.message()
            time.sleep(0.1)
        assert "could not be restarted" in message and "flaky is broken" in message, message
        assert not client.is_model_ready("flaky")
        started = time.monotonic()
        with pytest.raises(InferenceServerException):
            _request(client, "flaky")
        assert time.monotonic() - started < 1.0, "a request waited through the back-off"
        # once initialize can succeed again, a later attempt brings the instance back by itself
        (repo / "flaky" / "broken").unlink()
        deadline = time.monotonic() + 60
        while not client.is_model_ready("flaky") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.is_model_ready("flaky")
        assert _request(client, "flaky") != pid
    finally:
        client.close()
    counts = {labels: n for labels, n in _restart_counts(server).items() if 'model="flaky"' in labels}
    assert list(counts.values()) == [1.0], counts  # the failed attempts are logged, not counted
    assert "flaky is broken" in server.output()
