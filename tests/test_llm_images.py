"""Images in LLM requests, on random-weight multimodal models written here (tests/vlm_models.py): a tiny llama GGUF with
a LLaVA-style projector (`mmproj.gguf`) on the llama.cpp engine, and a tiny LLaVA with its processor on the
transformers engine. The image changes the greedy text and the same image gives the same text, through OpenAI's chat
(`image_url` data: and file: URLs), the Responses API (`input_image`), Anthropic's Messages (`image` blocks) and
Triton's generate endpoint (vllm_backend's `image` input); the limits and malformed images are 400s in each API's
error object; a model that is not multimodal refuses images; file: URLs are read only under the allowed folder.
In the llama.cpp engine itself, prefix reuse never takes the cells of another image."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import requests
from helpers import NaiadProcess
from llm_models import write_llamacpp_model, write_tiny_hf_llama
from vlm_models import (
    IMAGE_TOKENS,
    encoded,
    noise_png,
    png,
    write_llamacpp_vlm,
    write_tiny_hf_llava,
)

pytest.importorskip("PIL")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.timeout(300)

LLAMACPP = "vlm"  # llama.cpp, the projector found as 1/mmproj.gguf
LLAMACPP_PARAM = "vlm_param"  # llama.cpp, the projector named by parameter mmproj
TRANSFORMERS = "llava"  # transformers, a LLaVA and its processor
TEXT_LLAMACPP = "llama"  # text-only
TEXT_TRANSFORMERS = "tiny"  # text-only
MAX_BYTES = 1_000_000
MAX_PIXELS = 1_000_000
MAX_IMAGES = 3
PROMPT = "the quick brown fox"  # words the transformers model's word-level tokenizer knows


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "one.png").write_bytes(noise_png(1))
    outside = folder.parent / "outside.png"
    outside.write_bytes(noise_png(1))
    os.symlink(outside, folder / "link.png")  # inside the folder, pointing out of it
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, media_dir):
    repo = tmp_path_factory.mktemp("llm_images") / "models"
    write_llamacpp_vlm(repo / LLAMACPP)
    write_llamacpp_vlm(
        repo / LLAMACPP_PARAM,
        'parameters { key: "mmproj" value: { string_value: "projector/vision.gguf" } }\n',
        mmproj_name="projector/vision.gguf",
    )
    write_llamacpp_model(repo / TEXT_LLAMACPP)
    for name, write in ((TRANSFORMERS, write_tiny_hf_llava), (TEXT_TRANSFORMERS, write_tiny_hf_llama)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            'backend: "transformers"\nparameters: { key: "num_blocks" value: { string_value: "64" } }\n'
        )
        write(repo / name / "1")
    args = [
        "--allowed-local-media-path",
        str(media_dir),
        "--max-image-bytes",
        str(MAX_BYTES),
        "--max-image-pixels",
        str(MAX_PIXELS),
        "--max-images-per-request",
        str(MAX_IMAGES),
        "--allow-grpc",
        "false",
    ]
    with NaiadProcess(repo, *args, timeout=240) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def user(*parts) -> list[dict]:
    """One user message of text (str) and images (bytes, or a URL str starting with a scheme) parts."""
    content = []
    for part in parts:
        if isinstance(part, bytes):
            content.append({"type": "image_url", "image_url": {"url": data_url(part)}})
        elif part.startswith("data:") or "://" in part:
            content.append({"type": "image_url", "image_url": {"url": part}})
        else:
            content.append({"type": "text", "text": part})
    return [{"role": "user", "content": content}]


def chat(server, model: str, messages: list[dict], **extra) -> requests.Response:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def said(server, model: str, *parts, **extra) -> str:
    r = chat(server, model, user(*parts), **extra)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def refused(r: requests.Response, *words: str) -> str:
    """The message of an OpenAI-style 400, checked to hold `words`."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


# ---- the image reaches the model ----


@pytest.mark.parametrize("model", [LLAMACPP, LLAMACPP_PARAM, TRANSFORMERS])
def test_the_image_changes_the_greedy_text_and_the_same_image_gives_the_same(server, model):
    first = said(server, model, PROMPT, noise_png(1))
    other = said(server, model, PROMPT, noise_png(2))
    again = said(server, model, PROMPT, noise_png(1))
    assert first != other
    assert first == again
    assert said(server, model, PROMPT) not in (first, other)  # without the image: something else again


