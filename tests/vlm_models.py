"""Random-weight multimodal (vision-language) models for the image tests, written here: nothing is downloaded.

`write_mmproj_gguf(path)` writes a LLaVA-1.5-style multimodal projector GGUF that llama.cpp's libmtmd loads
(`clip.projector_type` "mlp", as `tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py --llava-projector`
writes it, in today's tensor names): a CLIP vision tower (a 16x16-pixel patch embedding of 32x32-pixel images, so 4
patches, plus a class embedding; 2 transformer blocks of width 32, of which LLaVA uses all but the last) and the
two-layer GELU MLP projector (mm.0, mm.2) into the text model's embedding width (64, the tiny llama of
llm_models.write_llama_gguf). An image becomes 4 embeddings in the text model's sequence. `write_llamacpp_vlm(dir)`
writes a repository entry: the tiny llama as `1/model.gguf` and the projector as `1/mmproj.gguf`.

`write_tiny_hf_llava(folder)` writes a tiny random-weight `LlavaForConditionalGeneration` (a 2-layer CLIP vision tower
on 32x32 images in 16x16 patches, a 2-layer llama) with its `LlavaProcessor` (a CLIP image processor and the tests'
word-level tokenizer with an `<image>` token), saved with `save_pretrained`, for the transformers backend.

`png(color)`/`noise_png(seed)` etc. make small test images.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

MMPROJ_IMAGE_SIZE = 32
MMPROJ_PATCH_SIZE = 16
IMAGE_TOKENS = (MMPROJ_IMAGE_SIZE // MMPROJ_PATCH_SIZE) ** 2  # embeddings one image puts in the text sequence
# CLIP's normalisation, as LLaVA-1.5's preprocessor_config.json has it
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def write_mmproj_gguf(
    path: str | os.PathLike,
    *,
    n_embd_text: int = 64,
    n_embd: int = 32,
    n_ff: int = 48,
    n_head: int = 4,
    n_layer: int = 2,
    n_mm: int = 64,
    seed: int = 7,
    strength: float = 3.0,
) -> Path:
    """Write a random-weight LLaVA-style (projector "mlp") mmproj GGUF for a text model of width `n_embd_text`.
    `strength` scales the projector's output so that an image's embeddings weigh as much as the text's in the tiny
    model: different images then give different greedy text."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_patches = (MMPROJ_IMAGE_SIZE // MMPROJ_PATCH_SIZE) ** 2

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))).astype(np.float32)

    def vec(n: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(n) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name("naiad-tiny-llava-mmproj")
    w.add_description("image encoder for LLaVA")
    w.add_file_type(0)
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_uint32("clip.vision.image_size", MMPROJ_IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", MMPROJ_PATCH_SIZE)
    w.add_uint32("clip.vision.embedding_length", n_embd)
    w.add_uint32("clip.vision.feed_forward_length", n_ff)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.vision.block_count", n_layer)
    w.add_array("clip.vision.image_mean", CLIP_MEAN)
    w.add_array("clip.vision.image_std", CLIP_STD)
    w.add_bool("clip.use_gelu", False)  # CLIP's quick_gelu

    # the patch embedding is a 2-D convolution (always f16, as the converter writes 4-D tensors)
    patch = rng.standard_normal((n_embd, 3, MMPROJ_PATCH_SIZE, MMPROJ_PATCH_SIZE)) / np.sqrt(
        3 * MMPROJ_PATCH_SIZE**2
    )
    w.add_tensor("v.patch_embd.weight", patch.astype(np.float16))
    w.add_tensor("v.class_embd", vec(n_embd, 1.0))
    w.add_tensor("v.position_embd.weight", mat(n_patches + 1, n_embd, 0.1))
    w.add_tensor("v.pre_ln.weight", ones(n_embd))
    w.add_tensor("v.pre_ln.bias", vec(n_embd))
    for i in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", mat(n_embd, n_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", vec(n_embd))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", ones(n_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", vec(n_embd))
        w.add_tensor(f"v.blk.{i}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"v.blk.{i}.ffn_up.bias", vec(n_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.weight", mat(n_embd, n_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.bias", vec(n_embd))
    w.add_tensor("mm.0.weight", mat(n_mm, n_embd))
    w.add_tensor("mm.0.bias", vec(n_mm))
    w.add_tensor("mm.2.weight", mat(n_embd_text, n_mm, strength))
    w.add_tensor("mm.2.bias", vec(n_embd_text))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def write_llamacpp_vlm(model_dir: Path, extra_config: str = "", mmproj_name: str = "mmproj.gguf") -> None:
    """A repository entry serving the tiny llama with an image projector on the llama.cpp backend (one thread):
    `1/model.gguf` and `1/<mmproj_name>` (mmproj.gguf is found by name; another name needs parameter `mmproj`)."""
    from llm_models import write_tiny_gguf

    write_tiny_gguf(model_dir / "1" / "model.gguf")
    write_mmproj_gguf(model_dir / "1" / mmproj_name)
    (model_dir / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "n_threads" value: { string_value: "1" } }\n' + extra_config
    )


# ---- images ----
def _encode(image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> bytes:
    """A solid-colour PNG."""
    from PIL import Image

    return _encode(Image.new("RGB", size, color), "PNG")


def noise_image(seed: int, size: tuple[int, int] = (48, 40)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def noise_png(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    """A PNG of random pixels: two seeds are two very different images."""
    return _encode(noise_image(seed, size), "PNG")


def encoded(seed: int, fmt: str, size: tuple[int, int] = (48, 40)) -> bytes:
    """The random image of `seed` in format `fmt` (PNG, JPEG, WEBP, GIF, BMP, ...)."""
    image = noise_image(seed, size)
    if fmt == "GIF":
        image = image.convert("P")
    return _encode(image, fmt)


# ---- a Hugging Face vision-language model (the transformers backend) ----
HF_IMAGE_TOKEN = "<image>"
# a Hugging Face template for images: content a string, or parts of which an image part writes the image token
HF_VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}<|assistant|>"
)
HF_IMAGE_SIZE = 32
HF_PATCH_SIZE = 16


def write_tiny_hf_llava(folder: Path) -> None:
    """A tiny random-weight LLaVA (`LlavaForConditionalGeneration`: a CLIP vision tower, a GELU MLP projector, a llama)
    and its `LlavaProcessor` (CLIP's image processor at 32x32, the tests' word-level tokenizer with an `<image>`
    token and the template above), saved with `save_pretrained` into `folder`: what `backend: "transformers"` serves
    as a vision-language model. An image becomes 4 `<image>` tokens (2x2 patches; LLaVA's "default" feature selection
    drops the class token)."""
    import torch
    from llm_models import _hf_tokenizer
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _hf_tokenizer(False)
    tokenizer.add_special_tokens({"additional_special_tokens": [HF_IMAGE_TOKEN]})
    tokenizer.chat_template = HF_VLM_CHAT_TEMPLATE
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": HF_IMAGE_SIZE},
        crop_size={"height": HF_IMAGE_SIZE, "width": HF_IMAGE_SIZE},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=HF_PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=HF_IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=HF_VLM_CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)
    torch.manual_seed(1234)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=HF_IMAGE_SIZE,
            patch_size=HF_PATCH_SIZE,
            projection_dim=32,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids(HF_IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # the projector's output as large as the text's embeddings: the image weighs in
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    model.save_pretrained(folder)
