"""Several ferrum replicas on one machine behind real balancers: HAProxy (Debian's, health
checks on /ready) through a rolling restart under steady load, losing no request; a small
endpoint-picker stand-in of our own that scrapes every replica's /metrics every 50 ms and
routes by prefix, queue and KV usage, sending requests that share a 1k-token prefix to the
replica that holds it; and `vllm-router` (PyPI) in cache-aware mode doing the same."""

import http.server
import json
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from conftest import free_port

MODEL = "replica-model"
PREFIX = ("You are a careful assistant for a river-mill museum. The museum's rules, which every "
          "answer must follow, are these. " + " ".join(
              f"Rule {i}: visitors keep to the marked path near wheel {i} and ask a guide before "
              f"touching the gears of room {i}." for i in range(40)))


class Replica:
    def __init__(self, port, cpu):
        self.port, self.cpu = port, cpu
        self.base = f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self):
        cmd = [os.environ["FERRUM_BIN"], "serve", os.environ["FERRUM_MODEL"], "--port", str(self.port),
               "--ctx", "2048", "--kv-tokens", "8192", "--model-name", MODEL, "--shutdown-grace", "20"]
        # One core each, as a replica per machine would have its own.
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(self.cpu % (os.cpu_count() or 1))] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, f"replica {self.port} exited"
            try:
                if httpx.get(self.base + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"replica {self.port} not ready")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            rc = self.proc.wait(timeout=40)
            assert rc == 0, f"replica {self.port} exited {rc}"

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def replicas():
    rs = [Replica(free_port(), i) for i in range(3)]
    try:
        for r in rs:
            r.start()
        yield rs
    finally:
        for r in rs:
            r.kill()


def ask(base, text, max_tokens=4, stream=False, timeout=60):
    """One chat request; (status, cached prompt tokens) or raises on a broken stream."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}
    if not stream:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout)
        if r.status_code != 200:
            return r.status_code, None
        return 200, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    body.update(stream=True, stream_options={"include_usage": True})
    chunks = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return r.status_code, None
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks and chunks[-1] == "[DONE]", chunks[-2:]
    return 200, json.loads(chunks[-2])["usage"]["prompt_tokens_details"]["cached_tokens"]


# --- HAProxy: a rolling restart loses nothing ------------------------------------------------

def test_rolling_restart_behind_haproxy_loses_no_request(replicas):
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.fail("haproxy is missing: scripts/fetch-test-assets.sh installs it (apt-get, as root)")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="ferrum-haproxy-")
    cfg = os.path.join(tmp, "haproxy.cfg")
    servers = "\n".join(f"    server r{i} 127.0.0.1:{r.port} check inter 100ms fall 1 rise 2"
                        for i, r in enumerate(replicas))
    with open(cfg, "w") as f:
        f.write(f"""global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    # A replica that is draining answers 503 (or, just gone, refuses the connection): try the
    # next one.
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
frontend api
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance leastconn
    option http-buffer-request
    option httpchk GET /ready
    http-check expect status 200
{servers}
""")
    proc = subprocess.Popen([haproxy, "-f", cfg, "-db"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if httpx.get(base + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        stop, results = threading.Event(), []

        def client(k):
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    status, _ = ask(base, f"client {k} request {n}: name a colour.", max_tokens=12,
                                    stream=n % 2 == 0)
                except Exception as e:  # noqa: BLE001 - counted as a loss
                    status = repr(e)
                results.append(status)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        for r in replicas:
            r.stop()          # SIGTERM: readiness drops, running requests finish, exit 0
            r.start()         # the same port, as a new pod behind the same Service would be
            time.sleep(0.5)   # HAProxy sees it ready again (rise 2 at 100 ms)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        lost = [s for s in results if s != 200]
        print(f"rolling restart of {len(replicas)} replicas: {len(results)} requests, {len(lost)} lost")
        assert len(results) > 20 and not lost, lost[:5]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


# --- an endpoint picker of our own: metrics every 50 ms, prefix-affine -----------------------

class Picker:
    """What the inference gateway's endpoint picker does, in little: scrape each replica's
    vLLM metrics every 50 ms, drop a replica whose metrics are older than 200 ms, send a
    request whose prompt starts like an earlier one to the replica that served that one, and
    the rest to the replica with the shortest queue and the emptiest KV cache."""

    def __init__(self, replicas):
        self.replicas = replicas
        self.metrics = {r.base: (0.0, {}) for r in replicas}
        self.prefixes = {}
        self.stop = threading.Event()
        self.scraper = threading.Thread(target=self.scrape, daemon=True)
        self.scraper.start()

    def scrape(self):
        from prometheus_client.parser import text_string_to_metric_families
        with httpx.Client(timeout=1) as h:
            while not self.stop.is_set():
                for r in self.replicas:
                    try:
                        text = h.get(r.base + "/metrics").text
                        vals = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
                        self.metrics[r.base] = (time.time(), vals)
                    except httpx.HTTPError:
                        pass
                time.sleep(0.05)

    def pick(self, prompt):
        now = time.time()
        fresh = [b for b, (t, _) in self.metrics.items() if now - t < 0.2]
        key = prompt[:1000]
        if key in self.prefixes and self.prefixes[key] in fresh:
            return self.prefixes[key]
        def load(b):
            m = self.metrics[b][1]
            return (m.get("vllm:num_requests_waiting", 0) + m.get("vllm:num_requests_running", 0),
                    m.get("vllm:kv_cache_usage_perc", 0))
        best = min(fresh, key=load)
        self.prefixes[key] = best
        return best


def test_our_picker_routes_a_shared_prefix_to_the_replica_holding_it(replicas):
    picker = Picker(replicas)
    try:
        time.sleep(0.3)
        served = []
        for k in range(6):
            text = PREFIX + f"\n\nQuestion {k}: may I touch wheel {k}?"
            target = picker.pick(text)
            status, cached = ask(target, text)
            assert status == 200
            served.append((target, cached))
        prompt_tokens = len(httpx.post(replicas[0].base + "/tokenize",
                                       json={"model": MODEL, "prompt": PREFIX}, timeout=10).json()["tokens"])
        assert prompt_tokens >= 900, prompt_tokens
        assert len({t for t, _ in served}) == 1, served
        # Every request after the first found the prefix in that replica's cache.
        assert all(c >= prompt_tokens - 32 for _, c in served[1:]), (prompt_tokens, served)
    finally:
        picker.stop.set()


# --- vllm-router, cache-aware ------------------------------------------------------------------

def test_vllm_router_cache_aware_keeps_a_prefix_on_one_replica(replicas):
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if not os.path.exists(exe):
        exe = shutil.which("vllm-router")
    assert exe, "vllm-router is missing: scripts/fetch-test-assets.sh installs it in the venv"
    port = free_port()
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                             "--worker-urls", *[r.base for r in replicas],
                             "--worker-startup-timeout-secs", "30", "--prometheus-port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 40
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "vllm-router did not come up"
            time.sleep(0.2)
        cached = []
        for k in range(5):
            status, c = ask(base, PREFIX + f"\n\nQuestion {k} for the router: is room {k} open?")
            assert status == 200
            cached.append(c)
        # After the first, each request went where the prefix was (most of it cached).
        assert all(c >= 800 for c in cached[1:]), cached
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
