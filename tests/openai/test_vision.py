"""A vision-language model through the server (issue 45): the tiny random Gemma 3 of
tests/fixtures/vision/gemma3_it (scripts/fixtures/make_gemma3_vision_it.py, whose reference.json
holds transformers' processor ids and model.generate's greedy tokens). The official openai and
anthropic clients send images, streamed and not, and get transformers' tokens; a second turn
about the same image reports the image's tokens as cached; every API takes images."""

import base64
import json
import os
import time

import anthropic
import httpx
import pytest

from conftest import API_KEY, Server, start
from test_images import BOMB

HERE = os.path.dirname(__file__)
FIXTURE = os.path.join(HERE, "..", "fixtures", "vision", "gemma3_it")
IMAGES = os.path.join(HERE, "..", "fixtures", "vision", "processor")
REF = json.load(open(os.path.join(FIXTURE, "reference.json")))
CASES = {c["name"]: c for c in REF["cases"]}
PLACEHOLDER = REF["special_ids"]["<image_soft_token>"]


def b64(name):
    with open(os.path.join(IMAGES, name), "rb") as f:
        return base64.b64encode(f.read()).decode()


def openai_messages(case):
    """The case's conversation with OpenAI image_url parts."""
    out = []
    for m in case["messages"]:
        c = m["content"]
        if isinstance(c, list):
            c = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(p["file"])}}
                 if p["type"] == "image" else p for p in c]
        out.append({"role": m["role"], "content": c})
    return out


@pytest.fixture(scope="module")
def vlm():
    proc, base, model = start(os.path.abspath(FIXTURE), "--ctx", "512", "--exact")
    yield Server(proc, base, model)
    proc.terminate()
    proc.wait(timeout=30)


