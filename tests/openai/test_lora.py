"""LoRA adapters through the real server (issue 48), on the tiny random Llama of
tests/fixtures/tiny with the random PEFT adapters of tests/fixtures/lora
(scripts/fixtures/make_lora_adapters.py): adapters given with `--lora NAME=PATH` (a PEFT folder
and a llama.cpp GGUF LoRA) and loaded at run time with vLLM's `/v1/load_lora_adapter`; each
answers to its name in `model`, listed in /v1/models with the base model as `parent`;
requests for the base model and several adapters at once get the answers they get alone;
`vllm:lora_requests_info` reports the limit; bad adapters and unknown names get 4xx."""

import concurrent.futures
import os
import signal

import httpx
import openai
import pytest

from test_security import start

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "..", "fixtures", "tiny", "llama")
LORA = os.path.join(HERE, "..", "fixtures", "lora")
PROMPT = "In the spring the river"


@pytest.fixture(scope="module")
def srv():
    proc, base, model = start(
        TINY, "--ctx", "128",
        "--lora", f"attn={os.path.join(LORA, 'llama-attn-r4')}",
        "--lora", f"all={os.path.join(LORA, 'llama-all-r8', 'adapter-f32.gguf')}",
        "--max-loras", "3")
    yield base, model
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def complete(base, model, stream=False):
    c = client(base)
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    if not stream:
        return c.completions.create(**kw).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)


def test_models_lists_adapters_with_their_parent(srv):
    base, model = srv
    data = {m.id: m for m in client(base).models.list().data}
    assert set(data) == {model, "attn", "all"}
    for name in ("attn", "all"):
        assert data[name].model_extra["parent"] == model
    assert client(base).models.retrieve("attn").model_extra["parent"] == model


def test_each_adapter_answers_as_itself_alone_and_together(srv):
    base, model = srv
    names = [model, "attn", "all"]
    alone = {n: complete(base, n) for n in names}
    assert len(set(alone.values())) == 3, alone
    assert complete(base, "attn", stream=True) == alone["attn"]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        jobs = [(n, ex.submit(complete, base, n)) for n in names * 2]
        for n, f in jobs:
            assert f.result() == alone[n], n


def test_load_and_unload_at_run_time(srv):
    base, model = srv
    mlp = os.path.join(LORA, "llama-mlp-r16-rslora")
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": mlp})
    assert r.status_code == 200, r.text
    answer = complete(base, "mlp")
    assert answer not in (complete(base, model), complete(base, "attn"))
    # A name taken, the limit reached (three attached), a bad path, the base model's name.
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": mlp})
    assert r.status_code == 400 and "already" in r.text, r.text
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": mlp})
    assert r.status_code == 400 and "max-loras" in r.text, r.text
    r = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(base, "mlp")
    r = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 404, r.text
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
    assert r.status_code == 400, r.text
    qwen = os.path.join(LORA, "qwen3-all-r16")
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "qwen", "lora_path": qwen})
    assert r.status_code == 400 and "projection" in r.text, r.text
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": model, "lora_path": mlp})
    assert r.status_code == 400, r.text
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 400 and "lora_path" in r.text, r.text
    # Loaded again under the same name after the unload: the same answer.
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": mlp})
    assert r.status_code == 200, r.text
    assert complete(base, "mlp") == answer
    assert httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200


def test_metrics_report_the_adapters(srv):
    base, _ = srv
    text = httpx.get(base + "/metrics").text
    line = next(l for l in text.splitlines() if l.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="3"' in line, line


def test_rank_limit():
    proc, base, _ = start(TINY, "--ctx", "64", "--max-lora-rank", "4")
    try:
        ok = httpx.post(base + "/v1/load_lora_adapter",
                        json={"lora_name": "r4", "lora_path": os.path.join(LORA, "llama-attn-r4")})
        assert ok.status_code == 200, ok.text
        r = httpx.post(base + "/v1/load_lora_adapter",
                       json={"lora_name": "r8", "lora_path": os.path.join(LORA, "llama-all-r8")})
        assert r.status_code == 400 and "max-lora-rank" in r.text, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
