"""`ferrum pull` / `list` / `run` with model references, against a local stand-in for the
Hugging Face Hub (tests/cli/mock_hub.py) serving the tiny random Llama fixture."""

import json
import os
import pathlib
import signal
import subprocess
import time

import pytest

from mock_hub import Hub, Repo

TINY = pathlib.Path(__file__).resolve().parents[2] / "tests/fixtures/tiny/llama"
FOLDER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "model.safetensors"]


@pytest.fixture
def hub():
    folder = {f: (TINY / f).read_bytes() for f in FOLDER_FILES}
    gguf = (TINY / "model-q8_0.gguf").read_bytes()
    h = Hub({
        "test-org/tiny-llama": Repo(dict(folder, **{"README.md": b"# tiny\n"})),
        "test-org/tiny-llama-GGUF": Repo({"tiny-llama-Q8_0.gguf": gguf, "tiny-llama-F32.gguf": (TINY / "model-f32.gguf").read_bytes()}),
        "test-org/gated": Repo({"tiny-Q8_0.gguf": gguf}, gated_token="sesame"),
        "test-org/corrupt": Repo({"tiny-Q8_0.gguf": gguf}, corrupt=["tiny-Q8_0.gguf"]),
        "test-org/flaky": Repo({"tiny-Q8_0.gguf": gguf}, flaky=["tiny-Q8_0.gguf"]),
        "test-org/stalled": Repo({"tiny-F32.gguf": (TINY / "model-f32.gguf").read_bytes()},
                                 stall=["tiny-F32.gguf"]),
    })
    yield h
    h.close()