@pytest.mark.parametrize("model", [LLAMACPP, TRANSFORMERS])
def test_usage_counts_the_image_tokens_and_streaming_gives_the_same_text(server, oai, model):
    messages = user(PROMPT, noise_png(3))
    whole = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    text_only = oai.chat.completions.create(model=model, messages=user(PROMPT), max_tokens=8, temperature=0)
    # the engine counts the image's tokens; the marker / image token it replaces is one or a few text tokens
    assert whole.usage.prompt_tokens >= text_only.usage.prompt_tokens + IMAGE_TOKENS - 4
    stream = oai.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content


def test_two_images_in_one_message_in_order(server):
    ab = said(server, LLAMACPP, "first", noise_png(1), "then", noise_png(2), "which?")
    ba = said(server, LLAMACPP, "first", noise_png(2), "then", noise_png(1), "which?")
    assert ab != ba
    assert ab == said(server, LLAMACPP, "first", noise_png(1), "then", noise_png(2), "which?")
    r = chat(server, TRANSFORMERS, user(PROMPT, noise_png(1), noise_png(2)))
    assert r.status_code == 200, r.text
    one = chat(server, TRANSFORMERS, user(PROMPT, noise_png(1))).json()
    assert r.json()["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] + IMAGE_TOKENS


@pytest.mark.parametrize("model", [LLAMACPP, TRANSFORMERS])
def test_every_api_takes_the_image(server, oai, claude, model):
    image = noise_png(4)
    by_chat = said(server, model, PROMPT, image)
    response = oai.responses.create(
        model=model,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": PROMPT},
                    {"type": "input_image", "image_url": data_url(image)},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
    )
    message = claude.messages.create(
        model=model,
        max_tokens=8,
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": PROMPT},
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(image).decode(),
                        },
                    },
                ],
            }
        ],
    )
    assert response.output_text == by_chat
    assert "".join(b.text for b in message.content if b.type == "text") == by_chat
    # a later turn of the Responses API replays the earlier turn's image with it
    later = oai.responses.create(
        model=model, input="and now?", previous_response_id=response.id, max_output_tokens=4, temperature=0
    )
    assert later.status == "completed" or later.status == "incomplete"


def test_triton_generate_endpoint_takes_the_image_input(server):
    def generate(model: str, prompt: str, *images: bytes) -> requests.Response:
        body = {
            "text_input": prompt,
            "image": [base64.b64encode(i).decode() for i in images],
            "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0}),
            "exclude_input_in_output": True,
        }
        return requests.post(f"{server.url}/v2/models/{model}/generate", json=body, timeout=60)

    config = requests.get(f"{server.url}/v2/models/{LLAMACPP}/config", timeout=10).json()
    image_input = next(i for i in config["input"] if i["name"] == "image")
    assert (
        image_input["data_type"] == "TYPE_STRING" and image_input["dims"] == [-1] and image_input["optional"]
    )
    for model, marker in ((LLAMACPP, "<__media__>"), (TRANSFORMERS, "<image>")):
        prompt = f"<|im_start|>user\n{marker} {PROMPT}<|im_end|>\n<|im_start|>assistant\n"
        one = generate(model, prompt, noise_png(1))
        assert one.status_code == 200, one.text
        two = generate(model, prompt, noise_png(2))
        assert one.json()["text_output"] != two.json()["text_output"]
        assert generate(model, prompt, noise_png(1)).json()["text_output"] == one.json()["text_output"]
    # markers and images that do not match, an image last, an image to a text-only model
    r = generate(LLAMACPP, "no marker here", noise_png(1))
    assert r.status_code == 400 and "image markers" in r.json()["error"], r.text
    r = generate(LLAMACPP, "last: <__media__>", noise_png(1))
    assert r.status_code == 400 and "ends with an image" in r.json()["error"], r.text
    for model in (TEXT_LLAMACPP, TEXT_TRANSFORMERS):
        r = generate(model, "look <__media__> here", noise_png(1))
        assert r.status_code == 400 and "not multimodal" in r.json()["error"], r.text
    r = generate(TRANSFORMERS, f"no image token {PROMPT}", noise_png(1))
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_png_jpeg_webp_and_gif_are_taken(server, fmt):
    image = encoded(5, fmt)
    for model in (LLAMACPP, TRANSFORMERS):
        r = chat(server, model, user(PROMPT, data_url(image, f"image/{fmt.lower()}")))
        assert r.status_code == 200, r.text


def test_a_large_image_crosses_to_the_engine(server):
    """A 256x256 noise PNG is ~200 KB (base64 ~260 KB): over 64 KiB, it reaches the engine in a shared-memory slab
    when frontend workers serve the request (NAIAD_TEST_EXTRA_ARGS="--frontend-workers 2")."""
    big = encoded(6, "PNG", (256, 256))
    assert len(big) > 128 * 1024
    small = encoded(6, "PNG", (32, 32))  # the same pixels' top-left: another image for the model
    for model in (LLAMACPP, TRANSFORMERS):
        assert said(server, model, PROMPT, big) == said(server, model, PROMPT, big)
        assert said(server, model, PROMPT, big) != said(server, model, PROMPT, small)


