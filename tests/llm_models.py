"""Random-weight llama models for the LLM tests and benchmarks: GGUFs written with the `gguf` package, and a tiny
Hugging Face folder (`write_tiny_hf_llama`) for the transformers backend.

`write_tiny_gguf(path)` writes a ~0.4 MB llama (2 layers, n_embd 64) with a real byte-level BPE tokenizer (GPT-2
style: 256 byte tokens, merges learnt from a short text here, special tokens `<s>`, `</s>`, `<|im_start|>`,
`<|im_end|>`), so any text round-trips through tokenize/detokenize, and a ChatML chat template. `write_large_gguf`
writes the same shape scaled up so that one decode step takes milliseconds (the benchmark's "engine dominates"
model). `write_arch_gguf(path, arch)` writes a tiny model of another family (ARCHITECTURES: qwen2, qwen3, gemma3,
mistral3) laid out as llama.cpp's `convert_hf_to_gguf.py` lays that family out, with the same tokenizer under that
family's special tokens, pre-tokenizer and chat template. `write_lora_gguf(path)` writes a LoRA adapter of the tiny
llama as llama.cpp's `convert_lora_to_gguf.py` lays one out. Nothing is downloaded; the weights come from a seeded
generator, so a file is the same on every machine.
"""

from __future__ import annotations

import collections
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = "<s>", "<|im_end|>"

_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello world, this is a tiny language model for testing the server.
Once upon a time there was a model that generated tokens one at a time, and the server streamed them to the
client as soon as they were ready. The user asked a question and the assistant answered with a story about the
sea, the sky, the stars and the time it takes to write a test that does not fail. What is the capital of France?
It is Paris. Count to ten: one, two, three, four, five, six, seven, eight, nine, ten.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values onto printable characters (byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _tokenizer(n_merges: int, special: list[str] = SPECIAL) -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a byte-level BPE learnt from _CORPUS with `n_merges` merges, then the
    `special` (control) tokens."""
    byte_char = _bytes_to_unicode()
    tokens = [byte_char[b] for b in range(256)]
    # words as the GPT-2 pre-tokeniser roughly splits them: a leading space belongs to the word
    words = collections.Counter()
    for i, word in enumerate(_CORPUS.split()):
        text = (" " if i else "") + word
        words[tuple(byte_char[b] for b in text.encode())] += 1
    merges: list[str] = []
    known = set(tokens)
    for _ in range(n_merges):
        pairs: collections.Counter = collections.Counter()
        for word, count in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
        new_words: collections.Counter = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    types = [1] * len(tokens) + [3] * len(special)  # 1 normal, 3 control
    return tokens + special, merges, types


def write_llama_gguf(
    path: str | os.PathLike,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 4,
    n_ff: int = 128,
    n_merges: int = 120,
    context_length: int = 2048,
    seed: int = 0,
    dtype: str = "f32",
    noise: float = 0.0,
) -> Path:
    """Write a random-weight llama GGUF with a byte-level BPE tokenizer and a chat template to `path`. `noise` > 0
    adds that much of other random weights to every matrix: a model close to the one `seed` gives (a draft model
    that agrees with it often, not always)."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merges, types = _tokenizer(n_merges)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "f16" else np.float32

    other = np.random.default_rng(seed + 1000)

    def mat(rows: int, cols: int) -> np.ndarray:
        m = rng.standard_normal((rows, cols))
        if noise:
            m += noise * other.standard_normal((rows, cols))
        return (m / np.sqrt(cols)).astype(np_dtype)

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("naiad-tiny-llama")
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1 if dtype == "f16" else 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index(BOS))
    w.add_eos_token_id(tokens.index(EOS))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(head_dim * n_head_kv, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(head_dim * n_head_kv, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", mat(n_vocab, n_embd) * np_dtype(4.0))  # sharper logits than 1/sqrt(n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def write_lora_gguf(
    path: str | os.PathLike,
    *,
    seed: int = 1,
    rank: int = 8,
    alpha: float = 16.0,
    strength: float = 2.0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_ff: int = 128,
    arch: str = "llama",
) -> Path:
    """Write a random LoRA adapter for the model `write_llama_gguf` writes (same n_embd/n_layer/n_ff), laid out as
    llama.cpp's `convert_lora_to_gguf.py` writes a PEFT adapter: `general.type` "adapter", `adapter.type` "lora",
    `adapter.lora.alpha`, and for each adapted weight `<tensor>.lora_a` (PEFT's lora_A: rank x in) and `.lora_b`
    (lora_B: out x rank). It adapts every block's attn_q, attn_v and ffn_down, with B scaled by `strength` so that
    the update (alpha/rank * B @ A) is of the weights' own size: greedy text visibly changes."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def pair(name: str, n_out: int, n_in: int) -> None:
        a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * (strength / np.sqrt(rank))).astype(np.float32)
        w.add_tensor(f"{name}.lora_a", a)
        w.add_tensor(f"{name}.lora_b", b)

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for i in range(n_layer):
        pair(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        pair(f"blk.{i}.attn_v.weight", n_embd, n_embd)
        pair(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def write_tiny_gguf(path: str | os.PathLike) -> Path:
    """The test model: ~0.4 MB, loads in a fraction of a second, thousands of tokens/s on one core."""
    return write_llama_gguf(path)


LARGE = {"n_embd": 768, "n_layer": 6, "n_head": 12, "n_head_kv": 12, "n_ff": 2048, "dtype": "f16", "seed": 1}


def write_large_gguf(path: str | os.PathLike) -> Path:
    """The benchmark's larger model (f16, ~85 MB): one decode step takes ~10 ms or more on these cores."""
    return write_llama_gguf(path, **LARGE)


def cached_large_gguf() -> Path:
    """The larger model, written once under the tools cache (not the repository)."""
    root = Path(os.environ.get("NAIAD_TOOLS_CACHE", Path.home() / ".cache" / "naiad-tools"))
    tag = "-".join(f"{k}{v}" for k, v in sorted(LARGE.items()))
    path = root / "llm-models" / f"large-llama-{tag}.gguf"
    if not path.exists():
        write_large_gguf(path)
    return path


# ---- draft models for speculative decoding (the benchmark's, from a real GGUF) ----
def _copy_metadata(reader, writer, skip: tuple[str, ...] = ()) -> None:
    """Every key of `reader`'s GGUF but the writer's own, `general.architecture` and those starting with `skip`."""
    import gguf

    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith(("GGUF.", *skip)):
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), kind, sub_type=sub)