def ferrum_cmd(ferrum, env, *args):
    return subprocess.run([ferrum, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def env(hub, tmp_path):
    e = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url)
    e.pop("HF_TOKEN", None)
    return e


def test_pull_list_and_run_offline(ferrum, env, hub):
    r = ferrum_cmd(ferrum, env, "pull", "test-org/tiny-llama-GGUF:Q8_0")
    assert r.returncode == 0, r.stderr
    path = pathlib.Path(r.stderr.strip().split(" is at ")[-1])
    assert path.name == "tiny-llama-Q8_0.gguf" and path.exists()
    assert path.read_bytes() == (TINY / "model-q8_0.gguf").read_bytes()
    # The folder repo: config, tokenizer and weights, not the README.
    r = ferrum_cmd(ferrum, env, "pull", "test-org/tiny-llama")
    assert r.returncode == 0, r.stderr
    folder = pathlib.Path(r.stderr.strip().split(" is at ")[-1])
    assert sorted(p.name for p in folder.iterdir()) == sorted(FOLDER_FILES)
    listing = ferrum_cmd(ferrum, env, "list").stdout
    rows = {line.split()[0]: line.split() for line in listing.splitlines()[1:]}
    gguf_row = rows["test-org/tiny-llama-GGUF:tiny-llama-Q8_0.gguf"]
    assert gguf_row[3:] == ["llama", "Q8_0", "yes"], listing
    assert rows["test-org/tiny-llama"][3] == "llama" and rows["test-org/tiny-llama"][-1] == "yes", listing
    # Offline: the cached models still run and plan, by reference.
    offline = dict(env, HF_ENDPOINT="http://127.0.0.1:9")
    r = ferrum_cmd(ferrum, offline, "run", "test-org/tiny-llama-GGUF:Q8_0", "--raw", "--prompt", "hello",
                   "--max-tokens", "3", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    r = ferrum_cmd(ferrum, offline, "plan", "test-org/tiny-llama", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["fits"], r.stderr
    # A partial download in a repo's blobs marks it incomplete.
    blobs = pathlib.Path(env["HF_HOME"]) / "hub/models--test-org--tiny-llama/blobs"
    (blobs / "0123abcd.incomplete").write_bytes(b"half")
    rows = {l.split()[0]: l.split() for l in ferrum_cmd(ferrum, env, "list").stdout.splitlines()[1:]}
    assert rows["test-org/tiny-llama"][-1] == "no"
    (blobs / "0123abcd.incomplete").unlink()
    # A second pull is served from the cache.
    before = len(hub.ranges)
    assert ferrum_cmd(ferrum, env, "pull", "test-org/tiny-llama-GGUF:Q8_0").returncode == 0
    assert len(hub.ranges) == before


def test_gated_repo_needs_a_token(ferrum, env):
    r = ferrum_cmd(ferrum, env, "pull", "test-org/gated:Q8_0")
    assert r.returncode != 0 and "gated or private" in r.stderr and "HF_TOKEN" in r.stderr, r.stderr
    r = ferrum_cmd(ferrum, dict(env, HF_TOKEN="sesame"), "pull", "test-org/gated:Q8_0")
    assert r.returncode == 0, r.stderr


def test_offline_and_unknown_are_clear_errors(ferrum, env):
    r = ferrum_cmd(ferrum, dict(env, HF_ENDPOINT="http://127.0.0.1:9"), "pull", "test-org/tiny-llama")
    assert r.returncode != 0 and "cannot reach" in r.stderr, r.stderr
    r = ferrum_cmd(ferrum, env, "pull", "test-org/nope")
    assert r.returncode != 0 and "not found" in r.stderr, r.stderr
    r = ferrum_cmd(ferrum, env, "run", "not a model")
    assert r.returncode != 0 and "not a file or folder" in r.stderr, r.stderr


def test_checksum_mismatch_is_refused_and_removed(ferrum, env):
    r = ferrum_cmd(ferrum, env, "pull", "test-org/corrupt:Q8_0")
    assert r.returncode != 0 and "checksum mismatch" in r.stderr, r.stderr
    listing = ferrum_cmd(ferrum, env, "list").stdout
    assert "tiny-Q8_0.gguf" not in listing, listing


def test_interrupted_download_resumes(ferrum, env, hub):
    r = ferrum_cmd(ferrum, env, "pull", "test-org/flaky:Q8_0")
    assert r.returncode == 0, r.stderr
    starts = [s for repo, _, s in hub.ranges if repo == "test-org/flaky"]
    assert starts[0] == 0 and any(s > 0 for s in starts[1:]), starts
    path = pathlib.Path(r.stderr.strip().split(" is at ")[-1])
    assert path.read_bytes() == (TINY / "model-q8_0.gguf").read_bytes()


def listing(ferrum, env):
    out = ferrum_cmd(ferrum, env, "list").stdout
    return {l.split()[0]: l.split() for l in out.splitlines()[1:]}


def test_kill_9_during_pull_then_pull_again(ferrum, env, hub):
    ref = "test-org/stalled:tiny-F32.gguf"
    p = subprocess.Popen([ferrum, "pull", ref], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    blobs = pathlib.Path(env["HF_HOME"]) / "hub/models--test-org--stalled/blobs"
    deadline = time.time() + 30
    def partial():
        return [f for f in blobs.glob("*") if f.suffix in (".part", ".incomplete") and f.stat().st_size > 0]
    while time.time() < deadline and not partial():
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    assert partial(), "the download never started"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    # Nothing half-written passes for a model: not listed as complete, and not runnable.
    rows = listing(ferrum, env)
    assert all(r[-1] == "no" for name, r in rows.items() if name.startswith("test-org/stalled")), rows
    offline = dict(env, HF_ENDPOINT="http://127.0.0.1:9")
    r = ferrum_cmd(ferrum, offline, "run", ref, "--raw", "--prompt", "hi", "--max-tokens", "1")
    assert r.returncode != 0
    # The next pull resumes and verifies.
    hub.repos["test-org/stalled"].stall.clear()
    r = ferrum_cmd(ferrum, env, "pull", ref)
    assert r.returncode == 0, r.stderr
    path = pathlib.Path(r.stderr.strip().split(" is at ")[-1])
    assert path.read_bytes() == (TINY / "model-f32.gguf").read_bytes()
    assert listing(ferrum, env)[ref][-1] == "yes"


def test_a_full_disk_during_pull_is_a_clear_error(ferrum, env, tmp_path):
    # A cache on a tmpfs smaller than the file (this needs root, as CI and the dev machines
    # run; it must not skip).
    small = tmp_path / "small"
    small.mkdir()
    size = (TINY / "model-f32.gguf").stat().st_size
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 2}", "tmpfs", str(small)], check=True)
    try:
        full = dict(env, HF_HOME=str(small / "hf"))
        r = ferrum_cmd(ferrum, full, "pull", "test-org/tiny-llama-GGUF:tiny-llama-F32.gguf")
        assert r.returncode != 0
        assert "space" in r.stderr.lower(), r.stderr
        assert "panicked" not in r.stderr, r.stderr
        rows = listing(ferrum, full)
        assert all(row[-1] == "no" for name, row in rows.items() if name.startswith("test-org")), rows
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_ollama_pull_streams_progress_over_ferrums_pull(ferrum, model, env, hub):
    """Ollama's /api/pull, through the official `ollama` client, downloads with ferrum's own
    pull (the same store, checksums and errors) and streams each file's progress."""
    import socket

    import httpx
    import ollama

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --any-model-name answers any name, but a pull still fetches what is not in the store.
    proc = subprocess.Popen([ferrum, "serve", model, "--port", str(port), "--ctx", "256", "--any-model-name"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        c = ollama.Client(host=base)
        lines = list(c.pull("test-org/tiny-llama-GGUF:Q8_0", stream=True))
        assert lines[0].status == "pulling manifest" and lines[-1].status == "success", lines
        progress = [x for x in lines if x.total]
        size = (TINY / "model-q8_0.gguf").stat().st_size
        assert progress and progress[-1].completed == progress[-1].total == size, progress
        assert [x.completed for x in progress] == sorted(x.completed for x in progress)
        r = ferrum_cmd(ferrum, env, "list")
        assert "test-org/tiny-llama-GGUF:tiny-llama-Q8_0.gguf" in r.stdout, r.stdout
        # Not streamed: one answer; a pull that fails is an error in Ollama's shape.
        assert c.pull("test-org/tiny-llama-GGUF:Q8_0", stream=False).status == "success"
        with pytest.raises(ollama.ResponseError) as e:
            c.pull("test-org/gated", stream=False)
        assert "gated" in e.value.error and e.value.status_code == 500
        with pytest.raises(ollama.ResponseError, match="gated"):
            list(c.pull("test-org/gated", stream=True))
        # A download cut half-way resumes; its progress never passes the file's size.
        lines = list(c.pull("test-org/flaky", stream=True))
        assert lines[-1].status == "success" and all(x.completed <= x.total for x in lines if x.total), lines
        # A client names models, not the server's files.
        with pytest.raises(ollama.ResponseError, match="not a model name"):
            c.pull(model, stream=False)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
