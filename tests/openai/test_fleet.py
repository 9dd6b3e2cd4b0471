"""Several models in one server (issue 48): `ferrum serve --model NAME=PATH ...` on the tiny
random Llama and Qwen3 of tests/fixtures/tiny. Every model is listed loaded or not; a
request naming one loads it; with a memory budget that fits one model at a time, requests
alternating between them all get the answers a server of that model alone gives, none fails,
the process stays under the budget, and /metrics counts the loads; keep_alive 0 unloads; a
model larger than the budget gets a 400 naming both sizes; streams of a loaded model go on
while another loads."""

import concurrent.futures
import json
import os
import signal
import subprocess
import time

import httpx
import openai

from test_security import start

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "..", "fixtures", "tiny")
LLAMA, QWEN = os.path.join(TINY, "llama"), os.path.join(TINY, "qwen3")
PROMPT = "In the spring the river"


def planned(path):
    out = subprocess.run([os.environ["FERRUM_BIN"], "plan", path, "--json", "--ctx", "128",
                          "--concurrency", "4"], capture_output=True, text=True, check=True)
    p = json.loads(out.stdout)
    return int(p["total_with_grammar_bytes"])


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def complete(base, model, max_tokens=10):
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    return c.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                temperature=0).choices[0].text


def rss(proc):
    for line in open(f"/proc/{proc.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(base, name):
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def alone(path):
    proc, base, model = start(path, "--ctx", "128")
    try:
        return complete(base, model)
    finally:
        stop(proc)


def test_two_models_within_a_budget_for_one():
    want = {"llama": alone(LLAMA), "qwen": alone(QWEN)}
    a, b = planned(LLAMA), planned(QWEN)
    budget = max(a, b) + min(a, b) // 2
    proc, base, _ = start(LLAMA, "--ctx", "128", "--model", f"qwen={QWEN}",
                          "--served-model-name", "llama", "--max-memory", str(budget))
    try:
        models = {m["id"]: m for m in httpx.get(base + "/v1/models").json()["data"]}
        assert set(models) == {"llama", "qwen"} and not any(m["loaded"] for m in models.values())
        tags = [m["name"] for m in httpx.get(base + "/api/tags").json()["models"]]
        assert sorted(tags) == ["llama:latest", "qwen:latest"]
        peak = 0
        for name in ["llama", "qwen", "llama", "qwen", "qwen", "llama"]:
            assert complete(base, name) == want[name], name
            peak = max(peak, rss(proc))
            loaded = [m["id"] for m in httpx.get(base + "/v1/models").json()["data"] if m["loaded"]]
            assert loaded == [name], loaded
        assert peak <= budget, f"RSS {peak} over the budget {budget}"
        assert metric(base, "ferrum:model_loads_total") == 5
        assert metric(base, "ferrum:model_unloads_total") == 4
        assert metric(base, "ferrum:model_load_seconds_total") > 0
        # Concurrent requests for both: every one answered, and correctly.
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            jobs = [(n, ex.submit(complete, base, n)) for n in ["llama", "qwen"] * 3]
            for n, f in jobs:
                assert f.result() == want[n], n
        r = httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "llama" in r.text, r.text
    finally:
        stop(proc)


def test_keep_alive_and_sizes():
    a, b = planned(LLAMA), planned(QWEN)
    proc, base, _ = start(LLAMA, "--ctx", "128", "--model", f"qwen={QWEN}",
                          "--served-model-name", "llama", "--max-memory", str(a + b + (1 << 20)))
    try:
        # Both fit: a stream of one goes on while the other loads.
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        stream = c.completions.create(model="llama", prompt=PROMPT, max_tokens=40, temperature=0,
                                      stream=True)
        first = next(iter(stream))
        assert complete(base, "qwen")
        text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream if ch.choices)
        assert text == complete(base, "llama", max_tokens=40)
        ps = [m["name"] for m in httpx.get(base + "/api/ps").json()["models"]]
        assert sorted(ps) == ["llama:latest", "qwen:latest"], ps
        # Ollama's keep_alive 0: unloaded once idle.
        r = httpx.post(base + "/api/generate", json={"model": "qwen", "prompt": "", "keep_alive": 0})
        assert r.status_code == 200, r.text
        for _ in range(100):
            ps = [m["name"] for m in httpx.get(base + "/api/ps").json()["models"]]
            if ps == ["llama:latest"]:
                break
            time.sleep(0.1)
        assert ps == ["llama:latest"], ps
    finally:
        stop(proc)
    # A budget below one model: a 400 naming both sizes.
    proc, base, _ = start(LLAMA, "--ctx", "128", "--model", f"qwen={QWEN}",
                          "--served-model-name", "llama", "--max-memory", str(min(a, b) // 2))
    try:
        r = httpx.post(base + "/v1/completions", json={"model": "qwen", "prompt": "x"})
        assert r.status_code == 400 and "budget" in r.text and "MB" in r.text, r.text
        assert httpx.get(base + "/health").status_code == 200
    finally:
        stop(proc)
