"""The model families the llama.cpp engine must keep serving, one test per family and concern: a tiny random-weight
GGUF of each (tests/llm_models.py `write_arch_gguf`: llama, qwen2, qwen3, gemma3, mistral3, laid out as llama.cpp's
converter lays that family out) loads through `naiad serve` from a `backend: "llamacpp"` config, its greedy text
is the same on every call and the same as llama.cpp's own low-level generation in this process, its tokenizer
round-trips any text, its chat template reaches the engine, and a reused prompt prefix gives the text a fresh engine
gives (gemma3's sliding-window cache included). An upgrade of llama-cpp-python that drops or breaks a family fails
here."""

from __future__ import annotations

import ctypes
import json
import threading
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import requests
from helpers import NaiadProcess
from llm_models import ARCHITECTURES, GEMMA3_SLIDING_WINDOW, write_arch_gguf

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

pytestmark = pytest.mark.timeout(180)

ARCHS = list(ARCHITECTURES)
PROMPT = "Once upon a time there was a model"
N_TOKENS = 12
N_CTX = 512
TEXTS = [
    "Hello world, this is a tiny language model.",
    "  leading and trailing spaces, tabs\tand\nnew lines\n\n",
    "héllo wörld: ünïcödé, CJK 你好世界, emoji 🦙🚀 and a ZWJ 👩\u200d💻",
    "numbers 3.14159 1234567890 and code: def f(x): return x**2  # ok",
]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arch_gguf")
    return {arch: write_arch_gguf(folder / f"{arch}.gguf", arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def naiad(tmp_path_factory, gguf_files):
    repo = tmp_path_factory.mktemp("arch_repo")
    for arch, path in gguf_files.items():
        (repo / arch / "1").mkdir(parents=True)
        (repo / arch / "1" / "model.gguf").write_bytes(path.read_bytes())
        (repo / arch / "config.pbtxt").write_text(
            'backend: "llamacpp"\n'
            f'parameters {{ key: "n_ctx" value: {{ string_value: "{N_CTX}" }} }}\n'
            'parameters { key: "n_parallel" value: { string_value: "2" } }\n'
            'parameters { key: "n_threads" value: { string_value: "1" } }\n'
        )
    # not strict: a family this llama.cpp cannot load fails its own tests, not every family's
    with NaiadProcess(repo, "--strict-readiness", "false", "--allow-grpc", "false", timeout=120) as proc:
        yield proc


def _ready(naiad, arch: str) -> None:
    r = requests.get(f"{naiad.url}/v2/models/{arch}/ready", timeout=10)
    if r.status_code != 200:
        index = requests.post(f"{naiad.url}/v2/repository/index", json={}, timeout=10).json()
        state = next((m for m in index if m.get("name") == arch), {})
        pytest.fail(
            f"the {arch} model did not load: {state.get('reason') or state}\n{naiad.output()[-3000:]}"
        )


def _generate(naiad, arch: str, prompt: str, n: int = N_TOKENS) -> dict:
    body = {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "sampling_parameters": json.dumps({"max_tokens": n, "temperature": 0, "ignore_eos": True}),
    }
    r = requests.post(f"{naiad.url}/v2/models/{arch}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---- llama.cpp itself, in this process: the reference ----
_lc_lock = threading.Lock()
_lc_ready = False


def _lc():
    global _lc_ready
    import llama_cpp

    with _lc_lock:
        if not _lc_ready:
            llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _lc_ready = True
    return llama_cpp


try:
    import llama_cpp as _llama_cpp

    _quiet = _llama_cpp.llama_log_callback(lambda level, text, user: None)
except ImportError:
    _quiet = None


class _Model:
    """A GGUF loaded by llama.cpp's C API directly (no Naiad code)."""

    def __init__(self, path, vocab_only: bool = False):
        lc = self.lc = _lc()
        params = lc.llama_model_default_params()
        params.vocab_only = vocab_only
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not load {path}"
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        self.lc.llama_model_free(self.model)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode()
        buf = (self.lc.llama_token * (len(data) + 8))()
        n = self.lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_special, parse_special)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> str:
        arr = (self.lc.llama_token * len(tokens))(*tokens)
        size = 16 * len(tokens) + 16
        buf = ctypes.create_string_buffer(size)
        n = self.lc.llama_detokenize(self.vocab, arr, len(tokens), buf, size, False, False)
        assert n >= 0
        return buf.raw[:n].decode("utf-8", "replace")

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, 256, 0, False)
        return buf.raw[:n]

    def greedy(self, prompt: str, n: int) -> tuple[list[int], str]:
        """The prompt's tokens and the text of `n` greedy tokens (the argmax of the logits, end of generation
        ignored), one sequence decoded in a context like the engine's (n_ctx cells per sequence, not unified)."""
        lc = self.lc
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = N_CTX
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = 1
        cparams.kv_unified = False
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(self.model, cparams)
        assert ctx
        batch = lc.llama_batch_init(512, 0, 1)
        try:
            prompt_tokens = self.tokenize(prompt)
            step, pos, out = prompt_tokens, 0, b""
            for _ in range(n):
                for i, t in enumerate(step):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos + i, 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = i == len(step) - 1
                batch.n_tokens = len(step)
                assert lc.llama_decode(ctx, batch) == 0
                pos += len(step)
                logits = np.ctypeslib.as_array(
                    lc.llama_get_logits_ith(ctx, len(step) - 1), shape=(self.n_vocab,)
                )
                token = int(np.argmax(logits))
                out += self.piece(token)
                step = [token]
            return prompt_tokens, out.decode("utf-8", "replace")
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)