def write_truncated_gguf(path: str | os.PathLike, like: str | os.PathLike, n_layer: int) -> Path:
    """A llama GGUF's first `n_layer` blocks, its embedding, output and tokenizer as they are (quantized tensors
    copied byte for byte): a cheaper model that often agrees with the whole one (a layer-skip draft)."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(like))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    _copy_metadata(reader, w, skip=(f"{arch}.block_count",))
    w.add_block_count(n_layer)
    keep = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < n_layer]
    for t in keep:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    w.close()
    os.replace(tmp, path)
    return path


def write_random_like_gguf(
    path: str | os.PathLike, like: str | os.PathLike, *, n_embd: int = 64, n_layer: int = 2
) -> Path:
    """A tiny random-weight llama with the tokenizer (every `tokenizer.*` key) of the GGUF `like`: a draft model
    whose vocabulary fits that model's, and that knows nothing (it costs a draft and almost never agrees)."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(like))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    n_head, n_ff = 4, 2 * n_embd
    rng = np.random.default_rng(0)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("naiad-random-draft")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(n_vocab)
    w.add_file_type(0)
    for f in reader.fields.values():
        if f.name.startswith("tokenizer."):
            kind = f.types[0]
            sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), kind, sub_type=sub)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


# ---- other architectures ----
# What the architecture tests (tests/test_llamacpp_architectures.py) load: for each family users bring, a tiny
# random-weight GGUF with the `general.architecture`, the hyperparameter keys and the tensor names and shapes that
# llama.cpp's `convert_hf_to_gguf.py` writes for a real checkpoint of that family (and its loader, src/models/<arch>.cpp,
# reads), scaled down. The shapes keep each family's own quirks: a head size that is not n_embd / n_head (qwen3,
# gemma3, mistral3), grouped-query attention, tied or separate output weights. Each file is 0.3-0.6 MB.
ARCHITECTURES: dict[str, str] = {
    "llama": "Llama 3 / Mistral 7B layout (write_llama_gguf): the reference every other family is compared to",
    "qwen2": "Qwen2.5-0.5B/1.5B layout: biased q/k/v projections, GQA, the output tied to the token embedding, "
    "rope base 1e6, the qwen2 pre-tokenizer",
    "qwen3": "Qwen3-8B layout: per-head RMS norms of q and k (attn_q_norm/attn_k_norm), a head size of its own "
    "(attention.key_length 32 with n_embd 64 and 4 heads), GQA, a separate output, rope base 1e6",
    "gemma3": "Gemma 3 layout: sandwich norms (post_attention_norm, post_ffw_norm), q/k norms, head size 16 with n_embd "
    "32, one KV head, a 16-token sliding window on 5 of every 6 layers (6 layers: one global) with its own rope "
    "base (rope.freq_base_swa), linear rope scaling x8 on the global layers, the output tied to the embedding",
    "mistral3": "Ministral 3 / Mistral Small 3.x / Devstral 2 layout (llama-like, arch mistral3): YaRN rope scaling "
    "x16 from 16384 positions, Llama-4 attention temperature scaling, head size 32 with n_embd 64, GQA, the tekken "
    "pre-tokenizer",
}