# ---- limits and malformed input ----


def test_limits_and_malformed_images_are_400s(server):
    for model in (LLAMACPP, TRANSFORMERS):
        refused(chat(server, model, user(PROMPT, *[noise_png(i) for i in range(MAX_IMAGES + 1)])), "4 images")
        too_big = encoded(7, "PNG", (600, 600))  # ~1 MB of noise
        assert len(too_big) > MAX_BYTES
        refused(chat(server, model, user(PROMPT, too_big)), "--max-image-bytes")
        # a decompression bomb: 2000x2000 pixels of one colour in a few KB, refused from its header
        bomb = png((0, 0, 0), (2000, 2000))
        assert len(bomb) < 64 * 1024
        refused(chat(server, model, user(PROMPT, bomb)), "4000000 pixels", "--max-image-pixels")
        refused(chat(server, model, user(PROMPT, "data:image/png;base64,not*base64!")), "not valid base64")
        refused(chat(server, model, user(PROMPT, data_url(b"plain text, no image"))), "not an image")
        refused(chat(server, model, user(PROMPT, data_url(encoded(1, "BMP")))), "not an image", "PNG, JPEG")
        refused(chat(server, model, user(PROMPT, "data:text/plain;base64,aGk=")), "not an image")
        refused(chat(server, model, user(PROMPT, "data:image/png,rawbytes")), "base64")
        refused(
            chat(server, model, user(PROMPT, "https://example.com/cat.png")), "remote", "--allow-image-fetch"
        )
        refused(chat(server, model, user(PROMPT, "ftp://example.com/cat.png")), "scheme")
        truncated = noise_png(8)[:200]  # a PNG header and part of its data
        r = chat(server, model, user(PROMPT, truncated))
        assert r.status_code == 400, r.text  # the header reads; the engine's decode fails
        assert model in requests.get(f"{server.url}/v1/models", timeout=10).text  # still serving
    # an image where the API takes none: an assistant message, a system message
    messages = [
        {
            "role": "assistant",
            "content": [{"type": "image_url", "image_url": {"url": data_url(png((1, 2, 3)))}}],
        }
    ]
    refused(chat(server, LLAMACPP, messages), "image_url parts in user messages")