# ---- one test per family and concern ----
@pytest.mark.parametrize("arch", ARCHS)
def test_the_family_loads_and_the_gguf_says_so(gguf_files, arch):
    """The file is what it claims (llama.cpp reads `general.architecture` back), and llama.cpp loads it."""
    model = _Model(gguf_files[arch])
    try:
        buf = ctypes.create_string_buffer(64)
        n = model.lc.llama_model_meta_val_str(model.model, b"general.architecture", buf, 64)
        assert buf.value.decode() == arch and n == len(arch)
        assert model.lc.llama_model_n_layer(model.model) >= 2
        if arch == "gemma3":
            assert model.lc.llama_model_n_swa(model.model) == GEMMA3_SLIDING_WINDOW
    finally:
        model.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_text_is_stable_and_matches_llama_cpp(naiad, gguf_files, arch):
    _ready(naiad, arch)
    first = _generate(naiad, arch, PROMPT)
    second = _generate(naiad, arch, PROMPT)
    assert first["text_output"] and first["num_output_tokens"] == N_TOKENS
    assert second["text_output"] == first["text_output"]
    model = _Model(gguf_files[arch])
    try:
        prompt_tokens, text = model.greedy(PROMPT, N_TOKENS)
    finally:
        model.close()
    assert first["num_input_tokens"] == len(prompt_tokens)
    assert first["text_output"] == text


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips(gguf_files, arch):
    """Naiad's engine tokenizes and detokenizes any text back to itself, as llama.cpp's own detokenizer does."""
    from naiad.backends.llamacpp.engine import LlamaEngine
    from naiad.backends.llamacpp.params import EngineSettings

    engine = LlamaEngine(gguf_files[arch], EngineSettings(n_ctx=N_CTX, n_parallel=1, n_threads=1))
    model = _Model(gguf_files[arch], vocab_only=True)
    try:
        for text in TEXTS:
            tokens = engine.tokenize(text, add_special=False, parse_special=False)
            assert tokens == model.tokenize(text, add_special=False, parse_special=False)
            assert 0 < len(tokens) <= len(text.encode())
            assert b"".join(engine.piece(t) for t in tokens).decode() == text
            assert model.detokenize(tokens) == text
        # the family's special tokens are single tokens when the text spells them (chat templates do)
        eos = engine.special_text("eos")
        assert eos and len(engine.tokenize(eos, add_special=False)) == 1
    finally:
        model.close()
        engine.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_renders_the_models_template(naiad, arch):
    """A chat completion is the model's own chat template (from the GGUF) rendered and generated from."""
    _ready(naiad, arch)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": arch, "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{naiad.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == 6
    assert answer["choices"][0]["message"]["content"]
    reader = gguf.GGUFReader(str(_model_file(naiad, arch)))
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    tokens = reader.fields["tokenizer.ggml.tokens"]
    token_text = [bytes(tokens.parts[i]).decode() for i in tokens.data]
    bos = token_text[int(reader.fields["tokenizer.ggml.bos_token_id"].parts[-1][0])]
    eos = token_text[int(reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])]
    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    )
    direct = _generate(naiad, arch, rendered, 6)
    assert answer["choices"][0]["message"]["content"] == direct["text_output"]
    assert answer["usage"]["prompt_tokens"] == direct["num_input_tokens"]


def _model_file(naiad, arch: str) -> Path:
    return Path(naiad.repos[0]) / arch / "1" / "model.gguf"


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_reuse_gives_the_text_of_a_fresh_engine(gguf_files, arch):
    """A request sharing a prompt prefix with the slot's last one reuses that prefix in the KV cache and gets the
    same text as a fresh engine, also after a sequence longer than a sliding-window cache of its own size would hold
    (gemma3: a 16-token window; with swa_full off, 256 cells at n_batch 32, and the reused prefix's window would be
    gone: the engine keeps the full-size one)."""
    from naiad.backends.llamacpp.engine import GenerationRequest, LlamaEngine
    from naiad.backends.llamacpp.params import EngineSettings, SamplingParams

    def run(engine, text: str, n: int) -> str:
        done, out = threading.Event(), []

        def emit(o):
            out.append(o.text)
            if o.finish_reason is not None:
                done.set()

        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest(engine.tokenize(text), sp, emit, lambda e: done.set()))
        assert done.wait(60)
        return "".join(out)

    settings = EngineSettings(n_ctx=1024, n_parallel=1, n_threads=1, n_batch=32)
    warm = LlamaEngine(gguf_files[arch], settings)
    cold = LlamaEngine(gguf_files[arch], settings)
    base = "The user asked a question and the assistant answered"
    try:
        run(warm, base + " with a story", 8)  # short: every cache holds the whole sequence
        hits = warm.prefix_hits
        again = run(warm, base + " about the sea", 8)
        assert warm.prefix_hits - hits >= len(warm.tokenize(base)) - 1
        assert again == run(cold, base + " about the sea", 8)
        run(warm, base + " with a long story", 400)  # past the sliding-window cache's cells
        after_long = run(warm, base + " about the sky", 8)
        assert after_long == run(cold, base + " about the sky", 8)
    finally:
        warm.close()
        cold.close()
