#!/usr/bin/env python3
"""Soak test: many concurrent clients against a real `ferrum serve` for a while, then checks
that nothing leaked and nothing failed.

Each client loops over a random mix: chat streamed and not, streams dropped mid-answer,
requests abandoned by a short client timeout, n > 1, JSON schemas, forced tool calls, long
prompts that share a prefix, and requests over the limits (which must be 400s). RSS is
sampled every second. Afterwards: 0 running, 0 waiting, 0 KV blocks in use, RSS within
--rss-tolerance of its value after the warm-up, no 5xx, and SIGTERM exits 0.

    FERRUM_BIN=target/release/ferrum python scripts/soak.py MODEL --clients 32 --seconds 600

Needs httpx (the test venv has it: ${FERRUM_CACHE:-~/.cache/ferrum}/venv-openai/bin/python).
Prints one JSON object of figures; exits 1 when a check fails. Traffic goes to 127.0.0.1 only.
"""

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

CTX = 2048
PREAMBLE = ("You are a careful assistant for a shipping company. " * 40).strip()
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOPICS = ["the sea", "a lighthouse", "rain", "trains", "a small cat", "bread", "winter", "maps"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.status = collections.Counter()  # (scenario, status) -> count
        self.errors = collections.Counter()  # unexpected outcomes
        self.requests = 0

    def add(self, scenario, status, ok=True, why=None):
        with self.lock:
            self.requests += 1
            self.status[(scenario, status)] += 1
            if not ok:
                self.errors[f"{scenario}: {why or status}"] += 1


def chat_body(model, rng, **kw):
    body = {"model": model, "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7]),
            "messages": [{"role": "user", "content": f"Say something about {rng.choice(TOPICS)}."}]}
    body.update(kw)
    return body


def one_request(base, model, rng, stats):
    scenario = rng.choice(["chat", "stream", "drop_stream", "abandon", "n", "schema", "tools",
                           "shared_prefix", "over_context", "over_n", "completion"])
    url = base + "/v1/chat/completions"
    try:
        if scenario in ("chat", "n", "schema", "tools", "shared_prefix"):
            kw = {}
            if scenario == "n":
                kw = {"n": rng.randint(2, 4), "seed": rng.randint(0, 1000), "temperature": 0.8}
            elif scenario == "schema":
                kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}},
                      "max_tokens": 64}
            elif scenario == "tools":
                kw = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 64}
            elif scenario == "shared_prefix":
                kw = {"messages": [{"role": "system", "content": PREAMBLE},
                                   {"role": "user", "content": f"Question {rng.randint(0, 99)}: where is {rng.choice(TOPICS)}?"}]}
            r = httpx.post(url, json=chat_body(model, rng, **kw), timeout=300)
            ok = r.status_code == 200
            if ok and scenario == "schema":
                content = r.json()["choices"][0]["message"]["content"]
                if r.json()["choices"][0]["finish_reason"] == "stop":
                    json.loads(content)
            stats.add(scenario, r.status_code, ok)
        elif scenario in ("stream", "drop_stream"):
            drop_after = rng.randint(1, 5) if scenario == "drop_stream" else None
            with httpx.stream("POST", url, json=chat_body(model, rng, stream=True, max_tokens=48), timeout=300) as r:
                status = r.status_code
                chunks, done = 0, False
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        done = line == "data: [DONE]"
                    if drop_after and chunks >= drop_after:
                        break  # hang up mid-answer
            ok = status == 200 and (drop_after is not None or done)
            stats.add(scenario, status, ok, None if ok else "stream did not end with [DONE]")
        elif scenario == "abandon":
            try:
                httpx.post(url, json=chat_body(model, rng, max_tokens=200), timeout=0.3)
                stats.add(scenario, "finished")
            except httpx.TimeoutException:
                stats.add(scenario, "abandoned")
        elif scenario == "over_context":
            r = httpx.post(url, json=chat_body(model, rng, max_tokens=CTX * 4), timeout=60)
            stats.add(scenario, r.status_code, r.status_code == 400)
        elif scenario == "over_n":
            r = httpx.post(url, json=chat_body(model, rng, n=16, max_tokens=CTX - 100), timeout=60)
            stats.add(scenario, r.status_code, r.status_code == 400)
        elif scenario == "completion":
            r = httpx.post(base + "/v1/completions", timeout=300, json={
                "model": model, "prompt": f"Once upon a time, {rng.choice(TOPICS)}",
                "max_tokens": rng.randint(1, 32), "stream": False})
            stats.add(scenario, r.status_code, r.status_code == 200)
    except httpx.TransportError as e:
        stats.add(scenario, "transport", False, f"transport error {type(e).__name__}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--bin", default=os.environ.get("FERRUM_BIN", "target/release/ferrum"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    warmup = a.warmup if a.warmup is not None else min(60.0, a.seconds / 5)

    port = free_port()
    proc = subprocess.Popen([a.bin, "serve", a.model, "--port", str(port), "--ctx", str(CTX),
                             "--kv-tokens", str(8 * CTX), "--max-waiting", str(4 * a.clients)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    model = None
    while time.time() < deadline and model is None:
        if proc.poll() is not None:
            sys.exit(f"ferrum serve exited early:\n{''.join(log)}")
        try:
            r = httpx.get(base + "/health", timeout=2)
            if r.status_code == 200:
                model = r.json()["model"]
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    if model is None:
        proc.kill()
        sys.exit("ferrum serve did not become healthy")

    stats = Stats()
    t0 = time.time()
    end = t0 + a.seconds
    rss = []  # (seconds since start, kB)
    health_ms = []

    def monitor():
        while time.time() < end:
            rss.append((round(time.time() - t0, 1), rss_kb(proc.pid)))
            h0 = time.time()
            try:
                httpx.get(base + "/health", timeout=10)
                health_ms.append((time.time() - h0) * 1e3)
            except httpx.TransportError:
                stats.errors["health: transport error"] += 1
            time.sleep(1)

    def client(i):
        rng = random.Random(a.seed * 1000 + i)
        while time.time() < end:
            one_request(base, model, rng, stats)

    threads = [threading.Thread(target=monitor)] + [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Quiet: everything dropped or abandoned must be cancelled and its blocks returned.
    settled = None
    for _ in range(300):
        h = httpx.get(base + "/health", timeout=10).json()
        if h["running"] == 0 and h["waiting"] == 0 and h["kv_blocks_used"] == 0:
            settled = h
            break
        time.sleep(0.1)
    final = settled or httpx.get(base + "/health", timeout=10).json()
    rss_end = rss_kb(proc.pid)
    baseline = next((kb for s, kb in rss if s >= warmup), rss[-1][1] if rss else rss_end)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "hung"

    by_status = collections.Counter()
    for (_, status), n in stats.status.items():
        by_status[str(status)] += n
    health_ms.sort()
    figures = {
        "clients": a.clients, "seconds": a.seconds, "requests": stats.requests,
        "by_status": dict(by_status),
        "by_scenario": {f"{s} {st}": n for (s, st), n in sorted(stats.status.items(), key=str)},
        "unexpected": dict(stats.errors),
        "after": {k: final[k] for k in ("running", "waiting", "kv_blocks_used", "kv_blocks")},
        "rss_kb": {"after_warmup": baseline, "end": rss_end, "max": max(kb for _, kb in rss) if rss else rss_end,
                   "samples": rss[:: max(1, len(rss) // 20)]},
        "health_ms": {"p50": health_ms[len(health_ms) // 2] if health_ms else None,
                      "p99": health_ms[int(len(health_ms) * 0.99)] if health_ms else None},
        "exit_code": code,
    }
    failures = []
    if any(str(s).startswith("5") for s in by_status):
        failures.append("5xx answers")
    if stats.errors:
        failures.append("unexpected outcomes")
    if settled is None:
        failures.append("requests or KV blocks left over")
    if rss_end > baseline * (1 + a.rss_tolerance):
        failures.append(f"RSS grew {100 * (rss_end / baseline - 1):.1f}% after warm-up")
    if code != 0:
        failures.append(f"exit code {code}")
    figures["failures"] = failures
    print(json.dumps(figures, indent=1))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
