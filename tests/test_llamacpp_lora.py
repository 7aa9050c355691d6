"""LoRA adapters on the llama.cpp engine: adapter GGUFs written here as llama.cpp's `convert_lora_to_gguf.py` lays
them out (tests/llm_models.py write_lora_gguf) on the tiny random-weight llama, loaded with the model (config
parameter `lora_adapters`, Triton vllm_backend's multi_lora.json) and at runtime (vLLM's /v1/load_lora_adapter),
requested as models on every LLM API and by `lora_name` on Triton's generate endpoint. An adapter's greedy tokens
are llama.cpp's own (`llama-server --lora`), requests of two adapters and of the base run together each as it runs
alone, unloading gives the base back, and the runtime routes are refused without --allow-runtime-lora and behind
the restricted API."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from helpers import ROOT, NaiadProcess, free_ports
from llm_models import write_lora_gguf, write_tiny_gguf
from test_llamacpp import metric

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

pytestmark = pytest.mark.timeout(300)

MODEL = "llama"  # one thread: OpenMP's thread team stalls on a loaded machine
PROMPT = "Once upon a time there was a model"
N = 24  # greedy tokens compared


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    version = root / "repo" / MODEL / "1"
    base = write_tiny_gguf(version / "model.gguf")
    write_lora_gguf(version / "adapters" / "static.gguf", seed=11)  # named relative to the version folder
    other = write_lora_gguf(root / "elsewhere" / "from_json.gguf", seed=12)
    (version / "multi_lora.json").write_text(json.dumps({"static_json": str(other)}))
    (root / "repo" / MODEL / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_threads" value: { string_value: "1" } }\n'
        'parameters { key: "lora_adapters" value: { string_value: "static_a=adapters/static.gguf" } }\n'
    )
    return SimpleNamespace(
        repo=root / "repo",
        version=version,
        base=base,
        other=other,
        a=write_lora_gguf(root / "a.gguf", seed=1),
        b=write_lora_gguf(root / "b.gguf", seed=2),
        empty=root / "empty",
    )


@pytest.fixture(scope="module")
def naiad(files):
    with NaiadProcess(files.repo, "--allow-runtime-lora", timeout=120) as proc:
        yield proc


# ---- helpers ----
def load(naiad, name: str, path, **extra) -> requests.Response:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return requests.post(f"{naiad.url}/v1/load_lora_adapter", json=body, timeout=60)


def unload(naiad, name: str) -> requests.Response:
    return requests.post(f"{naiad.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def complete(naiad, model: str, n: int = N, prompt: str = PROMPT) -> requests.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    return requests.post(f"{naiad.url}/v1/completions", json=body, timeout=60)


def text(naiad, model: str, n: int = N) -> str:
    r = complete(naiad, model, n)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def greedy_ids(naiad, lora: str | None = None, n: int = N) -> list[int]:
    """The greedy token ids of PROMPT through Triton's generate endpoint (vllm_backend's `lora_name`)."""
    sampling = {"max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    if lora is not None:
        sampling["lora_name"] = lora
    body = {
        "text_input": PROMPT,
        "sampling_parameters": json.dumps(sampling),
        "return_logprobs": True,
        "exclude_input_in_output": True,
    }
    r = requests.post(f"{naiad.url}/v2/models/{MODEL}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [int(next(iter(entry))) for entry in json.loads(r.json()["logprobs"])]


def openai_error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


def llama_server_binary() -> Path:
    """llama.cpp's own server of the wheel's llama.cpp (tools/llama_cpp/build.sh servers: cached once built)."""
    out = subprocess.run(
        ["bash", str(ROOT / "tools/llama_cpp/build.sh"), "servers"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "llama-server"


def llama_server_ids(base: Path, adapter: Path | None, n: int = N) -> list[int]:
    """PROMPT's greedy token ids from `llama-server -m base [--lora adapter]`, one thread, one slot, flash attention
    as Naiad's engine has it (llama.cpp's default, auto)."""
    (port,) = free_ports(1)
    cmd = [
        str(llama_server_binary()),
        "-m",
        str(base),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "2048",
        "-np",
        "1",
        "-t",
        "1",
        "-tb",
        "1",
        "-b",
        "512",
        "-ub",
        "512",
        "-fa",
        "auto",
        "--no-webui",
    ]
    if adapter is not None:
        cmd += ["--lora", str(adapter)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.2)
        body = {
            "prompt": PROMPT,
            "n_predict": n,
            "temperature": 0,
            "top_k": 1,
            "ignore_eos": True,
            "return_tokens": True,
            "cache_prompt": False,
        }
        r = requests.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return [int(t) for t in r.json()["tokens"]]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the server ----
def test_models_lists_the_static_adapters_with_their_parent(naiad, files):
    cards = {c["id"]: c for c in requests.get(f"{naiad.url}/v1/models", timeout=10).json()["data"]}
    assert cards[MODEL]["parent"] is None and cards[MODEL]["root"] == MODEL
    assert cards["static_a"]["parent"] == MODEL
    assert cards["static_a"]["root"] == str(files.version / "adapters" / "static.gguf")
    assert cards["static_json"]["parent"] == MODEL and cards["static_json"]["root"] == str(files.other)
    one = requests.get(f"{naiad.url}/v1/models/static_a", timeout=10).json()
    assert {**one, "created": 0} == {
        **cards["static_a"],
        "created": 0,
    }  # (workers each date the cards they give)
    openai_error(requests.get(f"{naiad.url}/v1/models/no_such_adapter", timeout=10), 404)
    # each static adapter changes the greedy text, each its own way
    base, a, j = text(naiad, MODEL), text(naiad, "static_a"), text(naiad, "static_json")
    assert len({base, a, j}) == 3


def test_a_runtime_adapter_generates_as_llama_server_does_and_unloading_gives_the_base_back(naiad, files):
    base_ids = greedy_ids(naiad)
    base_text = text(naiad, MODEL)
    r = load(naiad, "rt_a", files.a)
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'rt_a' added successfully."
    try:
        ids = greedy_ids(naiad, "rt_a")
        assert ids != base_ids  # the adapter changes the greedy output
        assert text(naiad, "rt_a") != base_text
        # llama.cpp's own server, given the same GGUF, adapter, prompt and greedy settings, picks the same tokens
        assert ids == llama_server_ids(files.base, files.a)
        assert base_ids == llama_server_ids(files.base, None)
    finally:
        r = unload(naiad, "rt_a")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt_a' removed successfully."
    assert greedy_ids(naiad) == base_ids and text(naiad, MODEL) == base_text
    err = openai_error(complete(naiad, "rt_a"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "rt_a" not in {c["id"] for c in requests.get(f"{naiad.url}/v1/models", timeout=10).json()["data"]}


def test_every_llm_api_serves_an_adapter_by_its_name(naiad):
    """Completions, chat, Responses and Messages take `model: "<adapter>"` and answer with its name; the completion
    is the one Triton's generate endpoint gives for `lora_name`."""
    r = complete(naiad, "static_a")
    assert r.status_code == 200, r.text
    body = {
        "text_input": PROMPT,
        "sampling_parameters": json.dumps(
            {"max_tokens": N, "temperature": 0, "ignore_eos": True, "lora_name": "static_a"}
        ),
        "exclude_input_in_output": True,
    }
    generated = requests.post(f"{naiad.url}/v2/models/{MODEL}/generate", json=body, timeout=60).json()
    assert r.json()["choices"][0]["text"] == generated["text_output"]
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}
    answers = {}
    for model in (MODEL, "static_a"):
        c = requests.post(f"{naiad.url}/v1/chat/completions", json={**chat, "model": model}, timeout=60)
        assert c.status_code == 200, c.text
        assert c.json()["model"] == model
        answers[model] = c.json()["choices"][0]["message"]["content"]
    assert answers[MODEL] != answers["static_a"]
    resp = requests.post(
        f"{naiad.url}/v1/responses",
        json={"model": "static_a", "input": "Hello", "max_output_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "static_a"
    msg = requests.post(
        f"{naiad.url}/v1/messages",
        json={"model": "static_a", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]},
        timeout=60,
    )
    assert msg.status_code == 200, msg.text
    assert msg.json()["model"] == "static_a"
    count = requests.post(
        f"{naiad.url}/v1/messages/count_tokens",
        json={"model": "static_a", "messages": [{"role": "user", "content": "Hello"}]},
        timeout=60,
    )
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    # Triton's generate endpoint with an adapter the model does not have: a 400 naming it
    bad = dict(body, sampling_parameters=json.dumps({"max_tokens": 2, "lora_name": "nope"}))
    r = requests.post(f"{naiad.url}/v2/models/{MODEL}/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "nope" in r.text


def test_the_openai_client_lists_and_uses_an_adapter(naiad):
    from openai_clients import v1_client

    with v1_client(naiad) as client:
        parents = {m.id: (m.model_extra or {}).get("parent") for m in client.models.list()}
        assert parents[MODEL] is None and parents["static_a"] == MODEL
        out = client.completions.create(model="static_a", prompt=PROMPT, max_tokens=N, temperature=0)
        assert out.model == "static_a" and out.choices[0].text
        chat = client.chat.completions.create(
            model="static_a", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
        )
        assert chat.model == "static_a"


def test_two_adapters_and_the_base_at_once_each_as_alone(naiad, files):
    assert load(naiad, "rt_a", files.a).status_code == 200
    assert load(naiad, "rt_b", files.b).status_code == 200
    try:
        models = [MODEL, "rt_a", "rt_b", "rt_a", MODEL, "rt_b"]
        alone = {m: text(naiad, m, 64) for m in set(models)}
        assert len(set(alone.values())) == 3
        for _ in range(2):
            with ThreadPoolExecutor(len(models)) as pool:
                together = list(pool.map(lambda m: text(naiad, m, 64), models))
            assert together == [alone[m] for m in models]
    finally:
        unload(naiad, "rt_a")
        unload(naiad, "rt_b")


def test_lora_requests_info_shows_a_running_adapter(naiad, files):
    """vllm:lora_requests_info while requests run under an adapter (eight long ones on four slots: the tiny model
    decodes thousands of tokens a second), and without it once they are done."""
    assert load(naiad, "rt_m", files.a).status_code == 200
    body = {"model": "rt_m", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    def consume() -> None:
        with requests.post(f"{naiad.url}/v1/completions", json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    try:
        with ThreadPoolExecutor(8) as pool:
            running = [pool.submit(consume) for _ in range(8)]
            seen = False
            while not seen and not all(f.done() for f in running):
                seen = (
                    metric(naiad, "vllm:lora_requests_info", model_name=MODEL, running_lora_adapters="rt_m")
                    > 0
                )
            for f in running:
                f.result()
        assert seen, "vllm:lora_requests_info never listed rt_m as running"
        assert 'max_lora="4"' in requests.get(f"http://{naiad.metrics}/metrics", timeout=10).text
    finally:
        unload(naiad, "rt_m")
    assert metric(naiad, "vllm:lora_requests_info", model_name=MODEL, running_lora_adapters="") > 0


def test_runtime_route_errors_are_openai_error_objects(naiad, files):
    err = openai_error(load(naiad, "rt_e", files.empty / "missing.gguf"), 404)
    assert "No adapter found" in err["message"] and err["param"] == "lora_path"
    err = openai_error(load(naiad, "rt_e", files.base), 400)  # a model, not an adapter: llama.cpp's reason
    assert "general.type" in err["message"]
    assert openai_error(load(naiad, "static_a", files.a), 400)["message"] == (
        "The lora adapter 'static_a' has already been loaded."
    )
    assert "name of a model" in openai_error(load(naiad, MODEL, files.a), 400)["message"]
    assert "must be provided" in openai_error(load(naiad, "rt_e", ""), 400)["message"]
    assert "commas" in openai_error(load(naiad, "a,b", files.a), 400)["message"]
    assert (
        openai_error(load(naiad, "rt_e", files.a, base_model_name="nope"), 404)["code"] == "model_not_found"
    )
    err = openai_error(unload(naiad, "rt_e"), 404)
    assert err["message"] == "The lora adapter 'rt_e' cannot be found."
    r = requests.post(f"{naiad.url}/v1/unload_lora_adapter", json={}, timeout=10)
    assert "lora_name" in openai_error(r, 400)["message"]
    # a relative path is the model's version folder's; base_model_name names the model
    r = load(naiad, "rt_rel", "adapters/static.gguf", base_model_name=MODEL)
    assert r.status_code == 200, r.text
    assert unload(naiad, "rt_rel").status_code == 200
    err = openai_error(complete(naiad, "no_such_model"), 404)
    assert err["code"] == "model_not_found"


def test_runtime_routes_are_refused_without_the_flag_and_behind_the_restricted_api(files):
    files.empty.mkdir(exist_ok=True)
    with NaiadProcess(files.empty, "--http-restricted-api", "openai:api-key=s3cret") as proc:
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            body = {"lora_name": "x", "lora_path": str(files.a)}
            r = requests.post(f"{proc.url}/v1/{route}", json=body, timeout=10)
            err = openai_error(r, 403)
            assert err["type"] == "permission_error" and "api-key" in err["message"]
            r = requests.post(f"{proc.url}/v1/{route}", json=body, headers={"api-key": "s3cret"}, timeout=10)
            err = openai_error(r, 403)
            assert "--allow-runtime-lora" in err["message"]


# ---- the engine ----
def _run(engine, prompt: str, n: int = 16, **sampling) -> str:
    from naiad.backends.llamacpp.engine import GenerationRequest
    from naiad.backends.llamacpp.params import SamplingParams

    done, out, failed = threading.Event(), [], []

    def emit(o):
        out.append(o.text)
        if o.finish_reason is not None:
            done.set()

    def fail(exc):
        failed.append(exc)
        done.set()

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **sampling)
    engine.submit(GenerationRequest(engine.tokenize(prompt), sp, emit, fail))
    assert done.wait(60)
    assert not failed, failed
    return "".join(out)


@pytest.fixture()
def engine_files(tmp_path):
    return SimpleNamespace(
        base=write_tiny_gguf(tmp_path / "m.gguf"),
        a=write_lora_gguf(tmp_path / "a.gguf", seed=1),
        b=write_lora_gguf(tmp_path / "b.gguf", seed=2),
    )


def _engine(path, n_parallel: int = 1):
    from naiad.backends.llamacpp.engine import LlamaEngine
    from naiad.backends.llamacpp.params import EngineSettings

    return LlamaEngine(path, EngineSettings(n_ctx=512, n_parallel=n_parallel, n_threads=1))


def test_engine_decodes_each_adapter_group_in_the_same_step(engine_files):
    engine = _engine(engine_files.base, n_parallel=4)
    try:
        engine.load_adapter("a", engine_files.a)
        engine.load_adapter("b", engine_files.b)
        kinds = [{}, {"lora_name": "a"}, {"lora_name": "b"}, {"lora_name": "a", "lora_scale": 0.5}]
        alone = [_run(engine, PROMPT, 32, **k) for k in kinds]
        assert len(set(alone)) == 4
        steps: list[list[tuple]] = []
        real_step, real_decode = engine._step, engine._decode

        def step():
            steps.append([])
            real_step()

        def decode(key, items):
            steps[-1].append(tuple((a.name, s) for a, s in key))
            real_decode(key, items)

        engine._step, engine._decode = step, decode
        reported: list[tuple] = []
        engine.metrics.set_lora = lambda running, waiting, max_lora: reported.append(
            (running, waiting, max_lora)
        )
        # the engine thread waits in a control while all four are queued: they start in the same step
        import concurrent.futures

        gate, held = threading.Event(), concurrent.futures.Future()
        engine._control(lambda: gate.wait(10), held)
        results: list = [None] * 4
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, _run(engine, PROMPT, 32, **kinds[i])))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        while engine.waiting < 4:
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(60)
        assert results == alone
        groups = max(len(s) for s in steps)
        assert groups == 4  # base, a, b and a at 0.5: one decode each, in one step
        # vllm:lora_requests_info (set by the engine thread when it changes): a and b running (max_lora:
        # n_parallel), then none
        assert reported == [(["a", "b"], [], 4), ([], [], 4)]
    finally:
        engine.close()


def test_engine_prefix_reuse_never_takes_another_adapters_cells(engine_files):
    warm, cold = _engine(engine_files.base), _engine(engine_files.base)
    try:
        for e in (warm, cold):
            e.load_adapter("a", engine_files.a)
        base = _run(warm, PROMPT)
        hits = warm.prefix_hits
        adapted = _run(warm, PROMPT, lora_name="a")  # the slot holds the prompt, computed by the base
        assert warm.prefix_hits == hits
        assert adapted == _run(cold, PROMPT, lora_name="a") != base
        again = _run(warm, PROMPT, lora_name="a")  # the same adapter: its own cells are reused
        assert warm.prefix_hits > hits and again == adapted
        assert _run(warm, PROMPT) == base
    finally:
        warm.close()
        cold.close()


def test_engine_unloads_an_adapter_after_the_requests_that_hold_it(engine_files):
    import concurrent.futures

    from naiad.errors import InvalidArgument, NotFound

    engine = _engine(engine_files.base)
    try:
        engine.load_adapter("a", engine_files.a)
        expected = _run(engine, PROMPT, 200, lora_name="a")
        # the engine thread waits in a control while a request for the adapter is queued, then the adapter is
        # unloaded: the request still runs under it, and it is freed after
        gate, held = threading.Event(), concurrent.futures.Future()
        engine._control(lambda: gate.wait(10), held)
        results: list[str] = []
        t = threading.Thread(target=lambda: results.append(_run(engine, PROMPT, 200, lora_name="a")))
        t.start()
        while engine.waiting == 0:
            time.sleep(0.001)
        engine.unload_adapter("a")
        with pytest.raises(InvalidArgument, match="not loaded"):
            _run(engine, PROMPT, lora_name="a")
        with pytest.raises(NotFound):
            engine.unload_adapter("a")
        assert engine._retired  # held by the queued request
        gate.set()
        t.join(60)
        assert results == [expected]
        deadline = time.monotonic() + 10
        while engine._retired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine._retired  # freed once the request finished
        engine.load_adapter("a", engine_files.b)  # the name is free again: another adapter under it
        assert _run(engine, PROMPT, 200, lora_name="a") != expected
    finally:
        engine.close()


def test_engine_refuses_a_file_that_is_not_an_adapter_with_llama_cpps_reason(engine_files):
    from naiad.errors import InvalidArgument

    engine = _engine(engine_files.base)
    try:
        with pytest.raises(InvalidArgument, match="general.type"):
            engine.load_adapter("m", engine_files.base)
        engine.load_adapter("a", engine_files.a)
        with pytest.raises(InvalidArgument, match="already loaded"):
            engine.load_adapter("a", engine_files.b)
        assert _run(engine, PROMPT, lora_name="a", lora_scale=0.0) == _run(
            engine, PROMPT
        )  # scale 0: the base
    finally:
        engine.close()


def test_static_adapters_are_checked_at_load(tmp_path):
    from naiad.backends.llamacpp.lora import static_adapters
    from naiad.errors import InvalidArgument

    write_lora_gguf(tmp_path / "x.gguf")
    (tmp_path / "d").mkdir()
    write_lora_gguf(tmp_path / "d" / "only.gguf")
    found = static_adapters({"lora_adapters": " x = x.gguf , d=d "}, tmp_path)
    assert found == {"x": tmp_path / "x.gguf", "d": tmp_path / "d" / "only.gguf"}
    for bad, why in (
        ("x", "not name=path"),
        ("x=x.gguf,x=x.gguf", "named twice"),
        ("y=missing.gguf", "No adapter found"),
        ("a b=x.gguf", "whitespace"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            static_adapters({"lora_adapters": bad}, tmp_path)
    (tmp_path / "multi_lora.json").write_text("[1]")
    with pytest.raises(InvalidArgument, match="JSON object"):
        static_adapters({}, tmp_path)


def test_the_operators_load_config_serves_its_adapters(tmp_path):
    """An InferenceModel's `llm.loraAdapters` as the operator sends them: its load config, posted to Triton's
    repository API of a server in explicit mode, serves each adapter as a model whose parent is the base."""
    import sys

    sys.path.insert(0, str(ROOT / "operator"))
    from naiad_operator.model_resources import model_intent

    version = tmp_path / "repo" / "tiny" / "1"
    write_tiny_gguf(version / "model.gguf")
    write_lora_gguf(version / "adapters" / "sql.gguf", seed=1)
    spec = {
        "modelName": "tiny",
        "llm": {"engine": "llamacpp", "loraAdapters": [{"name": "sql", "path": "adapters/sql.gguf"}]},
        "config": {"parameters": {"n_threads": {"string_value": "1"}}},
    }
    intent = model_intent("tiny", spec)
    assert intent.problems == []
    with NaiadProcess(tmp_path / "repo", "--model-control-mode", "explicit", timeout=120) as proc:
        r = requests.post(
            f"{proc.url}/v2/repository/models/tiny/load",
            json={"parameters": {"config": json.dumps(intent.load_config)}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        cards = {m["id"]: m for m in requests.get(f"{proc.url}/v1/models", timeout=10).json()["data"]}
        assert cards["sql"]["parent"] == "tiny"
        assert text(proc, "sql") != text(proc, "tiny")
