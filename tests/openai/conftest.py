"""Starts the real `ferrum serve` on SmolLM2 for the suite and hands out an `openai` client.

Run by `cargo test` (crates/ferrum-cli/tests/openai_client.rs), which sets FERRUM_BIN to the
freshly built binary and FERRUM_MODEL to the default model; by hand:
    FERRUM_BIN=target/release/ferrum FERRUM_MODEL=path/to.gguf python -m pytest tests/openai
FERRUM_SERVE_ARGS adds arguments to the server's command line (`--device vulkan` for the
GPU backend's run of the suite).
"""

import os
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import openai
import pytest

API_KEY = "test-key"
CTX = 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served(subprocess.Popen):
    """A process whose output (stdout and stderr) goes to a file, read back by `output()` or
    `communicate()`. A pipe that nobody reads until the end fills at 64 KiB of log lines, and
    then the server's next log line blocks the thread writing it: a long suite hung so."""

    def __init__(self, args, **kw):
        self.log = tempfile.TemporaryFile(mode="w+")
        super().__init__(args, stdout=self.log, stderr=subprocess.STDOUT, text=True, **kw)

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def communicate(self, input=None, timeout=None):
        self.wait(timeout)
        return self.output(), None


def start(model, *args):
    """A `ferrum serve` of its own for `model` with `args`, once healthy: (process, base URL,
    the model's id)."""
    port = free_port()
    proc = Served([os.environ["FERRUM_BIN"], "serve", model, "--port", str(port), *args])
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, proc.output()
        try:
            r = httpx.get(base + "/health", timeout=2)
            if r.status_code == 200:
                return proc, base, r.json()["model"]
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("not healthy")


class Server:
    def __init__(self, proc, base, model):
        self.proc, self.base, self.model = proc, base, model

    def client(self, **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def raw(self, method, path, **kw):
        headers = kw.pop("headers", {"Authorization": f"Bearer {API_KEY}"})
        return httpx.request(method, self.base + path, headers=headers, timeout=60, **kw)


@pytest.fixture(scope="session")
def server():
    binary = os.environ["FERRUM_BIN"]
    model = os.environ["FERRUM_MODEL"]
    port = free_port()
    proc = Served(
        [binary, "serve", model, "--port", str(port), "--api-key", API_KEY,
         "--ctx", str(CTX), "--kv-tokens", "8192", "--embeddings-from-chat-model",
         *os.environ.get("FERRUM_SERVE_ARGS", "").split()],
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    model_id = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ferrum serve exited early:\n{proc.output()}")
        try:
            r = httpx.get(base + "/health", timeout=2)
            if r.status_code == 200:
                model_id = r.json()["model"]
                break
            assert r.status_code == 503, r.text  # loading
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    if model_id is None:
        proc.kill()
        raise RuntimeError("ferrum serve did not become healthy")
    yield Server(proc, base, model_id)
    # Graceful shutdown on SIGTERM: running requests finish, then exit 0.
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