GEMMA3_SLIDING_WINDOW = 16  # tokens: small, so a test's prompts and generations cross it
# Random weights with the output tied to the embedding make a model that repeats its last token: the residual stream
# is mostly that token's embedding, which scores itself highest. The residual branches' output projections (x4) and
# Gemma's post-branch norms (x4, it normalises each branch) outweigh it, so greedy text depends on the context.
_BRANCH = 4.0
_TIED = 2.0
_GEMMA_POST_NORM = 4.0


@dataclass(frozen=True)
class _Vocab:
    """A family's special tokens, pre-tokenizer and chat template around the shared byte-level BPE."""

    special: tuple[str, ...]
    bos: str
    eos: str
    add_bos: bool
    pre: str
    template: str
    pad: str | None = None


_CHATML = CHAT_TEMPLATE
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]{{ message['content'] }}"
    "[/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
_QWEN_VOCAB = _Vocab(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    add_bos=False,
    pre="qwen2",
    template=_CHATML,
    pad="<|endoftext|>",
)
_VOCABS = {
    "qwen2": _QWEN_VOCAB,
    "qwen3": _QWEN_VOCAB,
    "gemma3": _Vocab(
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>",
        eos="<eos>",
        add_bos=True,
        pre="default",
        template=_GEMMA_TEMPLATE,
        pad="<pad>",
    ),
    "mistral3": _Vocab(
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        bos="<s>",
        eos="</s>",
        add_bos=True,
        pre="tekken",
        template=_MISTRAL_TEMPLATE,
    ),
}


