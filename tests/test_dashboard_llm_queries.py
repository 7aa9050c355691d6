"""The dashboard's LLM row and the prometheus-adapter rules of LLM autoscaling, run on real data: a real
Prometheus scrapes a Naiad whose llama.cpp engine (a tiny GGUF, two slots) is kept busy by more clients than it
has slots, so the waiting queue, the KV cache and the token histograms all carry values."""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
from helpers import NaiadProcess
from llm_models import write_tiny_gguf
from test_dashboard_queries import (
    NAMESPACE,
    POD,
    PROMETHEUS,
    RATE_INTERVAL,
    Prometheus,
    adapter_rules,
    panels,
    substitute,
)

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

MODEL = "dash_llm"
CLIENTS = 4  # twice the engine's slots: requests wait
MAX_TOKENS = 24
LOAD_S = 20.0


class Completions:
    """Clients sending /v1/completions back to back; remembers when each finished and how many tokens it got."""

    def __init__(self, http: str):
        self.url = f"http://{http}/v1/completions"
        self.done: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self, client: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            body = {
                "model": MODEL,
                "prompt": f"client {client} request {i}: once upon a time",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            }
            r = requests.post(self.url, json=body, timeout=60)
            assert r.status_code == 200, r.text
            with self.lock:
                self.done.append((time.time(), r.json()["usage"]["completion_tokens"]))

    def tokens_per_second(self, start: float, end: float) -> float:
        with self.lock:
            return sum(n for t, n in self.done if start < t <= end) / (end - start)


@pytest.fixture(scope="module")
def llm_loaded(tmp_path_factory):
    assert PROMETHEUS is not None, "Debian's prometheus is not installed (make test-deps installs it)"
    repo = tmp_path_factory.mktemp("dash_llm")
    write_tiny_gguf(repo / MODEL / "1" / "model.gguf")
    (repo / MODEL / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value: { string_value: "2" } }\n'
        'parameters { key: "n_threads" value: { string_value: "1" } }\n'
    )
    naiad = NaiadProcess(repo, "--metrics-interval-ms", "500", timeout=120).start()
    workdir = Path(tempfile.mkdtemp(prefix="naiad-dash-llm-"))
    prom = Prometheus(naiad.metrics, workdir)
    load = Completions(naiad.http)
    threads = [threading.Thread(target=load.run, args=(c,)) for c in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        time.sleep(LOAD_S)
        at = time.time() - 1.0
        yield prom, load, at
    finally:
        load.stop.set()
        for t in threads:
            t.join(70)
        prom.stop()
        naiad.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_llm_row_queries_return_plausible_series(llm_loaded):
    prom, load, at = llm_loaded
    window = float(RATE_INTERVAL[:-1])
    sent = load.tokens_per_second(at - window, at)
    assert sent > 5, f"the load did not run: {sent} tokens/s"
    llm = {t: p for t, p in panels().items() if any("vllm:" in x["expr"] for x in p["targets"])}
    checked = set()

    def run(title: str, ref: str = "A") -> dict[str, float]:
        target = next(t for t in llm[title]["targets"] if t["refId"] == ref)
        checked.add((title, ref))
        result = prom.query(substitute(target["expr"], namespace=[NAMESPACE], model=[MODEL], pod=[POD]), at)
        assert result, f"{title} {ref}: no series"
        values = {m.get("model_name") or m.get("pod"): v for m, v in result}
        assert all(math.isfinite(v) for v in values.values()), (title, ref, values)
        return values

    for title in ("Time to first token p50 / p99", "Inter-token latency p50 / p99"):
        p50, p99 = run(title, "A")[MODEL], run(title, "B")[MODEL]
        assert 0 < p50 <= p99 < 30, (title, p50, p99)
    generated = run("Tokens per second", "A")[MODEL]
    assert abs(generated - sent) <= 0.4 * sent + 2, (generated, sent)
    assert run("Tokens per second", "B")[MODEL] > 0
    waiting = run("Requests waiting and running per pod", "A")[POD]
    running = run("Requests waiting and running per pod", "B")[POD]
    assert 0 <= waiting <= CLIENTS and 0 <= running <= 2, (waiting, running)
    kv = run("KV-cache use per pod")[POD]
    assert 0 <= kv <= 1, kv
    every = {(t, x["refId"]) for t, p in llm.items() for x in p["targets"]}
    assert checked == every and len(every) == 9, sorted(every - checked)


def test_llm_adapter_rules(llm_loaded):
    """The rules an LLM model's HPA reads: each series query finds the pod, each metrics query (as
    prometheus-adapter fills it for the InferenceModel's model_name selector) gives that pod's gauge."""
    prom, _, at = llm_loaded
    rules = [r for r in adapter_rules() if "vllm:" in r["seriesQuery"]]
    assert {r["name"]["as"] for r in rules} == {"naiad_llm_requests_waiting", "naiad_llm_kv_cache_usage"}
    for rule in rules:
        r = requests.get(
            f"{prom.url}/api/v1/series", params={"match[]": rule["seriesQuery"], "start": at - 60, "end": at}
        ).json()
        assert r["status"] == "success", r
        assert {(s["namespace"], s["pod"], s["model_name"]) for s in r["data"]} == {(NAMESPACE, POD, MODEL)}
        query = (
            rule["metricsQuery"]
            .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}",model_name="{MODEL}"')
            .replace("<<.GroupBy>>", "pod")
        )
        result = prom.query(query, at)
        assert [m for m, _ in result] == [{"pod": POD}], (rule["name"], result)
        value = result[0][1]
        limit = CLIENTS if "waiting" in rule["name"]["as"] else 1
        assert 0 <= value <= limit, (rule["name"], value)
