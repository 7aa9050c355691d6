"""all-MiniLM-L6-v2, a real sentence-transformers folder, served by `backend: "transformers"` on /v1/embeddings:
the same vectors as sentence-transformers computes, similar words closer than unrelated ones, base64 output, and
clear errors for what the model cannot do."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import requests
from helpers import NaiadProcess
from real_models import link_version, minilm_folder

openai = pytest.importorskip("openai")
pytest.importorskip("transformers", reason="the transformers backend's dependency (the `transformers` extra)")

TEXTS = ["cat", "kitten", "stocks fell sharply today", "A man is eating food."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("embed_repo")
    link_version(repo, "minilm", minilm_folder(), 'backend: "transformers"\n')
    with NaiadProcess(repo, "--allow-grpc", "false", timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_folder()), device="cpu").encode(TEXTS, convert_to_numpy=True)


def test_the_vectors_are_sentence_transformers_own(client, reference):
    got = client.embeddings.create(model="minilm", input=TEXTS)
    vectors = np.array([d.embedding for d in got.data])
    assert vectors.shape == (4, 384)
    np.testing.assert_allclose(vectors, reference, atol=1e-4)
    assert got.usage.prompt_tokens > 4  # [CLS] and [SEP] around each input
    cos = vectors @ vectors.T  # (normalised, as the folder's Normalize module says)
    assert cos[0, 1] > cos[0, 2] + 0.3  # cat is nearer kitten than stocks


def test_base64_output_and_token_input(client, reference, server):
    got = client.embeddings.create(model="minilm", input="cat", encoding_format="base64")
    data = got.data[0].embedding
    vector = (
        np.frombuffer(base64.b64decode(data), dtype=np.float32) if isinstance(data, str) else np.array(data)
    )
    np.testing.assert_allclose(vector, reference[0], atol=1e-4)
    ids = [101, 4937, 102]  # [CLS] cat [SEP] in its WordPiece vocabulary
    body = {"model": "minilm", "input": ids}
    answer = requests.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
    np.testing.assert_allclose(answer["data"][0]["embedding"], reference[0], atol=1e-4)


def test_what_the_model_cannot_do_is_a_clear_400(server):
    def post(path, body):
        r = requests.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "matryoshka" in post("/v1/embeddings", {"model": "minilm", "input": "cat", "dimensions": 8})
    assert "maximum context length is 256" in post(
        "/v1/embeddings", {"model": "minilm", "input": "word " * 300}
    )
    body = {"model": "minilm", "prompt": "Hello", "max_tokens": 4}
    assert "embedding model" in post("/v1/completions", body)
    assert "vocabulary" in post("/v1/embeddings", {"model": "minilm", "input": [10**9]})


def test_score_and_rerank_order_documents_as_cosine_similarity_does(server, reference):
    docs = ["kitten", "stocks fell sharply today", "A man is eating food."]
    cosine = reference[1:] @ reference[0]  # (normalised vectors) against "cat"
    r = requests.post(
        f"{server.url}/v1/score", json={"model": "minilm", "text_1": "cat", "text_2": docs}, timeout=60
    )
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], cosine, atol=1e-4)
    body = {"model": "minilm", "query": "cat", "documents": docs, "top_n": 2}
    r = requests.post(f"{server.url}/v1/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(-cosine)[:2])
    assert results[0]["document"]["text"] == "kitten"
    np.testing.assert_allclose([x["relevance_score"] for x in results], np.sort(cosine)[::-1][:2], atol=1e-4)
    body = {
        "model": "minilm",
        "query": "cat",
        "documents": [{"text": d} for d in docs],
        "return_documents": False,
    }
    assert "document" not in requests.post(f"{server.url}/rerank", json=body, timeout=60).json()["results"][0]
    bad = requests.post(
        f"{server.url}/v1/rerank", json={"model": "minilm", "query": "cat", "documents": []}, timeout=60
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
