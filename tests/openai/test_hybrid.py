"""A hybrid model (Qwen3.5: Gated DeltaNet layers with a recurrent state per sequence) through
the real server and the official `openai` client, on the tiny random Qwen3.5 and Qwen3.5-MoE of
tests/fixtures/arch: an agent-style conversation whose second turn extends the first resumes
from the first prompt's state snapshot (cached tokens reported, the snapshot counters move)
and answers exactly as a server that never saw the first turn; concurrent streams give each
the answer it gives alone."""

import concurrent.futures
import os
import signal

import httpx
import pytest

from test_security import start

HERE = os.path.dirname(__file__)
ARCH = os.path.join(HERE, "..", "fixtures", "arch")

SYSTEM = ("You are a helpful assistant that answers questions about the river, the valley, "
          "the old mill and the stone bridge, and about the town's records since 1850.")


def serve(name):
    return start(os.path.join(ARCH, name, "model-q8_0.gguf"), "--ctx", "1024")


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out


def client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def metric(base, name):
    text = httpx.get(base + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def ask(c, model, messages, n=10):
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0)
    return r.choices[0].message.content, r.usage


@pytest.mark.parametrize("name", ["qwen35", "qwen35-moe"])
def test_a_second_turn_resumes_from_the_first_turns_state(name):
    proc, base, model = serve(name)
    try:
        c = client(base)
        turn1 = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "Where does the river begin, and how fast is it?"}]
        a1, u1 = ask(c, model, turn1)
        assert u1.prompt_tokens_details.cached_tokens == 0
        turn2 = turn1 + [{"role": "assistant", "content": a1},
                         {"role": "user", "content": "And in the late summer?"}]
        a2, u2 = ask(c, model, turn2)
        # The first prompt's last block boundary (blocks of 16), at least.
        cached = u2.prompt_tokens_details.cached_tokens
        assert cached >= (u1.prompt_tokens - 1) // 16 * 16 > 0, (cached, u1.prompt_tokens)
        assert metric(base, "ferrum_state_snapshot_hits_total") >= 1
        assert metric(base, "ferrum_state_snapshots") >= 1
    finally:
        stop(proc)
    # A server that never saw the first turn gives the same second answer.
    proc, base, model = serve(name)
    try:
        cold, u = ask(client(base), model, turn2)
        assert u.prompt_tokens_details.cached_tokens == 0
        assert cold == a2
    finally:
        stop(proc)


def test_concurrent_streams_answer_as_they_do_alone():
    proc, base, model = serve("qwen35")
    try:
        c = client(base)
        prompts = [[{"role": "user", "content": f"Tell me about record number {i} of the town."}]
                   for i in range(6)]
        alone = [ask(c, model, p, 12)[0] for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda p: ask(c, model, p, 12)[0], prompts))
        assert together == alone
    finally:
        stop(proc)
