"""OpenAI compatibility, through the official `openai` package only (plus raw HTTP for
bodies the client refuses to send)."""

import json
import math
import threading

import openai
import pytest

from conftest import CTX

CHAT = [{"role": "user", "content": "Write two sentences about the sea."}]


def test_models_lists_the_served_model(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model]


def test_chat_stream_concatenates_to_the_non_stream_answer(server):
    c = server.client()
    full = c.chat.completions.create(model=server.model, messages=CHAT, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert len(text) > 0
    stream = c.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    deltas, roles, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            if ch.delta.content:
                deltas.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    assert roles == ["assistant"]
    assert "".join(deltas) == text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_usage_is_always_reported(server):
    r = server.client().chat.completions.create(model=server.model, messages=CHAT, max_tokens=5)
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_max_tokens_ends_with_length(server):
    c = server.client()
    for kw in ({"max_tokens": 7}, {"max_completion_tokens": 7}):
        r = c.chat.completions.create(model=server.model, messages=CHAT, temperature=0, **kw)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 7


def test_stop_string_is_not_emitted(server):
    c = server.client()
    prompt = "Count: one, two, three, four, five, six"
    free = c.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
    text = free.choices[0].text
    # Stop on a piece of the free answer: it must end before it.
    cut = text.strip()[3:6]
    assert cut and cut in text
    r = c.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0, stop=[cut])
    assert r.choices[0].finish_reason == "stop"
    assert cut not in r.choices[0].text
    assert text.startswith(r.choices[0].text)


def test_completions_take_a_string_or_a_list(server):
    c = server.client()
    one = c.completions.create(model=server.model, prompt="The sky is", max_tokens=5, temperature=0)
    assert len(one.choices) == 1 and one.choices[0].text
    two = c.completions.create(model=server.model, prompt=["The sky is", "Water is"], max_tokens=5, temperature=0)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=server.model, prompt="The sky is", max_tokens=5,
                                       temperature=0, stream=True)
        if ch.choices
    )
    assert streamed == one.choices[0].text


def test_n_choices(server):
    r = server.client().chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=12, temperature=1.0, n=3, seed=11)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.message.content for ch in r.choices)
    assert len({ch.message.content for ch in r.choices}) > 1, "three seeds, three answers"


def test_seed_reproduces(server):
    c = server.client()
    kw = dict(model=server.model, messages=CHAT, max_tokens=20, temperature=1.0, top_p=0.95)
    a = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b


def test_logprobs(server):
    r = server.client().chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(e.logprob, tops[0], abs_tol=1e-5)
        assert e.token == e.top_logprobs[0].token


def test_embeddings(server):
    c = server.client()
    # The client asks for base64 by default and decodes it.
    r = c.embeddings.create(model=server.model, input=["hello world", "the sea is blue"])
    assert [d.index for d in r.data] == [0, 1]
    for d in r.data:
        assert len(d.embedding) == 576
        assert math.isclose(sum(x * x for x in d.embedding), 1.0, rel_tol=1e-3)
    f = c.embeddings.create(model=server.model, input="hello world", encoding_format="float")
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(f.data[0].embedding, r.data[0].embedding))
    assert r.usage.prompt_tokens > 0


def test_chat_template_kwargs_are_passed(server):
    # SmolLM2's template has no variable of this name: accepted and harmless.
    r = server.client().chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None


