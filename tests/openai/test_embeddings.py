"""Embedding and reranking models through the official `openai` client and raw HTTP:
all-MiniLM-L6-v2 (fetched by scripts/fetch-test-assets.sh) against sentence-transformers'
embeddings (tests/fixtures/minilm/reference.json), the tiny cross-encoder fixture
(tests/fixtures/encoders/bert_cross) against CrossEncoder's scores, and a chat model's
embedding requests without --embeddings-from-chat-model."""

import base64
import json
import math
import os
import pathlib
import struct

import pytest

from conftest import API_KEY, Server, start

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def minilm_dir():
    d = os.environ.get("FERRUM_MINILM_DIR") or os.path.join(
        os.environ.get("FERRUM_CACHE", os.path.expanduser("~/.cache/ferrum")), "all-minilm-l6-v2")
    assert os.path.isfile(os.path.join(d, "model.safetensors")), f"{d}: run scripts/fetch-test-assets.sh"
    return d


@pytest.fixture(scope="module")
def embedder():
    proc, base, model = start(minilm_dir(), "--api-key", API_KEY)
    yield Server(proc, base, model)
    proc.kill()


@pytest.fixture(scope="module")
def reranker():
    proc, base, model = start(str(FIXTURES / "encoders" / "bert_cross"), "--api-key", API_KEY)
    yield Server(proc, base, model)
    proc.kill()


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_match_sentence_transformers(embedder):
    ref = json.loads((FIXTURES / "minilm" / "reference.json").read_text())
    c = embedder.client()
    inputs = ref["sentences"][:16]
    r = c.embeddings.create(model=embedder.model, input=inputs)
    assert [d.index for d in r.data] == list(range(len(inputs)))
    for d, want in zip(r.data, ref["embeddings"]):
        assert len(d.embedding) == 384
        assert cosine(d.embedding, want) >= 0.999
    assert r.usage.prompt_tokens == sum(len(i) for i in ref["ids"][:16])
    # The client asks for base64 by default; floats are the same numbers.
    f = c.embeddings.create(model=embedder.model, input=inputs[:2], encoding_format="float")
    assert [d.embedding for d in f.data] == [d.embedding for d in r.data[:2]]
    raw = embedder.raw("POST", "/v1/embeddings", json={"model": embedder.model, "input": inputs[0],
                                                        "encoding_format": "base64"}).json()
    b = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(b) // 4}f", b)) == f.data[0].embedding
    # Token ids in, the same vector out.
    by_ids = c.embeddings.create(model=embedder.model, input=[ref["ids"][0]], encoding_format="float")
    assert by_ids.data[0].embedding == f.data[0].embedding


