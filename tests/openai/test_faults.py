"""Faults and hours of load, in short: the soak script for a minute (its ten-minute figures
are in docs/security.md), and `kill -9` in the middle of serving followed by a restart."""

import os
import signal
import subprocess
import sys
import time

import httpx

from conftest import free_port
from test_security import start

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_a_minute_of_soak():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "soak.py"), os.environ["FERRUM_MODEL"],
                        "--bin", os.environ["FERRUM_BIN"], "--clients", "32", "--seconds", "60"],
                       capture_output=True, text=True, timeout=400)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_kill_9_while_serving_then_restart():
    model = os.environ["FERRUM_MODEL"]
    proc, base, name = start(model)
    port = base.rsplit(":", 1)[1]
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
                "model": name, "stream": True, "max_tokens": 200,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and "content" in line:
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The same port, at once: nothing on disk or in the port's state keeps it from coming back.
    proc = subprocess.Popen([os.environ["FERRUM_BIN"], "serve", model, "--port", port],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": name, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        h = httpx.get(base + "/health").json()
        assert h["running"] == 0 and h["waiting"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def vulkan_device():
    """Whether `ferrum devices` lists a Vulkan device; without one the GPU tests skip, unless
    FERRUM_REQUIRE_VULKAN=1 (scripts/test.sh, where it installed lavapipe)."""
    out = subprocess.run([os.environ["FERRUM_BIN"], "devices"], capture_output=True, text=True).stdout
    if "vulkan:0" in out:
        return True
    assert os.environ.get("FERRUM_REQUIRE_VULKAN") != "1", out
    return False


def test_a_failing_gpu_fails_its_requests_and_the_server_stays_up_unhealthy():
    import pytest
    if not vulkan_device():
        pytest.skip("no Vulkan device")
    model = os.environ["FERRUM_MODEL"]
    port = str(free_port())
    # The device "is lost" at its 600th dispatch: after loading, inside the first request
    # (a SmolLM2 pass is ~400 dispatches).
    env = dict(os.environ, FERRUM_VULKAN_FAIL_AFTER="600")
    proc = subprocess.Popen([os.environ["FERRUM_BIN"], "serve", model, "--port", port,
                             "--device", "vulkan", "--ctx", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        name = None
        while time.time() < deadline and name is None:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(base + "/health", timeout=2)
                if r.status_code == 200:
                    name = r.json()["model"]
            except httpx.TransportError:
                time.sleep(0.2)
        assert name, "not healthy"
        r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
            "model": name, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code >= 500, r.text
        # Up, unhealthy, and saying why; later requests get the same answer.
        h = httpx.get(base + "/health", timeout=10)
        assert h.status_code == 503 and "device" in h.text, h.text
        assert httpx.get(base + "/ready", timeout=10).status_code == 503
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": name, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 503 and "device" in r.text, r.text
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        # The engine's thread gives the device back before the process exits (Mesa's exit
        # handlers beside a device's teardown crashed it).
        assert proc.wait(timeout=60) == 0
        assert "did not stop" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
