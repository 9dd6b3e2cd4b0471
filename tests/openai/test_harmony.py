"""gpt-oss's harmony format through the real server and the official `openai` client, on the
tiny random gpt-oss of tests/fixtures/arch/gpt-oss (its harmony vocabulary) with the real
gpt-oss chat template (tests/fixtures/harmony/gpt-oss.jinja), and without a template (the
built-in rendering): prompts as transformers / openai-harmony render them, forced tool calls
and JSON schemas enforced after the analysis, analysis streamed as reasoning_content."""

import datetime
import json
import os
import shutil
import signal
import tempfile

import httpx
import pytest

from test_security import start

HERE = os.path.dirname(__file__)
FIXTURES = os.path.join(HERE, "..", "fixtures")
GPT_OSS = os.path.join(FIXTURES, "arch", "gpt-oss")
HARMONY = os.path.join(FIXTURES, "harmony")


def model_folder(tmp, template):
    folder = os.path.join(tmp, "model")
    os.makedirs(folder)
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"):
        shutil.copy(os.path.join(GPT_OSS, f), folder)
    if template is not None:
        shutil.copy(template, os.path.join(folder, "chat_template.jinja"))
    return folder


class Served:
    def __init__(self, template):
        self.tmp = tempfile.mkdtemp(prefix="ferrum-harmony-")
        self.proc, self.base, self.model = start(model_folder(self.tmp, template), "--ctx", "1024")

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0)

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=30)
            assert self.proc.returncode == 0, out
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def templated():
    s = Served(os.path.join(HARMONY, "gpt-oss.jinja"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def bare():
    s = Served(None)
    yield s
    s.close()


def conversations():
    with open(os.path.join(HARMONY, "conversations.json")) as f:
        convs = json.load(f)
    with open(os.path.join(HARMONY, "renders.json")) as f:
        renders = json.load(f)
    return list(zip(convs, renders))


def rendered(served, conv):
    body = {"model": served.model, "messages": conv["messages"]}
    for k in ("tools", "reasoning_effort"):
        if k in conv:
            body[k] = conv[k]
    r = httpx.post(served.base + "/v1/chat/completions/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return r.json()["prompt"].replace(today, "{DATE}")


def test_openai_shaped_requests_render_as_the_template_and_as_openai_harmony(templated, bare):
    # String arguments, reasoning_content and reasoning_effort as OpenAI clients send them.
    for conv, want in conversations():
        assert rendered(templated, conv) == want["template"], conv["name"]
        assert rendered(bare, conv) == want["harmony"], conv["name"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("which", ["templated", "bare"])
def test_forced_tool_calls_come_back_as_valid_calls(which, request):
    import jsonschema
    served = request.getfixturevalue(which)
    c = served.client()
    thought = complete = 0
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}] * 4):
        r = c.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Weather in Oslo, and the time?"}],
            tools=[WEATHER, TIME], tool_choice=choice, max_tokens=160, temperature=1.0, seed=seed)
        m = r.choices[0].message
        # The prompt carries today's date, so which seeds this random model spends all its
        # tokens on (an analysis first, a long string argument) changes from day to day. An
        # answer cut off by max_tokens says so ("length"), never "tool_calls" with arguments
        # that do not close.
        if r.choices[0].finish_reason == "length":
            continue
        assert r.choices[0].finish_reason == "tool_calls", r
        complete += 1
        assert len(m.tool_calls) == 1, m
        call = m.tool_calls[0]
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        if choice != "required":
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
        # No channel markup leaks into what the client sees.
        for text in (m.content or "", getattr(m, "reasoning_content", None) or ""):
            assert "<|" not in text, text
        thought += bool(getattr(m, "reasoning_content", None))
    # Most answers finish their call, and some went through an analysis first (the random
    # model picks the channel).
    assert complete >= 4, complete
    assert thought > 0


@pytest.mark.parametrize("which", ["templated", "bare"])
def test_a_call_cut_off_by_max_tokens_finishes_with_length(which, request):
    served = request.getfixturevalue(which)
    c = served.client()
    forced = {"type": "function", "function": {"name": "get_weather"}}
    cut_in_call = 0
    for seed in range(8):
        args = dict(model=served.model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                    tools=[WEATHER], tool_choice=forced, max_tokens=160, temperature=1.0, seed=seed)
        whole = c.chat.completions.create(**args)
        if whole.choices[0].finish_reason != "tool_calls":
            continue
        # The same seed again with a budget a few tokens short of the whole call: the same
        # tokens, cut before the call closes.
        for short in (1, 2, 3, 5):
            args["max_tokens"] = whole.usage.completion_tokens - short
            r = c.chat.completions.create(**args)
            assert r.choices[0].finish_reason == "length", r
            stream = c.chat.completions.create(**args, stream=True)
            finishes = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
            assert finishes == ["length"], finishes
            cut_in_call += bool(r.choices[0].message.tool_calls)
    # Some of the cut answers had a call begun (reported, but as cut short).
    assert cut_in_call > 0
    # Budgets that end inside the first channel header: nothing of the markup comes back.
    for max_tokens in range(1, 12):
        m = c.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
            tool_choice=forced, max_tokens=max_tokens, temperature=1.0, seed=1).choices[0].message
        for text in (m.content or "", getattr(m, "reasoning_content", None) or ""):
            assert "<|" not in text, (max_tokens, text)


def test_a_json_schema_answer_validates_after_the_analysis(templated):
    import jsonschema
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                               "score": {"type": "integer"}},
              "required": ["answer", "score"], "additionalProperties": False}
    c = templated.client()
    complete = 0
    for seed in range(6):
        r = c.chat.completions.create(
            model=templated.model, messages=[{"role": "user", "content": "Rate Oslo."}], max_tokens=240,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
        m = r.choices[0].message
        assert "<|" not in (getattr(m, "reasoning_content", None) or "")
        # The prompt carries today's date (the template's strftime_now), so which seeds this
        # random model spends its tokens on changes from day to day: an answer cut off by
        # max_tokens is a valid prefix, not a whole document; every finished one validates.
        if r.choices[0].finish_reason == "length":
            continue
        jsonschema.validate(json.loads(m.content), schema)
        complete += 1
    assert complete >= 3, f"only {complete} of 6 answers finished"


def test_streamed_deltas_add_up_to_the_whole_answer(templated):
    c = templated.client()
    args = dict(model=templated.model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    whole = c.chat.completions.create(**args).choices[0].message
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in c.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function.name:
                slot["name"] += tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning == (getattr(whole, "reasoning_content", None) or "")
    assert content == (whole.content or "")
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.tool_calls]


def test_the_responses_api_returns_reasoning_and_a_function_call(templated):
    c = templated.client()
    r = c.responses.create(model=templated.model, input="Weather in Oslo?", max_output_tokens=120,
                           tools=[{"type": "function", "name": "get_weather", "description": "Weather",
                                   "parameters": WEATHER["function"]["parameters"]}],
                           tool_choice="required", reasoning={"effort": "low"}, temperature=0)
    kinds = [o.type for o in r.output]
    assert kinds[-1] == "function_call", kinds
    json.loads(r.output[-1].arguments)