def test_dimensions_cut_and_renormalise(embedder):
    c = embedder.client()
    full = c.embeddings.create(model=embedder.model, input="a cat on a mat", encoding_format="float").data[0].embedding
    cut = c.embeddings.create(model=embedder.model, input="a cat on a mat", dimensions=64,
                              encoding_format="float").data[0].embedding
    assert len(cut) == 64
    assert math.isclose(sum(x * x for x in cut), 1.0, rel_tol=1e-5)
    norm = math.sqrt(sum(x * x for x in full[:64]))
    assert max(abs(a - b / norm) for a, b in zip(cut, full[:64])) < 1e-6
    for bad in (0, 385):
        r = embedder.raw("POST", "/v1/embeddings", json={"model": embedder.model, "input": "x", "dimensions": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_over_length_is_refused_or_truncated(embedder):
    long = "word " * 600
    r = embedder.raw("POST", "/v1/embeddings", json={"model": embedder.model, "input": long})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "602 tokens" in msg and "256" in msg, msg
    ok = embedder.raw("POST", "/v1/embeddings", json={"model": embedder.model, "input": long,
                                                       "truncate_prompt_tokens": -1}).json()
    assert ok["usage"]["prompt_tokens"] == 256
    ten = embedder.raw("POST", "/v1/embeddings", json={"model": embedder.model, "input": long,
                                                        "truncate_prompt_tokens": 10}).json()
    assert ten["usage"]["prompt_tokens"] == 10


def test_an_embedder_does_not_chat_or_rerank(embedder):
    r = embedder.raw("POST", "/v1/chat/completions",
                     json={"model": embedder.model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    r = embedder.raw("POST", "/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]


def test_many_concurrent_requests_get_their_own_vectors(embedder):
    import concurrent.futures
    ref = json.loads((FIXTURES / "minilm" / "reference.json").read_text())
    c = embedder.client()

    def one(i):
        return c.embeddings.create(model=embedder.model, input=ref["sentences"][i], encoding_format="float").data[0].embedding

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(32)))
    for g, want in zip(got, ref["embeddings"]):
        assert cosine(g, want) >= 0.999


def test_rerank_orders_as_the_cross_encoder(reranker):
    ref = json.loads((FIXTURES / "encoders" / "bert_cross" / "reference.json").read_text())
    query = ref["pairs"][0][0]
    docs = [d for q, d in ref["pairs"] if q == query]
    want = [s for (q, _), s in zip(ref["pairs"], ref["crossencoder_predict"]) if q == query]
    r = reranker.raw("POST", "/v1/rerank", json={"model": reranker.model, "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        # The default path multiplies in 8 bits: scores within a few thousandths.
        assert math.isclose(x["relevance_score"], want[x["index"]], abs_tol=5e-3)
        assert x["document"]["text"] == docs[x["index"]]
    assert body["usage"]["total_tokens"] > 0
    top = reranker.raw("POST", "/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                                 "top_n": 1, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == order[:1] and "document" not in top["results"][0]
    s = reranker.raw("POST", "/v1/score", json={"model": reranker.model, "text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in s["data"]] == list(range(len(docs)))
    assert all(math.isclose(d["score"], w, abs_tol=5e-3) for d, w in zip(s["data"], want))
    # A reranker makes no embeddings.
    e = reranker.raw("POST", "/v1/embeddings", json={"model": reranker.model, "input": "x"})
    assert e.status_code == 400 and "reranker" in e.json()["error"]["message"]


@pytest.mark.parametrize("path", ["nomic_mean", "nomic_hf", "modernbert_mean", "embeddinggemma",
                                  "nomic_mean.gguf", "modernbert_mean.gguf"])
def test_rotary_encoders_embed_as_their_references(path):
    """NomicBERT, ModernBERT and EmbeddingGemma (tests/fixtures/encoders, their generating
    scripts beside them) served from their folders and from llama.cpp's GGUFs: the client's
    vectors against sentence-transformers' (folders) or llama.cpp's (GGUF files)."""
    ref_path = FIXTURES / "encoders" / (path.replace(".gguf", ".llamacpp.json") if path.endswith(".gguf")
                                        else f"{path}/reference.json")
    ref = json.loads(ref_path.read_text())
    proc, base, model = start(str(FIXTURES / "encoders" / path), "--api-key", API_KEY)
    try:
        c = Server(proc, base, model).client()
        r = c.embeddings.create(model=model, input=ref["inputs"])
        for d, want in zip(r.data, ref["embeddings"]):
            assert len(d.embedding) == len(want)
            assert cosine(d.embedding, want) >= 0.999
        assert r.usage.prompt_tokens == sum(len(i) for i in ref["ids"])
        half = len(ref["embeddings"][0]) // 2
        cut = c.embeddings.create(model=model, input=ref["inputs"][0], dimensions=half, encoding_format="float")
        assert len(cut.data[0].embedding) == half
    finally:
        proc.kill()


def test_modernbert_reranker_orders_as_transformers():
    """ModernBertForSequenceClassification with mean pooling (gte-reranker-modernbert-base's
    shape): /v1/rerank's order and scores against transformers' logits."""
    ref = json.loads((FIXTURES / "encoders" / "modernbert_cross" / "reference.json").read_text())
    query = ref["pairs"][0][0]
    docs = [d for q, d in ref["pairs"] if q == query]
    want = [1 / (1 + math.exp(-l[0])) for (q, _), l in zip(ref["pairs"], ref["logits"]) if q == query]
    # The exact path: the two documents' scores are 0.008 apart.
    proc, base, model = start(str(FIXTURES / "encoders" / "modernbert_cross"), "--api-key", API_KEY,
                              "--exact")
    try:
        srv = Server(proc, base, model)
        r = srv.raw("POST", "/v1/rerank", json={"model": model, "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        order = sorted(range(len(docs)), key=lambda i: -want[i])
        got = r.json()["results"]
        assert [x["index"] for x in got] == order
        assert all(math.isclose(x["relevance_score"], want[x["index"]], abs_tol=1e-4) for x in got)
    finally:
        proc.kill()


def test_a_chat_model_needs_the_flag_for_embeddings():
    proc, base, model = start(os.environ["FERRUM_MODEL"], "--api-key", API_KEY, "--ctx", "256",
                              "--kv-tokens", "512")
    try:
        s = Server(proc, base, model)
        r = s.raw("POST", "/v1/embeddings", json={"model": model, "input": "hello"})
        assert r.status_code == 400
        assert "--embeddings-from-chat-model" in r.json()["error"]["message"]
    finally:
        proc.kill()


@pytest.mark.parametrize("path", ["qwen3_rerank", "qwen3_rerank.gguf"])
def test_a_decoder_reranker_scores_as_transformers(path):
    """Qwen3-Reranker's yes/no scoring (tests/fixtures/encoders/qwen3_rerank, its Hugging Face
    folder and llama.cpp's rank GGUF of it) through /v1/rerank: each pair is the model's own
    prompt, scored by the softmax of the "yes" and "no" logits at its last token."""
    ref = json.loads((FIXTURES / "encoders" / "qwen3_rerank" / "reference.json").read_text())
    proc, base, model = start(str(FIXTURES / "encoders" / path), "--api-key", API_KEY)
    try:
        s = Server(proc, base, model)
        default = ref["default_instruction"]
        query = ref["pairs"][0]["query"]
        picked = [i for i, p in enumerate(ref["pairs"]) if p["query"] == query and p["instruction"] == default]
        docs = [ref["pairs"][i]["document"] for i in picked]
        want = [ref["scores"][i] for i in picked]
        r = s.raw("POST", "/v1/rerank", json={"model": model, "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == sorted(range(len(docs)), key=lambda i: -want[i])
        for x in body["results"]:
            # The default path's 8-bit activations and f16 KV cache: a few thousandths.
            assert math.isclose(x["relevance_score"], want[x["index"]], abs_tol=1e-2)
        e = s.raw("POST", "/v1/embeddings", json={"model": model, "input": "x"})
        assert e.status_code == 400 and "reranker" in e.json()["error"]["message"]
        c = s.raw("POST", "/v1/chat/completions",
                  json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert c.status_code == 400
    finally:
        proc.kill()