def detok(server, ids):
    r = server.raw("POST", "/detokenize", json={"model": server.model, "tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.mark.parametrize("name", ["one_image", "two_images", "second_turn"])
def test_openai_chat_gets_transformers_tokens(vlm, name):
    case = CASES[name]
    msgs = openai_messages(case)
    # The prompt is transformers' processor's, image placeholders and all.
    r = vlm.raw("POST", "/tokenize", json={"model": vlm.model, "messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == case["input_ids"]
    want = detok(vlm, case["generated"])
    c = vlm.client().chat.completions.create(model=vlm.model, messages=msgs, max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert c.choices[0].message.content == want
    assert c.usage.prompt_tokens == len(case["input_ids"])
    # Streamed: the same text.
    text = ""
    for chunk in vlm.client().chat.completions.create(model=vlm.model, messages=msgs, max_tokens=6,
                                                       temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == want


def test_a_second_turn_finds_the_image_in_the_prefix_cache(vlm):
    first = [{"role": "system", "content": "Be brief, this is a new topic."},
             {"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64("rgb_50x70.png")}},
                 {"type": "text", "text": "What is in this picture?"}]}]
    c1 = vlm.client().chat.completions.create(model=vlm.model, messages=first, max_tokens=4, temperature=0)
    second = first + [{"role": "assistant", "content": c1.choices[0].message.content},
                      {"role": "user", "content": "And now?"}]
    ids = vlm.raw("POST", "/tokenize", json={"model": vlm.model, "messages": second}).json()["tokens"]
    image_end = max(i for i, t in enumerate(ids) if t == PLACEHOLDER) + 1
    c2 = vlm.client().chat.completions.create(model=vlm.model, messages=second, max_tokens=4, temperature=0)
    cached = c2.usage.prompt_tokens_details.cached_tokens
    assert cached >= image_end, (cached, image_end)
    # Another image in the same place is not served from the cache past the text before it.
    other = json.loads(json.dumps(second))
    other[1]["content"][0]["image_url"]["url"] = "data:image/png;base64," + b64("rgb_300x120.png")
    c3 = vlm.client().chat.completions.create(model=vlm.model, messages=other, max_tokens=4, temperature=0)
    first_image = min(i for i, t in enumerate(ids) if t == PLACEHOLDER)
    assert c3.usage.prompt_tokens_details.cached_tokens <= first_image


def test_anthropic_client_sends_an_image(vlm):
    case = CASES["one_image"]
    client = anthropic.Anthropic(base_url=vlm.base, api_key=API_KEY, max_retries=0)
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64("rgb_300x200.png")}},
               {"type": "text", "text": "What is in this picture?"}]
    # anthropic 2.x's create has no sampling arguments: greedy through extra_body.
    greedy = {"temperature": 0}
    r = client.messages.create(model=vlm.model, max_tokens=6, extra_body=greedy,
                               messages=[{"role": "user", "content": content}])
    assert r.usage.input_tokens == len(case["input_ids"])
    assert r.content[0].text == detok(vlm, case["generated"])
    with client.messages.stream(model=vlm.model, max_tokens=6, extra_body=greedy,
                                messages=[{"role": "user", "content": content}]) as s:
        streamed = "".join(s.text_stream)
    assert streamed == r.content[0].text


def test_responses_and_ollama_take_images(vlm):
    case = CASES["one_image"]
    want = detok(vlm, case["generated"])
    r = vlm.client().responses.create(model=vlm.model, max_output_tokens=6, temperature=0, store=False, input=[{
        "role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + b64("rgb_300x200.png")},
            {"type": "input_text", "text": "What is in this picture?"}]}])
    assert r.output_text == want
    assert r.usage.input_tokens == len(case["input_ids"])
    o = vlm.raw("POST", "/api/chat", json={"model": vlm.model, "stream": False, "options": {"num_predict": 6, "temperature": 0},
                                          "messages": [{"role": "user", "content": "What is in this picture?",
                                                        "images": [b64("rgb_300x200.png")]}]})
    assert o.status_code == 200, o.text


def test_hostile_images_to_a_vision_model_are_400s(vlm):
    bomb = base64.b64encode(BOMB).decode()
    for url, needle in [("data:image/png;base64," + bomb, "pixels"),
                        ("data:image/png;base64," + base64.b64encode(b"junk").decode(), "not one of")]:
        t0 = time.time()
        r = vlm.raw("POST", "/v1/chat/completions", json={"model": vlm.model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
        assert time.time() - t0 < 1.0
        assert r.status_code == 400 and needle in r.text, r.text
    # Still serving.
    c = vlm.client().chat.completions.create(model=vlm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert c.choices[0].finish_reason


def test_image_urls_are_fetched_only_when_allowed(vlm):
    """`serve --allow-image-urls`: an http image URL answers as the same image sent inline;
    a missing one, one too slow, and any URL to a server without the flag are 400s."""
    import http.server
    import threading

    class Images(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=IMAGES, **kw)

        def do_GET(self):
            if self.path == "/slow.png":
                time.sleep(3)
            return super().do_GET()

        def log_message(self, *a):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{web.server_address[1]}"
    case = CASES["one_image"]
    want = detok(vlm, case["generated"])

    def ask(server, image_url):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
        return server.raw("POST", "/v1/chat/completions", json={
            "model": server.model, "messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True})

    r = ask(vlm, url + "/rgb_300x200.png")
    assert r.status_code == 400 and "--allow-image-urls" in r.text, r.text
    proc, base, model = start(os.path.abspath(FIXTURE), "--ctx", "512", "--exact",
                              "--allow-image-urls", "--image-url-timeout", "1")
    try:
        fetching = Server(proc, base, model)
        r = ask(fetching, url + "/rgb_300x200.png")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        for path, needle in [("/missing.png", "HTTP 404"), ("/slow.png", "took over 1 s")]:
            t0 = time.time()
            r = ask(fetching, url + path)
            assert r.status_code == 400 and needle in r.text, r.text
            assert time.time() - t0 < 2.5
        # Still serving.
        assert ask(fetching, "data:image/png;base64," + b64("rgb_300x200.png")).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        web.shutdown()


# Qwen2.5-VL and Qwen3-VL (tests/fixtures/vision/{qwen25vl,qwen3vl}_it,
# scripts/fixtures/make_qwen_vl_it.py): each image's placeholders as many as its merged patches,
# M-RoPE positions in the language model, Qwen3-VL's DeepStack rows, Qwen3.5's linear-attention
# state over the image (qwen35vl_it). And Mistral 3
# (tests/fixtures/vision/mistral3_it, scripts/fixtures/make_mistral3_it.py): each image a row of
# [IMG] per row of merged patches, closed by [IMG_BREAK], the last by [IMG_END].
def qwen_fixture(family):
    d = os.path.join(HERE, "..", "fixtures", "vision", family + "_it")
    ref = json.load(open(os.path.join(d, "reference.json")))
    names = ["<|image_pad|>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    image_ids = {ref["special_ids"][n] for n in names if n in ref["special_ids"]}
    return d, {c["name"]: c for c in ref["cases"]}, image_ids


@pytest.fixture(scope="module", params=["qwen25vl", "qwen3vl", "qwen3vlmoe", "qwen35vl", "mistral3"])
def qwen(request):
    d, cases, image_ids = qwen_fixture(request.param)
    proc, base, model = start(os.path.abspath(d), "--ctx", "512", "--exact")
    s = Server(proc, base, model)
    s.cases = cases
    s.image_ids = image_ids
    yield s
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("name", ["one_image", "two_images", "second_turn"])
def test_qwen_vl_chat_gets_transformers_tokens(qwen, name):
    case = qwen.cases[name]
    msgs = openai_messages(case)
    r = qwen.raw("POST", "/tokenize", json={"model": qwen.model, "messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == case["input_ids"]
    want = detok(qwen, case["generated"])
    c = qwen.client().chat.completions.create(model=qwen.model, messages=msgs, max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert c.choices[0].message.content == want
    assert c.usage.prompt_tokens == len(case["input_ids"])
    text = ""
    for chunk in qwen.client().chat.completions.create(model=qwen.model, messages=msgs, max_tokens=6,
                                                        temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == want


def test_qwen_vl_second_turn_finds_the_image_in_the_prefix_cache(qwen):
    # A question long enough that the block holding the image's last token is full before the
    # answer starts (the prefix cache keeps whole blocks; Mistral 3's image ends at token 17).
    first = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64("rgb_300x200.png")}},
        {"type": "text", "text": "What is in this picture? Describe the image in a few words."}]}]
    c1 = qwen.client().chat.completions.create(model=qwen.model, messages=first, max_tokens=4, temperature=0)
    second = first + [{"role": "assistant", "content": c1.choices[0].message.content},
                      {"role": "user", "content": "And now?"}]
    ids = qwen.raw("POST", "/tokenize", json={"model": qwen.model, "messages": second}).json()["tokens"]
    image_end = max(i for i, t in enumerate(ids) if t in qwen.image_ids) + 1
    before = encoded(qwen)
    c2 = qwen.client().chat.completions.create(model=qwen.model, messages=second, max_tokens=4, temperature=0)
    assert c2.usage.prompt_tokens_details.cached_tokens >= image_end
    # The image's keys and values were found: the vision tower did not run again.
    assert encoded(qwen) == before


def encoded(server):
    r = server.raw("GET", "/metrics")
    assert r.status_code == 200, r.text
    line = next(l for l in r.text.splitlines() if l.startswith("ferrum_images_encoded_total"))
    return float(line.split()[-1])