def write_arch_gguf(path: str | os.PathLike, arch: str, *, seed: int = 0) -> Path:
    """Write the tiny random-weight GGUF of `arch` (a key of ARCHITECTURES) to `path`."""
    if arch == "llama":
        return write_llama_gguf(path, seed=seed)
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = _VOCABS[arch]
    tokens, merges, types = _tokenizer(120, list(vocab.special))
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        """A (rows, cols) weight as PyTorch stores it, i.e. ggml's {cols, rows}."""
        return (rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))).astype(np.float32)

    def vec(n: int, scale: float = 0.0, post: bool = False) -> np.ndarray:
        """A norm's weight (ones; Gemma's converter stores 1 + w, and HF initialises w to 0) or a bias."""
        if scale:
            return (rng.standard_normal(n) * scale).astype(np.float32)
        return np.full(n, _GEMMA_POST_NORM if post else 1.0, dtype=np.float32)

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"naiad-tiny-{arch}")
    tensors: list[tuple[str, np.ndarray]] = []
    if arch in ("qwen2", "qwen3"):
        # Qwen2ForCausalLM / Qwen3ForCausalLM: TextModel.set_gguf_parameters (+ key_length from head_dim for qwen3)
        n_embd, n_layer, n_head, n_head_kv, n_ff = 64, 2, 4, 2, 128
        head_dim = 32 if arch == "qwen3" else n_embd // n_head
        w.add_block_count(n_layer)
        w.add_context_length(32768 if arch == "qwen2" else 40960)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(1_000_000.0)
        w.add_layer_norm_rms_eps(1e-6)
        if arch == "qwen3":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        tied = arch == "qwen2"  # Qwen2.5-0.5B/1.5B tie the output to the embedding; Qwen3-8B does not
        tensors.append(("token_embd.weight", mat(n_vocab, n_embd, _TIED if tied else 1.0)))
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors.append((b + "attn_norm.weight", vec(n_embd)))
            tensors.append((b + "attn_q.weight", mat(n_head * head_dim, n_embd)))
            tensors.append((b + "attn_k.weight", mat(n_head_kv * head_dim, n_embd)))
            tensors.append((b + "attn_v.weight", mat(n_head_kv * head_dim, n_embd)))
            if arch == "qwen2":  # Qwen2's q/k/v projections have biases (bias=True), its o_proj none
                tensors.append((b + "attn_q.bias", vec(n_head * head_dim, 0.1)))
                tensors.append((b + "attn_k.bias", vec(n_head_kv * head_dim, 0.1)))
                tensors.append((b + "attn_v.bias", vec(n_head_kv * head_dim, 0.1)))
            else:  # Qwen3: RMS norms over each head of q and k, before rope
                tensors.append((b + "attn_q_norm.weight", vec(head_dim)))
                tensors.append((b + "attn_k_norm.weight", vec(head_dim)))
            tensors.append((b + "attn_output.weight", mat(n_embd, n_head * head_dim, _BRANCH)))
            tensors.append((b + "ffn_norm.weight", vec(n_embd)))
            tensors.append((b + "ffn_gate.weight", mat(n_ff, n_embd)))
            tensors.append((b + "ffn_up.weight", mat(n_ff, n_embd)))
            tensors.append((b + "ffn_down.weight", mat(n_embd, n_ff, _BRANCH)))
        tensors.append(("output_norm.weight", vec(n_embd)))
        if not tied:
            tensors.append(("output.weight", mat(n_vocab, n_embd, 4.0)))
    elif arch == "gemma3":
        # Gemma3ForCausalLM: Gemma3Model.set_gguf_parameters over TextModel's; the 4B+ checkpoints' linear rope
        # scaling (factor 8, full-attention layers), rope_local_base_freq as rope.freq_base_swa; no
        # sliding_window_pattern key, so llama.cpp's default pattern applies (every 6th layer global)
        n_embd, n_layer, n_head, n_head_kv, n_ff, head_dim = 32, 6, 4, 1, 64, 16
        w.add_block_count(n_layer)
        w.add_context_length(32768)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)
        w.add_rope_freq_base(1_000_000.0)
        w.add_rope_freq_base_swa(10_000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(GEMMA3_SLIDING_WINDOW)
        tensors.append(("token_embd.weight", mat(n_vocab, n_embd, _TIED)))  # tied: no output.weight
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors.append((b + "attn_norm.weight", vec(n_embd)))
            tensors.append((b + "attn_q.weight", mat(n_head * head_dim, n_embd)))
            tensors.append((b + "attn_k.weight", mat(n_head_kv * head_dim, n_embd)))
            tensors.append((b + "attn_v.weight", mat(n_head_kv * head_dim, n_embd)))
            tensors.append((b + "attn_q_norm.weight", vec(head_dim)))
            tensors.append((b + "attn_k_norm.weight", vec(head_dim)))
            tensors.append((b + "attn_output.weight", mat(n_embd, n_head * head_dim, _BRANCH)))
            tensors.append((b + "post_attention_norm.weight", vec(n_embd, post=True)))
            tensors.append((b + "ffn_norm.weight", vec(n_embd)))  # Gemma's pre_feedforward_layernorm
            tensors.append((b + "ffn_gate.weight", mat(n_ff, n_embd)))
            tensors.append((b + "ffn_up.weight", mat(n_ff, n_embd)))
            tensors.append((b + "ffn_down.weight", mat(n_embd, n_ff, _BRANCH)))
            tensors.append((b + "post_ffw_norm.weight", vec(n_embd, post=True)))
        tensors.append(("output_norm.weight", vec(n_embd)))
    elif arch == "mistral3":
        # Ministral3ForCausalLM (Mistral3Model.Ministral3Model, a LlamaModel): vocab_size and rope dimension count
        # as llama writes them, YaRN from rope_parameters, yarn_log_multiplier from mscale_all_dim and the
        # attention temperature scale from llama_4_scaling_beta
        n_embd, n_layer, n_head, n_head_kv, n_ff, head_dim = 64, 2, 4, 2, 128, 32
        w.add_block_count(n_layer)
        w.add_context_length(262144)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(16.0)
        w.add_rope_scaling_orig_ctx_len(16384)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
        w.add_rope_freq_base(1_000_000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_yarn_log_mul(1.0)
        w.add_attn_temperature_scale(0.1)
        tensors.append(("token_embd.weight", mat(n_vocab, n_embd)))
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors.append((b + "attn_norm.weight", vec(n_embd)))
            tensors.append((b + "attn_q.weight", mat(n_head * head_dim, n_embd)))
            tensors.append((b + "attn_k.weight", mat(n_head_kv * head_dim, n_embd)))
            tensors.append((b + "attn_v.weight", mat(n_head_kv * head_dim, n_embd)))
            tensors.append((b + "attn_output.weight", mat(n_embd, n_head * head_dim, _BRANCH)))
            tensors.append((b + "ffn_norm.weight", vec(n_embd)))
            tensors.append((b + "ffn_gate.weight", mat(n_ff, n_embd)))
            tensors.append((b + "ffn_up.weight", mat(n_ff, n_embd)))
            tensors.append((b + "ffn_down.weight", mat(n_embd, n_ff, _BRANCH)))
        tensors.append(("output_norm.weight", vec(n_embd)))
        tensors.append(("output.weight", mat(n_vocab, n_embd, 4.0)))
    else:
        raise ValueError(f"no tiny GGUF writer for architecture {arch!r} (known: {', '.join(ARCHITECTURES)})")
    w.add_file_type(0)  # all F32
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index(vocab.bos))
    w.add_eos_token_id(tokens.index(vocab.eos))
    if vocab.pad is not None:
        w.add_pad_token_id(tokens.index(vocab.pad))
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(False)
    w.add_chat_template(vocab.template)
    for name, data in tensors:
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


# ---- a Hugging Face folder for the transformers backend ----
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model writes words one after another",
    "naiad serves large language models with continuous batching",
    "every request streams its tokens as they come",
]
HF_CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}<|assistant|>"