def test_the_other_apis_answer_limits_in_their_own_error_objects(server):
    many = [{"type": "input_image", "image_url": data_url(noise_png(i))} for i in range(MAX_IMAGES + 1)]
    r = requests.post(
        f"{server.url}/v1/responses",
        json={"model": LLAMACPP, "input": [{"role": "user", "content": many}]},
        timeout=60,
    )
    refused(r, "images")
    r = requests.post(
        f"{server.url}/v1/responses",
        json={
            "model": LLAMACPP,
            "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
        },
        timeout=60,
    )
    refused(r, "file_id")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}
    r = requests.post(
        f"{server.url}/v1/messages",
        json={"model": LLAMACPP, "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "base64" in body["error"]["message"]
    r = requests.post(
        f"{server.url}/v1/messages",
        json={
            "model": TEXT_LLAMACPP,
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": [{**block, "source": {**block["source"], "data": "aGk="}}]}
            ],
        },
        timeout=60,
    )
    assert r.status_code == 400 and "not multimodal" in r.json()["error"]["message"], r.text


def test_a_model_that_is_not_multimodal_refuses_images(server):
    for model in (TEXT_LLAMACPP, TEXT_TRANSFORMERS):
        refused(chat(server, model, user(PROMPT, noise_png(1))), f"model '{model}' is not multimodal")
        r = chat(server, model, user(PROMPT))  # text parts alone are as before
        assert r.status_code == 200, r.text


# ---- file: URLs ----


def test_file_urls_are_read_only_under_the_allowed_folder(server, media_dir):
    inside = said(server, LLAMACPP, PROMPT, f"file://{media_dir / 'one.png'}")
    assert inside == said(server, LLAMACPP, PROMPT, noise_png(1))
    refused(chat(server, LLAMACPP, user(PROMPT, f"file://{media_dir.parent / 'outside.png'}")), "not under")
    refused(chat(server, LLAMACPP, user(PROMPT, f"file://{media_dir / 'link.png'}")), "not under")
    refused(chat(server, LLAMACPP, user(PROMPT, f"file://{media_dir / '..' / 'outside.png'}")), "not under")
    refused(chat(server, LLAMACPP, user(PROMPT, f"file://{media_dir / 'missing.png'}")), "no file")
    refused(chat(server, LLAMACPP, user(PROMPT, f"file://{media_dir}")), "not a regular file")
    refused(chat(server, LLAMACPP, user(PROMPT, "file://host/etc/passwd")), "not a host")
    refused(chat(server, LLAMACPP, user(PROMPT, f"file://{media_dir}/a%00b.png")), "no file")
    relative = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:one.png"}}]}]
    refused(chat(server, LLAMACPP, relative), "absolute path")


# ---- in-process: the frontend's loader and the llama.cpp engine ----


@pytest.fixture
def loop():
    import asyncio

    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_the_loader_refuses_file_and_remote_urls_unless_allowed(loop, tmp_path):
    from naiad.errors import InvalidArgument
    from naiad.frontends.llm.media import MediaLoader, MediaSettings

    (tmp_path / "a.png").write_bytes(png((1, 2, 3)))
    with pytest.raises(InvalidArgument, match="--allowed-local-media-path"):
        loop.run_until_complete(MediaLoader().load(f"file://{tmp_path / 'a.png'}"))
    with pytest.raises(InvalidArgument, match="--allow-image-fetch"):
        loop.run_until_complete(MediaLoader().load("http://127.0.0.1:1/a.png"))
    allowed = MediaLoader(MediaSettings(allowed_local_media_path=str(tmp_path)))
    assert loop.run_until_complete(allowed.load(f"file://{tmp_path / 'a.png'}")) == png((1, 2, 3))


def test_fetching_is_bounded_in_size_and_time(loop):
    """--allow-image-fetch: an image over HTTP is fetched; one past the byte limit, one too slow and an error status
    are refused."""
    import asyncio

    from aiohttp import web

    from naiad.errors import InvalidArgument
    from naiad.frontends.llm.media import MediaLoader, MediaSettings
    from naiad.llm import images

    image = png((9, 9, 9))

    async def serve_image(request):
        return web.Response(body=image, content_type="image/png")

    async def serve_big(request):
        return web.Response(body=b"\0" * (images.limits.max_bytes + 1), content_type="image/png")

    async def serve_slow(request):
        await asyncio.sleep(5)
        return web.Response(body=image)

    async def run():
        app = web.Application()
        app.router.add_get("/a.png", serve_image)
        app.router.add_get("/big.png", serve_big)
        app.router.add_get("/slow.png", serve_slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        loader = MediaLoader(MediaSettings(allow_fetch=True, fetch_timeout_s=1.0))
        try:
            assert await loader.load(f"http://127.0.0.1:{port}/a.png") == image
            for path, words in (
                ("big.png", "--max-image-bytes"),
                ("slow.png", "took more than"),
                ("none", "404"),
            ):
                with pytest.raises(InvalidArgument, match=words):
                    await loader.load(f"http://127.0.0.1:{port}/{path}")
        finally:
            await runner.cleanup()

    loop.run_until_complete(run())


def test_llama_server_joins_text_and_image_parts():
    from naiad.frontends.llm.media import for_template

    parts = [
        {"type": "text", "text": "a"},
        {"type": "image", "image_url": "data:"},
        {"type": "text", "text": "b"},
        {"type": "text", "text": "c"},
        {"type": "image", "image_url": "data:"},
    ]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]
    assert for_template(messages, "<M>")[1]["content"] == "a<M>b\nc<M>"
    hf = for_template(messages, None)
    assert hf[0]["content"] == [{"type": "text", "text": "s"}]
    assert hf[1]["content"][1] == {"type": "image"}


def test_image_decoding_refuses_what_it_should():
    from naiad.errors import InvalidArgument
    from naiad.llm import images

    assert images.decode(encoded(1, "GIF")).mode == "RGB"
    assert images.probe(png((0, 0, 0), (30, 20))) == images.ImageInfo("PNG", 30, 20)
    with pytest.raises(InvalidArgument, match="pixels"):
        images.probe(png((0, 0, 0), (images.limits.max_pixels + 1, 1)))
    with pytest.raises(InvalidArgument, match="could not be decoded"):
        images.decode(noise_png(1)[:300])
    with pytest.raises(InvalidArgument, match="base64"):
        images.decode_base64("abc")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from naiad.backends.llamacpp.engine import LlamaEngine
    from naiad.backends.llamacpp.multimodal import Media
    from naiad.backends.llamacpp.params import EngineSettings

    folder = tmp_path_factory.mktemp("vlm_engine")
    write_llamacpp_vlm(folder)
    engine = LlamaEngine(folder / "1" / "model.gguf", EngineSettings(n_ctx=256, n_parallel=1, n_threads=1))
    engine.media = Media(engine, folder / "1" / "mmproj.gguf")
    yield engine
    engine.close()


def run_engine(engine, prompt: str, *pngs: bytes) -> tuple[list[int], int]:
    """The greedy tokens of `prompt` with images, and the prefix tokens the engine reused for it."""
    import threading

    from naiad.backends.llamacpp.engine import GenerationRequest
    from naiad.backends.llamacpp.params import SamplingParams
    from naiad.llm import images

    done = threading.Event()
    text: list[str] = []
    failed: list[BaseException] = []
    media = engine.media.tokenize(prompt, [(p, images.decode(p)) for p in pngs])
    before = engine.prefix_hits

    def emit(out):
        text.append(out.text)
        if out.finish_reason is not None:
            done.set()

    def fail(exc):
        failed.append(exc)
        done.set()

    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.submit(GenerationRequest(media.tokens, sampling, emit, fail, media=media))
    assert done.wait(60)
    assert not failed, failed
    return "".join(text), engine.prefix_hits - before


def test_prefix_reuse_never_takes_another_images_cells(engine):
    """One slot: after image 1, the same prompt with image 2 reuses the text before the image only, and gives what
    a fresh slot gives; image 2 again reuses its cells too and gives the same text; image 1 after it, its own."""
    prompt = "<|im_start|>user\nsay what you see <__media__> now<|im_end|>\n<|im_start|>assistant\n"
    head = len(engine.tokenize(prompt.split("<__media__>")[0]))
    one, _ = run_engine(engine, prompt, noise_png(1))
    two, reused = run_engine(engine, prompt, noise_png(2))
    assert reused == head  # the text before the image, not one of its cells
    assert two != one
    same, reused = run_engine(engine, prompt, noise_png(2))
    assert same == two
    assert reused > head + IMAGE_TOKENS  # the image's cells too: the same image, the same ids
    again, reused = run_engine(engine, prompt, noise_png(1))
    assert reused == head and again == one
    # a fresh slot's answer for image 2 (another prompt first: at most its first tokens are reused)
    run_engine(engine, "hello there, something else entirely")
    fresh, reused = run_engine(engine, prompt, noise_png(2))
    assert reused < head and fresh == two


def test_image_ids_are_never_vocabulary_ids(engine):
    from naiad.llm import images

    media = engine.media.tokenize("a <__media__> b", [(noise_png(1), images.decode(noise_png(1)))])
    ids = [t for t in media.tokens if t < 0]
    assert len(ids) == IMAGE_TOKENS and len(set(ids)) == IMAGE_TOKENS
    assert next(iter(media.spans.values()))[1] == IMAGE_TOKENS


def test_mmproj_parameter_naming_no_file_fails_the_load(tmp_path):
    from naiad.backends.llamacpp.multimodal import mmproj_path
    from naiad.errors import InvalidArgument

    assert mmproj_path({}, tmp_path) is None
    (tmp_path / "mmproj.gguf").write_bytes(b"")
    assert mmproj_path({}, tmp_path) == tmp_path / "mmproj.gguf"
    with pytest.raises(InvalidArgument, match="no file"):
        mmproj_path({"mmproj": "missing.gguf"}, tmp_path)


def test_an_engine_that_speculates_takes_images_and_gives_the_same_text(engine, tmp_path):
    """Prompt lookup on the same model: a request with an image decodes without drafts (its sequence holds the
    image's negative ids, which no drafter may propose) and gives what the engine without speculation gives."""
    from naiad.backends.llamacpp.engine import LlamaEngine
    from naiad.backends.llamacpp.multimodal import Media
    from naiad.backends.llamacpp.params import EngineSettings

    prompt = "<|im_start|>user\nsay <__media__> say <__media__> say<|im_end|>\n<|im_start|>assistant\n"
    plain, _ = run_engine(engine, prompt, noise_png(3), noise_png(3))
    write_llamacpp_vlm(tmp_path)
    settings = EngineSettings(
        n_ctx=256, n_parallel=1, n_threads=1, speculative_ngram=2, speculative_ngram_min=1
    )
    speculating = LlamaEngine(tmp_path / "1" / "model.gguf", settings)
    try:
        assert speculating.speculator is not None
        speculating.media = Media(speculating, tmp_path / "1" / "mmproj.gguf")
        text, _ = run_engine(speculating, prompt, noise_png(3), noise_png(3))
        assert text == plain
        assert speculating.speculator.draft_tokens == 0
    finally:
        speculating.close()
