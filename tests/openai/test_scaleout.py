"""ferrum as a replica behind a router: the model-server metrics contract the Kubernetes
inference gateway's endpoint picker and llm-d's router read (parsed by `prometheus_client`'s
parser), metrics that answer while the engine keeps both cores busy, and the lifecycle a
rolling restart needs (readiness drops at SIGTERM, running streams finish, new requests get
503, exit 0 within the grace period)."""

import os
import signal
import threading
import time

import httpx
import pytest

from conftest import API_KEY
from test_security import start

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def families(text):
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_metrics_contract(server):
    r = server.raw("GET", "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    # One HELP/TYPE per name: the parser would merge repeats silently, so count them here.
    names = [l.split()[2] for l in r.text.splitlines() if l.startswith("# TYPE ")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    fams = families(r.text)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "vllm:lora_requests_info"):
        assert name in fams, name
        assert len(fams[name].samples) == 1, (name, fams[name].samples)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert fams[name].samples[0].value >= 0
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert 0.0 <= fams[name].samples[0].value <= 1.0
    cache = fams["vllm:cache_config_info"].samples[0]
    assert int(cache.labels["block_size"]) > 0 and int(cache.labels["num_gpu_blocks"]) > 0, cache
    lora = fams["vllm:lora_requests_info"].samples[0]
    assert set(lora.labels) >= {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}, lora
    assert lora.labels["running_lora_adapters"] == "" and lora.value > 1.7e9, lora  # a Unix time
    # Prefix-cache counters in tokens, as vLLM's: a repeated 200-token prompt hits.
    def counter(fams, name):
        return next(s.value for s in fams[name].samples if s.name == name + "_total")
    before = {n: counter(fams, n) for n in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")}
    prompt = "The river runs past the mill and under the old bridge. " * 18
    for _ in range(2):
        c = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=1)
    fams = families(server.raw("GET", "/metrics").text)
    queried = counter(fams, "vllm:prefix_cache_queries") - before["vllm:prefix_cache_queries"]
    hit = counter(fams, "vllm:prefix_cache_hits") - before["vllm:prefix_cache_hits"]
    assert queried >= 2 * (c.usage.prompt_tokens - 1), (queried, c.usage)
    assert hit >= c.usage.prompt_tokens - 2 * 16, (hit, c.usage)


def test_metrics_answer_while_every_core_decodes(server):
    stop = threading.Event()
    errors = []

    def client(k):
        c = server.client()
        n = 0
        while not stop.is_set():
            n += 1
            # Half the clients send long new prompts (prefill: long matmuls on every core), half
            # stream answers (decode steps back to back).
            text = (f"{k} {n} " + "the mill by the river turns all day long, " * 80) if k % 2 else "Tell a long story."
            try:
                for _ in c.chat.completions.create(model=server.model, max_tokens=64, stream=True,
                                                   messages=[{"role": "user", "content": text}]):
                    if stop.is_set():
                        break
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    times = []
    with httpx.Client(base_url=server.base, timeout=5) as h:
        # 12 s of polls every 50 ms: ~220 samples, so the p99 is the third-worst poll. With 6 s
        # it was the second-worst: on a Zen 5 VM every run had one 130-170 ms poll about 3.5 s
        # after the clients start (older builds too; cause not found), and one more slow poll
        # failed the test.
        t_end = time.time() + 12
        while time.time() < t_end:
            t0 = time.perf_counter()
            assert h.get("/metrics").status_code == 200
            times.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    times.sort()
    p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
    print(f"/metrics under 3 prefilling and 3 streaming clients: {len(times)} polls, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
          f"max {times[-1]:.1f} ms")
    # The endpoint picker scrapes every 50 ms (and takes metrics older than 200 ms for a
    # saturated replica).
    assert p99 <= 50, (p50, p99)


def test_sigterm_drains_then_exits():
    proc, base, model = start(os.environ["FERRUM_MODEL"], "--ctx", "1024", "--shutdown-grace", "30")
    try:
        chunks, done = [], threading.Event()

        def stream():
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
                    "model": model, "max_tokens": 200, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Count to a thousand."}]}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
            done.set()

        t = threading.Thread(target=stream)
        t.start()
        while len(chunks) < 3:
            assert proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert not done.is_set(), "the stream should still be running"
        assert httpx.get(base + "/ready", timeout=5).status_code == 503
        assert httpx.get(base + "/live", timeout=5).status_code == 200
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        r = httpx.post(base + "/v1/chat/completions", timeout=5, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        assert "shutting down" in r.json()["error"]["message"]
        t.join(timeout=60)
        assert done.is_set()
        assert chunks[-1] == "[DONE]", chunks[-3:]
        import json
        usage = json.loads(chunks[-2])["usage"]
        assert usage["completion_tokens"] == 200, usage
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kv_events_announce_every_block_and_match_the_cache():
    """A pyzmq + msgpack subscriber of `--kv-events`: BlockStored for every full block of each
    request, parents announced before children, BlockRemoved when a small pool evicts, and
    its index of the replica's blocks equal to the replica's own count."""
    import msgpack
    import zmq
    from conftest import free_port

    port = free_port()
    # A pool of 32 blocks of 16: a few distinct prompts make it evict.
    proc, base, model = start(os.environ["FERRUM_MODEL"], "--ctx", "256", "--kv-tokens", "512",
                              "--kv-events", f"tcp://127.0.0.1:{port}")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription must reach the publisher
        index, parents_ok, stored, removed, seqs, topics = set(), True, 0, 0, [], set()

        def drain(wait_s):
            nonlocal parents_ok, stored, removed
            t_end = time.time() + wait_s
            while time.time() < t_end:
                if not sub.poll(100):
                    continue
                topic, seq, payload = sub.recv_multipart()
                topics.add(topic.decode())
                seqs.append(int.from_bytes(seq, "big"))
                ts, events = msgpack.unpackb(payload)
                assert ts > 1.7e9
                for e in events:
                    if e[0] == "BlockStored":
                        hashes, parent, tokens, block_size = e[1], e[2], e[3], e[4]
                        assert len(tokens) == len(hashes) * block_size, e
                        parents_ok &= parent is None or parent in index
                        for h in hashes:
                            index.add(h)
                        stored += len(hashes)
                    elif e[0] == "BlockRemoved":
                        for h in e[1]:
                            index.discard(h)
                        removed += len(e[1])
                    elif e[0] == "AllBlocksCleared":
                        index.clear()

        c = httpx.Client(base_url=base, timeout=60)
        prompt_blocks = 0
        for k in range(12):
            text = f"Request {k}: " + "the mill by the river turns all day long, " * 12
            r = c.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 8})
            assert r.status_code == 200, r.text
            prompt_blocks += r.json()["usage"]["prompt_tokens"] // 16
        drain(1.0)
        assert topics == {f"kv@127.0.0.1:{base.rsplit(':', 1)[1]}@{model}"}, topics
        assert seqs == list(range(len(seqs))), seqs[:10]
        assert parents_ok, "a BlockStored came before its parent"
        assert stored >= prompt_blocks, (stored, prompt_blocks)
        assert removed > 0, "the small pool should have evicted"
        from test_scaleout import families
        fams = families(c.get("/metrics").text)
        held = fams["ferrum_prefix_cache_blocks"].samples[0].value
        assert len(index) == held, (len(index), held)
        # A repeated prompt is served from the blocks the index says this replica holds.
        r = c.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 5, r.json()["usage"]
    finally:
        sub.close(0)
        ctx.term()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