def error_of(exc):
    body = exc.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests_get_the_right_status_and_shape(server):
    c = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=CHAT)
    assert error_of(e)["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=CHAT, max_tokens=-1)
    assert error_of(e)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=CHAT, extra_body={"frobnicate": 1})
    assert error_of(e)["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=CHAT, temperature=5)
    assert error_of(e)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "word " * (CTX + 50)}])
    assert "context" in error_of(e)["message"]
    with pytest.raises(openai.AuthenticationError) as e:
        server.client().with_options(api_key="wrong").models.list()
    assert error_of(e)["type"] == "authentication_error"
    # Bodies the client would not send.
    r = server.raw("POST", "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": "Bearer test-key", "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    big = json.dumps({"model": server.model, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    r = server.raw("POST", "/v1/chat/completions", content=big,
                   headers={"Authorization": "Bearer test-key", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}, "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"$ref": "#/$defs/pt"}}, "required": ["point"], "$defs": {"pt": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}}},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 5}]}}, "required": ["v"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}}, "required": ["id", "admin"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 50}}, "required": ["status", "count"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}, "required": ["title", "year"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["n"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["email"]},
    {"type": "object", "properties": {"mood": {"oneOf": [{"const": "happy"}, {"const": "sad"}]}}, "required": ["mood"]},
    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}}}, "required": ["grid"]},
    {"type": "object", "properties": {"id": {"type": "string", "minLength": 3, "maxLength": 6}, "n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}, "required": ["id", "n"]},
    {"type": "object", "properties": {"lang": {"enum": ["rust", "c", "python"]}, "stars": {"type": "integer", "minimum": 0, "maximum": 5}, "fast": {"type": "boolean"}}, "required": ["lang", "stars", "fast"], "additionalProperties": False},
]


def strict(schema):
    """OpenAI's strict mode: every object closes its properties."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def test_json_schema_output_validates_20_of_20(server):
    import jsonschema
    c = server.client()
    for i, schema in enumerate(map(strict, SCHEMAS)):
        r = c.chat.completions.create(
            model=server.model, max_tokens=120, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": "Reply with a JSON value."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_and_a_bad_schema(server):
    c = server.client()
    # Free-form JSON has no length bound: give it room, and a fixed seed.
    r = c.chat.completions.create(
        model=server.model, max_tokens=200, temperature=0.7, seed=3,
        messages=[{"role": "user", "content": "Describe the sea as a JSON object."}],
        response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert "constraint" in error_of(e)["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}


def test_forced_tool_calls_validate_10_of_10(server):
    import jsonschema
    c = server.client()
    for i in range(10):
        choice = "required" if i % 2 else {"type": "function", "function": {"name": "get_weather"}}
        r = c.chat.completions.create(
            model=server.model, max_tokens=120, temperature=0.8, seed=100 + i,
            messages=[{"role": "user", "content": f"What is the weather in city number {i}?"}],
            tools=[WEATHER, TIME], tool_choice=choice)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        if not isinstance(choice, str):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
        assert call.id and call.type == "function"


def test_tool_round_trip_and_streamed_calls(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    r = c.chat.completions.create(model=server.model, max_tokens=80, temperature=0, messages=msgs,
                                  tools=[WEATHER], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    # The same request streamed: the call arrives as tool_calls deltas, its name first, then
    # its arguments as they are generated.
    stream = c.chat.completions.create(model=server.model, max_tokens=80, temperature=0, messages=msgs,
                                       tools=[WEATHER], tool_choice="required", stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            deltas.extend(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert {d.index for d in deltas} == {0}
    assert deltas[0].id and deltas[0].function.name == call.function.name
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == json.loads(call.function.arguments)
    # Feed the result back as a tool message: the model answers in text.
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 21, \"sky\": \"clear\"}"}]
    r2 = c.chat.completions.create(model=server.model, max_tokens=30, temperature=0, messages=msgs,
                                   tools=[WEATHER], tool_choice="none")
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=msgs, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert error_of(e)["param"] == "tool_choice"


def metric(server, name):
    text = server.raw("GET", "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_16_concurrent_streams_some_leaving_early(server):
    results, errors = {}, []

    def client(i):
        try:
            c = server.client()
            stream = c.chat.completions.create(
                model=server.model, max_tokens=24, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"Tell me fact number {i} about the moon."}])
            text = []
            for k, chunk in enumerate(stream):
                if i % 4 == 3 and k == 3:
                    stream.close()  # the client goes away mid-answer
                    results[i] = None
                    return
                for ch in chunk.choices:
                    text.append(ch.delta.content or "")
                    if ch.finish_reason:
                        results[i] = ("".join(text), ch.finish_reason)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    finished = [v for i, v in results.items() if i % 4 != 3]
    assert len(finished) == 12
    assert all(reason in ("stop", "length") and text for text, reason in finished)
    # The departed clients' requests were cancelled: nothing keeps running.
    for _ in range(50):
        if metric(server, "vllm:num_requests_running") == 0:
            break
        threading.Event().wait(0.1)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_health_and_metrics(server):
    h = server.raw("GET", "/health", headers={}).json()
    assert h["status"] == "ok" and h["model"] == server.model and h["kv_cache_tokens"] >= 8192
    assert metric(server, "ferrum_requests_total") > 0
    assert "ferrum_time_to_first_token_seconds_bucket" in server.raw("GET", "/metrics").text


def test_plan_predicts_the_servers_memory_within_10_percent(server):
    """`ferrum plan` with the server's settings against the server's real RSS (it has built
    the structured-output grammar by now: the JSON tests above ran first)."""
    import os
    import subprocess
    out = subprocess.run([os.environ["FERRUM_BIN"], "plan", os.environ["FERRUM_MODEL"], "--ctx", str(CTX),
                          "--kv-tokens", "8192", "--json"], check=True, capture_output=True, text=True)
    plan = json.loads(out.stdout)
    with open(f"/proc/{server.proc.pid}/status") as f:
        rss = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    predicted = plan["total_with_grammar_bytes"]
    assert abs(predicted - rss) <= 0.10 * rss, (predicted, rss, plan)
    assert plan["fits"] and plan["kv_tokens"] == 8192


def test_speculation_per_request_changes_speed_not_the_answer(server):
    # The server runs without --spec; a request turns prompt lookup on for itself.
    c = server.client()
    code = "def area(w, h):\n    a = w * h\n    print('area', a)\n    return a\n"
    msgs = [{"role": "user", "content": f"Repeat this code exactly:\n\n{code}"}]
    kw = dict(model=server.model, messages=msgs, max_tokens=60, temperature=0,
              logprobs=True, top_logprobs=2)
    plain = c.chat.completions.create(extra_body={"speculative": False}, **kw)
    drafted = metric(server, "ferrum_spec_draft_tokens_total")
    for extra in ({"speculative": True}, {"speculative": {"n_max": 6}}, {"speculative.n_max": 3}):
        r = c.chat.completions.create(extra_body=extra, **kw)
        assert r.choices[0].message.content == plain.choices[0].message.content, extra
        assert r.usage.completion_tokens == plain.usage.completion_tokens
        # Log-probabilities are the accepted tokens' own, as plain decoding reports them.
        got = [(e.token, e.logprob) for e in r.choices[0].logprobs.content]
        want = [(e.token, e.logprob) for e in plain.choices[0].logprobs.content]
        assert got == want, extra
    now = metric(server, "ferrum_spec_draft_tokens_total")
    assert now > drafted, "the requests drafted nothing"
    assert metric(server, "ferrum_spec_accepted_tokens_total") > 0
    assert 0 < metric(server, "ferrum_spec_acceptance_ratio") <= 1
    assert metric(server, "vllm:spec_decode_num_draft_tokens_total") == now
    for bad in ({"speculative": "yes"}, {"speculative": {"n_max": -1}},
                {"speculative": {"depth": 2}}, {"speculative.n_max": 1000},
                {"speculative": False, "speculative.n_max": 4}):
        r = server.raw("POST", "/v1/chat/completions", json={**kw, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"].startswith("speculative"), r.text
