"""The APIs agent tools speak, through their official clients: OpenAI's Responses API (the
`openai` package) and Anthropic's Messages API (the `anthropic` package), plus /tokenize,
/detokenize and the render endpoints, and structured output on schemas as users write them
(objects not closed, integers unbounded).
"""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from conftest import API_KEY

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                  "required": ["city"]}
RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
             "parameters": WEATHER_PARAMS}
ANTH_TOOL = {"name": "get_weather", "description": "Current weather in a city",
             "input_schema": WEATHER_PARAMS}
QUESTION = "What is the capital of France?"
# anthropic 2.x's messages.create has no sampling arguments; ferrum still takes them (older
# clients, and extra_body), and the suite wants greedy answers.
T0 = {"temperature": 0}


def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0)


# --------------------------------------------------------------------------- Responses

def test_responses_create_and_usage(server):
    r = server.client().responses.create(model=server.model, input=QUESTION, instructions="Be brief.",
                                         temperature=0, max_output_tokens=40)
    assert r.object == "response" and r.status == "completed"
    assert "Paris" in r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    short = server.client().responses.create(model=server.model, input=QUESTION, max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_stream_events_add_up(server):
    c = server.client()
    deltas, kinds, seqs = [], [], []
    with c.responses.stream(model=server.model, input=[{"role": "user", "content": "Say hello."}],
                            temperature=0, max_output_tokens=30) as s:
        for ev in s:
            kinds.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    for k in ["response.output_item.added", "response.content_part.added",
              "response.output_text.done", "response.output_item.done"]:
        assert k in kinds, kinds
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert "".join(deltas) == final.output_text and final.output_text
    # The same request without streaming gives the same text (greedy).
    plain = c.responses.create(model=server.model, input=[{"role": "user", "content": "Say hello."}],
                               temperature=0, max_output_tokens=30)
    assert plain.output_text == final.output_text


def test_responses_function_call_round_trip(server):
    c = server.client()
    r = c.responses.create(model=server.model, input="What is the weather in Paris?",
                           tools=[RESP_TOOL], tool_choice="required", temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, {**WEATHER_PARAMS, "additionalProperties": False})
    follow = c.responses.create(
        model=server.model, tools=[RESP_TOOL], temperature=0, max_output_tokens=40,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 22 C"}])
    assert follow.status == "completed" and follow.output_text
    # Streamed, a forced call arrives as its argument events and a final item.
    with c.responses.stream(model=server.model, input="Weather in Rome?", tools=[RESP_TOOL],
                            tool_choice={"type": "function", "name": "get_weather"}, temperature=0) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert json.loads(call.arguments)["city"]


def test_responses_json_schema_format(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    r = server.client().responses.create(
        model=server.model, input="Give a person's name and age as JSON.", temperature=0,
        max_output_tokens=80, text={"format": {"type": "json_schema", "name": "person",
                                              "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), {**schema, "additionalProperties": False})


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}}, None),
])
def test_responses_bad_requests_are_400(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model=server.model, input="hi", extra_body=extra)
    err = e.value.body
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param, err


# --------------------------------------------------------------------------- Messages

def test_messages_create_stream_and_usage(server):
    c = claude(server)
    m = c.messages.create(model=server.model, max_tokens=40, system="Be brief.", extra_body=T0,
                          messages=[{"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert m.content[0].type == "text" and "Paris" in m.content[0].text
    with c.messages.stream(model=server.model, max_tokens=40, system="Be brief.", extra_body=T0,
                           messages=[{"role": "user", "content": QUESTION}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == m.usage.output_tokens
    # count_tokens is the prompt the server then reports.
    n = c.messages.count_tokens(model=server.model, system="Be brief.",
                                messages=[{"role": "user", "content": QUESTION}])
    assert n.input_tokens == m.usage.input_tokens > 0


def test_messages_stop_reasons(server):
    c = claude(server)
    m = c.messages.create(model=server.model, max_tokens=40, system="Be brief.", extra_body=T0,
                          stop_sequences=["Paris"], messages=[{"role": "user", "content": QUESTION}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert "Paris" not in m.content[0].text
    m = c.messages.create(model=server.model, max_tokens=3,
                          messages=[{"role": "user", "content": QUESTION}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_messages_tool_use_round_trip(server):
    c = claude(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = c.messages.create(model=server.model, max_tokens=100, tools=[ANTH_TOOL],
                          tool_choice={"type": "any"}, extra_body=T0, messages=ask)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, {**WEATHER_PARAMS, "additionalProperties": False})
    follow = c.messages.create(
        model=server.model, max_tokens=40, tools=[ANTH_TOOL], extra_body=T0,
        messages=ask + [{"role": "assistant", "content": m.content},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": "Sunny, 22 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with c.messages.stream(model=server.model, max_tokens=100, tools=[ANTH_TOOL],
                           tool_choice={"type": "tool", "name": "get_weather"}, extra_body=T0,
                           messages=[{"role": "user", "content": "Weather in Rome?"}]) as s:
        final = s.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.input["city"]


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    {"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
    {"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "no_such_field": 1},
    {"max_tokens": 10, "messages": [{"role": "robot", "content": "hi"}]},
    {"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "t", "input_schema": {"type": "no-such-type"}}], "tool_choice": {"type": "any"}},
])
def test_messages_bad_requests_are_400_in_anthropic_shape(server, body):
    r = httpx.post(server.base + "/v1/messages", json={"model": server.model, **body},
                   headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 400, r.text
    e = r.json()
    assert e["type"] == "error" and e["error"]["type"] == "invalid_request_error", e
    assert e["error"]["message"]


def test_messages_auth_takes_x_api_key(server):
    r = httpx.post(server.base + "/v1/messages", headers={"x-api-key": "wrong"}, timeout=60,
                   json={"model": server.model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model=server.model, max_tokens=5, messages=[{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- tokenize / render

def post(server, path, body):
    r = server.raw("POST", path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_matches_the_prompt_a_chat_request_reports(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    tok = post(server, "/tokenize", {"model": server.model, "messages": messages})
    chat = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert tok["count"] == len(tok["tokens"]) == chat.usage.prompt_tokens
    rendered = post(server, "/v1/chat/completions/render", {"model": server.model, "messages": messages})
    assert rendered["prompt_token_ids"] == tok["tokens"]
    back = post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert back["content"] == rendered["prompt"]
    assert "<|im_start|>" in back["content"] and QUESTION in back["content"]
    # Tools change the prompt the same way.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}]
    with_tools = post(server, "/tokenize", {"model": server.model, "messages": messages, "tools": tools})
    chat = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=1,
                                                   tools=tools)
    assert with_tools["count"] == chat.usage.prompt_tokens > tok["count"]


def test_tokenize_text_in_both_shapes_and_round_trips(server):
    text = "Hello, world! Ünïcödé and <|im_start|> text."
    a = post(server, "/tokenize", {"content": text, "with_pieces": True})
    b = post(server, "/tokenize", {"model": server.model, "prompt": text, "add_special_tokens": True,
                                   "return_token_strs": True})
    ids = [t["id"] for t in a["tokens"]]
    assert ids == b["tokens"] and b["count"] == len(ids) and b["max_model_len"] > 0
    # Pieces are per token: a character split over two tokens is in neither whole.
    ascii_pieces = post(server, "/tokenize", {"content": "Hello, world!", "with_pieces": True})
    assert "".join(t["piece"] for t in ascii_pieces["tokens"]) == "Hello, world!"
    assert len(b["token_strs"]) == len(ids)
    assert post(server, "/detokenize", {"tokens": ids})["content"] == text
    # As a completion prompt: the render endpoint gives the same ids.
    r = post(server, "/v1/completions/render", {"model": server.model, "prompt": text})
    assert r["prompt_token_ids"] == ids
    # Special-token text as plain text when asked.
    plain = post(server, "/tokenize", {"content": text, "parse_special": False})
    assert len(plain["tokens"]) > len(ids)


def test_tokenize_bad_input_is_400(server):
    for path, body in [("/tokenize", {"content": 3}), ("/tokenize", {"content": "x", "bogus": 1}),
                       ("/detokenize", {"tokens": [1 << 30]}), ("/detokenize", {"tokens": "abc"}),
                       ("/v1/chat/completions/render", {"model": server.model, "messages": []})]:
        r = server.raw("POST", path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- structured output

# Schemas as users write them: objects not closed, integers and numbers without bounds.
LOOSE = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"]},
    {"type": "object", "properties": {"point": {"$ref": "#/$defs/pt"}}, "required": ["point"], "$defs": {"pt": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}}, "required": ["v"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}}, "required": ["id", "admin"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer"}}, "required": ["status", "count"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}, "year": {"type": "integer"}}, "required": ["title", "year"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number"}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"mood": {"oneOf": [{"const": "happy"}, {"const": "sad"}]}}, "required": ["mood"]},
    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}}}, "required": ["grid"]},
    {"type": "object", "properties": {"id": {"type": "string", "minLength": 3, "maxLength": 6}, "n": {"type": ["integer", "null"]}}, "required": ["id", "n"]},
    {"type": "object", "properties": {"lang": {"enum": ["rust", "c", "python"]}, "stars": {"type": "integer"}, "fast": {"type": "boolean"}}, "required": ["lang", "stars", "fast"]},
    {"type": "object", "properties": {"price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}}, "required": ["price", "currency"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
]


def close(schema):
    """How the server reads a schema (docs/structured-output.md): objects closed unless opened."""
    if isinstance(schema, dict):
        schema = {k: close(v) for k, v in schema.items()}
        if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [close(v) for v in schema]
    return schema


def test_loose_schemas_finish_and_validate_at_temperature_0(server):
    c = server.client()
    good, failures = 0, []
    for i, schema in enumerate(LOOSE):
        r = c.chat.completions.create(
            model=server.model, max_tokens=200, temperature=0,
            messages=[{"role": "user", "content": "Reply with a JSON value."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        text = r.choices[0].message.content
        try:
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(text), close(schema))
            good += 1
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append((i, text, str(e)[:200]))
    assert good >= 19, failures


# --------------------------------------------------------------------------- streamed calls

def test_tool_call_arguments_stream_as_generated_in_all_three_apis(server):
    import json as _json
    ask = "What is the weather in Paris?"
    # Chat Completions: the call's arguments arrive over several chunks.
    chunks = list(server.client().chat.completions.create(
        model=server.model, stream=True, messages=[{"role": "user", "content": ask}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}],
        tool_choice="required", temperature=0))
    pieces = [tc.function.arguments for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])
              if tc.function and tc.function.arguments]
    assert len(pieces) >= 2, pieces
    assert _json.loads("".join(pieces))["city"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Responses.
    with server.client().responses.stream(model=server.model, input=ask, tools=[RESP_TOOL],
                                          tool_choice="required", temperature=0) as s:
        deltas = [ev.delta for ev in s if ev.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert len(deltas) >= 2 and "".join(deltas) == call.arguments
    # Messages.
    with claude(server).messages.stream(model=server.model, max_tokens=100, tools=[ANTH_TOOL],
                                        tool_choice={"type": "any"}, extra_body=T0,
                                        messages=[{"role": "user", "content": ask}]) as s:
        parts = [ev.delta.partial_json for ev in s
                 if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"]
        final = s.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert len(parts) >= 2 and _json.loads("".join(parts)) == use.input