def _hf_tokenizer(byte_level: bool, vocab_size: int = 0):
    """The tests' Hugging Face tokenizer: word-level over SENTENCES, or byte-level BPE (every byte a token); with
    `vocab_size`, padded with added tokens `<extra_N>` up to that size (a real-size vocabulary whose every id
    decodes to text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator(SENTENCES, trainer)
    else:
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if vocab_size > tok.get_vocab_size():
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = HF_CHAT_TEMPLATE
    return fast


def write_tiny_hf_llama(folder: Path, byte_level: bool = False) -> None:
    """A tiny random-weight `LlamaConfig` model and a word-level tokenizer trained on SENTENCES, saved with
    `save_pretrained` into `folder` (a Hugging Face folder the transformers backend serves). `byte_level`: a
    byte-level BPE tokenizer instead (every byte a token, as GPT-2's and Llama 3's), which can write any text."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _hf_tokenizer(byte_level)
    fast.save_pretrained(folder)
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


# A Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192) with a 32,000-token
# vocabulary: about 1.1 B parameters, 2.2 GB in bfloat16. The GPU benchmark's "real size" model.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def write_sized_hf_llama(folder: Path, shape: dict, device: str = "cpu") -> None:
    """A random-weight llama of the given `LlamaConfig` shape in bfloat16 (initialised on `device`: a GPU makes a
    billion parameters in a second) with the byte-level tokenizer padded to its vocabulary, saved into `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _hf_tokenizer(True, shape["vocab_size"])
    fast.save_pretrained(folder)
    torch.manual_seed(1234)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)


def write_llamacpp_model(model_dir: Path, extra_config: str = "") -> None:
    """A repository entry serving the tiny GGUF with the llama.cpp backend on one thread (`extra_config`: more
    config.pbtxt lines)."""
    write_tiny_gguf(model_dir / "1" / "model.gguf")
    (model_dir / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "n_threads" value: { string_value: "1" } }\n' + extra_config
    )
