"""Random-weight llama models for the LLM tests and benchmarks: GGUFs written with the `gguf` package, and a tiny
Hugging Face folder (`write_tiny_hf_llama`) for the transformers backend.

`write_tiny_gguf(path)` writes a ~0.4 MB llama (2 layers, n_embd 64) with a real byte-level BPE tokenizer (GPT-2
style: 256 byte tokens, merges learnt from a short text here, special tokens `<s>`, `</s>`, `<|im_start|>`,
`<|im_end|>`), so any text round-trips through tokenize/detokenize, and a ChatML chat template. `write_large_gguf`
writes the same shape scaled up so that one decode step takes milliseconds (the benchmark's "engine dominates"
model). Nothing is downloaded; the weights come from a seeded generator, so a file is the same on every machine.
"""

from __future__ import annotations

import collections
import itertools
import os
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


def _tokenizer(n_merges: int) -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a byte-level BPE learnt from _CORPUS with `n_merges` merges."""
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
    types = [1] * len(tokens) + [3] * len(SPECIAL)  # 1 normal, 3 control
    return tokens + SPECIAL, merges, types


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
) -> Path:
    """Write a random-weight llama GGUF with a byte-level BPE tokenizer and a chat template to `path`."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merges, types = _tokenizer(n_merges)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "f16" else np.float32

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np_dtype)

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
