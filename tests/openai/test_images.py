"""Image input through every API, against a model without vision (SmolLM2): each image is
read and checked (format, size from the header, count, where it may appear) and then refused
because the model has no vision encoder; hostile images get a 400 naming the problem within a
second, and the server goes on with its RSS flat (issue 45)."""

import base64
import os
import struct
import time
import zlib

import anthropic
import httpx
import openai
import pytest

from conftest import API_KEY


def png(w, h, body=None):
    """A PNG of `w` x `h` 8-bit RGB pixels: real rows of zeros when small, else only the
    header and a few compressed bytes (a decompression bomb's shape)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    if body is None:
        body = zlib.compress(b"".join(b"\x00" + b"\x7f" * (3 * w) for _ in range(h)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def data_url(data, media="image/png"):
    return f"data:{media};base64," + base64.b64encode(data).decode()


GOOD = png(8, 6)
BOMB = png(100_000, 100_000, zlib.compress(b"\x00" * 1000))


def chat(server, parts, **kw):
    return server.client().chat.completions.create(
        model=server.model, max_tokens=4, messages=[{"role": "user", "content": parts}], **kw)


def refused(server, parts):
    t0 = time.time()
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, parts)
    assert time.time() - t0 < 1.0
    return str(e.value)


def test_a_good_image_to_a_text_model_is_refused_by_name(server):
    msg = refused(server, [{"type": "text", "text": "What is this?"},
                           {"type": "image_url", "image_url": {"url": data_url(GOOD), "detail": "low"}}])
    assert "does not take images" in msg and "vision" in msg


@pytest.mark.parametrize("url,needle", [
    (data_url(BOMB), "100000 x 100000 pixels"),
    (data_url(b"this is no image"), "not one of PNG, JPEG, WebP and GIF"),
    (data_url(GOOD[:40]), "could not be decoded"),
    (data_url(GOOD, "text/plain"), "not an image"),
    ("data:image/png;base64,%%%%", "base64"),
    ("https://example.com/cat.png", "not fetched"),
])
def test_bad_images_get_a_400_naming_the_problem(server, url, needle):
    msg = refused(server, [{"type": "image_url", "image_url": {"url": url}}])
    assert needle in msg, msg


def test_detail_and_count_are_checked(server):
    msg = refused(server, [{"type": "image_url", "image_url": {"url": data_url(GOOD), "detail": "ultra"}}])
    assert "detail" in msg
    msg = refused(server, [{"type": "image_url", "image_url": {"url": data_url(GOOD)}}] * 17)
    assert "more than 16 images" in msg


def test_bombs_leave_the_server_serving_with_rss_flat(server):
    def rss():
        with open(f"/proc/{server.proc.pid}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
    chat(server, "warm up")
    before = rss()
    for _ in range(20):
        refused(server, [{"type": "image_url", "image_url": {"url": data_url(BOMB)}}])
    assert rss() - before < 20_000  # kB
    r = chat(server, "Say hi.")
    assert r.choices[0].message.content is not None


def test_anthropic_image_blocks(server):
    client = anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(GOOD).decode()}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=server.model, max_tokens=4,
                               messages=[{"role": "user", "content": [block, {"type": "text", "text": "?"}]}])
    assert "does not take images" in str(e.value)
    bomb = dict(block, source=dict(block["source"], data=base64.b64encode(BOMB).decode()))
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=server.model, max_tokens=4, messages=[{"role": "user", "content": [bomb]}])
    assert "pixels" in str(e.value)
    bad_type = dict(block, source=dict(block["source"], media_type="image/tiff"))
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=server.model, max_tokens=4, messages=[{"role": "user", "content": [bad_type]}])
    assert "media_type" in str(e.value)


def test_responses_input_image(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model=server.model, max_output_tokens=4, store=False, input=[{
            "role": "user", "content": [{"type": "input_text", "text": "?"},
                                        {"type": "input_image", "image_url": data_url(GOOD), "detail": "auto"}]}])
    assert "does not take images" in str(e.value)


def test_ollama_images(server):
    b64 = base64.b64encode(GOOD).decode()
    r = server.raw("POST", "/api/chat", json={"model": server.model, "stream": False, "messages": [
        {"role": "user", "content": "?", "images": [b64]}]})
    assert r.status_code == 400 and "does not take images" in r.text, r.text
    r = server.raw("POST", "/api/generate", json={"model": server.model, "stream": False, "prompt": "?",
                                                   "images": [base64.b64encode(b"junk").decode()]})
    assert r.status_code == 400 and "not one of PNG" in r.text, r.text


def test_tokenize_checks_images_too(server):
    r = server.raw("POST", "/tokenize", json={"model": server.model, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(BOMB)}}]}]})
    assert r.status_code == 400 and "pixels" in r.text, r.text
