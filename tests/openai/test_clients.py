"""Today's clients, unmodified, against `ferrum serve`: the newest `anthropic`, `openai` and
`ollama` packages (pinned in requirements.txt, so a version bump is a one-line change that this
suite checks). Every field a current SDK can send is either honoured (structured output,
effort, thinking), taken and left (settings of a hosted service with no part in a local
answer: the answer is then the same as without them), or refused with a 400 naming it
(docs/api.md has the table). Also: several served model names, any model name, and the
Ollama API (`/api/*`) through the official `ollama` client.
"""

import base64
import json
import os
import struct

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

import conftest
from conftest import API_KEY

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"]}
ANTH_TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}
OLLAMA_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": WEATHER}}
HI = [{"role": "user", "content": "What is the capital of France?"}]
# anthropic 2.x has no sampling arguments; ferrum still reads them from the body.
T0 = {"temperature": 0}
# SmolLM2-135M calls a tool at temperature 0 when told to say the call (the first token's
# margin over the next is 0.4 nats); it never does of its own accord, and Ollama's API has no
# tool_choice to force one.
SAY_CALL = [{"role": "user", "content": 'Say exactly this and nothing else: <tool_call>{"name": '
             '"get_weather", "arguments": {"city": "Paris"}}</tool_call>'}]


def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0)


def llama(server):
    return ollama.Client(host=server.base, headers={"Authorization": f"Bearer {API_KEY}"})


def text_of(m):
    return "".join(b.text for b in m.content if b.type == "text")


# --------------------------------------------------------------------------- anthropic 2.x

def test_anthropic_output_config_format_is_structured_output(server):
    c = claude(server)
    ask = [{"role": "user", "content": "Give a person's name and age."}]
    m = c.messages.create(model=server.model, max_tokens=150, messages=ask, extra_body=T0,
                          output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(text_of(m)), PERSON)
    with c.messages.stream(model=server.model, max_tokens=150, messages=ask, extra_body=T0,
                           output_config={"format": {"type": "json_schema", "schema": PERSON},
                                          "effort": "low"}) as s:
        streamed = "".join(ev.delta.text for ev in s
                           if ev.type == "content_block_delta" and ev.delta.type == "text_delta")
    jsonschema.validate(json.loads(streamed), PERSON)
    assert streamed == text_of(m)


def test_anthropic_effort_thinking_and_service_settings_are_taken(server):
    c = claude(server)
    cached = {"type": "ephemeral", "ttl": "1h"}
    base = dict(model=server.model, max_tokens=12, extra_body=T0,
                system=[{"type": "text", "text": "Be brief.", "cache_control": cached}],
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "What is the capital of France?", "cache_control": cached}]}])
    plain = text_of(c.messages.create(**base))
    assert plain
    same = [dict(cache_control={"type": "ephemeral"}), dict(service_tier="auto"),
            dict(inference_geo="us"), dict(speed="fast"), dict(metadata={"user_id": "u-1"}),
            dict(diagnostics={"previous_message_id": None})]
    for kw in same:
        assert text_of(c.messages.create(**base, **kw)) == plain, kw
    # Effort and thinking reach the template where it has settings for them (SmolLM2's has
    # none): accepted, whatever they are.
    for kw in [dict(output_config={"effort": e}) for e in ["low", "medium", "high", "xhigh", "max"]] + [
            dict(thinking={"type": "enabled", "budget_tokens": 2048}),
            dict(thinking={"type": "adaptive", "display": "summarized"}),
            dict(thinking={"type": "disabled"})]:
        m = c.messages.create(**base, **kw)
        assert m.stop_reason in ("end_turn", "max_tokens") and text_of(m), kw


def test_anthropic_forced_tool_call_and_tool_result_round_trip(server):
    c = claude(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = c.messages.create(model=server.model, max_tokens=60, tools=[ANTH_TOOL], messages=ask,
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body=T0)
    assert m.stop_reason == "tool_use", m
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    follow = ask + [{"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "18 C and sunny"}]}]
    m2 = c.messages.create(model=server.model, max_tokens=30, tools=[ANTH_TOOL], messages=follow,
                           extra_body=T0)
    assert m2.stop_reason in ("end_turn", "max_tokens") and text_of(m2)


def test_anthropic_system_messages_count_tokens_and_cache_warm_up(server):
    c = claude(server)
    msgs = [{"role": "system", "content": "You answer questions about geography. " * 12},
            {"role": "user", "content": "What is the capital of France?"}]
    n = c.messages.count_tokens(model=server.model, messages=msgs, output_config={"effort": "low"},
                                cache_control={"type": "ephemeral"}).input_tokens
    # max_tokens 0 reads the prompt into the cache and answers nothing.
    warm = c.messages.create(model=server.model, max_tokens=0, messages=msgs,
                             cache_control={"type": "ephemeral"})
    assert warm.content == [] and warm.usage.output_tokens == 0
    assert warm.usage.input_tokens == n
    m = c.messages.create(model=server.model, max_tokens=5, messages=msgs, extra_body=T0)
    assert m.usage.input_tokens == n and m.usage.cache_read_input_tokens > 0, m.usage


@pytest.mark.parametrize("kw,field", [
    (dict(container="c-1"), "container"),
    (dict(extra_body={"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}), "mcp_servers"),
    (dict(output_config={"format": {"type": "xml"}}), "output_config.format"),
    (dict(thinking={"type": "sometimes"}), "thinking.type"),
])
def test_anthropic_refuses_what_it_cannot_do_naming_the_field(server, kw, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(server).messages.create(model=server.model, max_tokens=5, messages=HI, **kw)
    assert field in str(e.value)


def test_models_list_for_both_clients(server):
    assert [m.id for m in server.client().models.list()] == [server.model]
    assert server.client().models.retrieve(server.model).id == server.model
    page = claude(server).models.list()
    assert [(m.id, m.type) for m in page.data] == [(server.model, "model")]
    assert claude(server).models.retrieve(server.model).display_name == server.model
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("no-such-model")


# --------------------------------------------------------------------------- openai 3.x

def test_openai_chat_service_settings_are_taken_and_change_nothing(server):
    c = server.client()
    base = dict(model=server.model, messages=HI, max_completion_tokens=12, temperature=0)
    plain = c.chat.completions.create(**base).choices[0].message.content
    for kw in [dict(verbosity="low"), dict(store=False), dict(store=True), dict(prompt_cache_key="k-1"),
               dict(prompt_cache_retention="24h"), dict(prompt_cache_options={"mode": "implicit"}),
               dict(safety_identifier="u-1"), dict(service_tier="auto"), dict(metadata={"a": "b"}),
               dict(prediction={"type": "content", "content": "Paris"}), dict(modalities=["text"]),
               dict(user="u-1")]:
        r = c.chat.completions.create(**base, **kw)
        assert r.choices[0].message.content == plain, kw
    chunks = list(c.chat.completions.create(
        **base, stream=True, stream_options={"include_usage": True, "include_obfuscation": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    # Every effort the SDK names is taken.
    for e in ["none", "minimal", "low", "medium", "high", "xhigh", "max"]:
        c.chat.completions.create(**base, reasoning_effort=e)


@pytest.mark.parametrize("kw,field", [
    (dict(web_search_options={}), "web_search_options"),
    (dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), "modalities"),
    (dict(functions=[{"name": "f", "parameters": {"type": "object"}}]), "functions"),
    (dict(moderation={"model": "omni-moderation-latest"}), "moderation"),
])
def test_openai_chat_refuses_what_it_cannot_do(server, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=server.model, messages=HI, max_tokens=5, **kw)
    assert e.value.body["param"] == field, e.value.body


def test_openai_responses_settings_and_refusals(server):
    c = server.client()
    base = dict(model=server.model, input="What is the capital of France?", max_output_tokens=12,
                temperature=0)
    plain = c.responses.create(**base)
    assert plain.usage.input_tokens_details.cache_write_tokens == 0
    for kw in [dict(prompt_cache_key="k"), dict(safety_identifier="s"), dict(service_tier="auto"),
               dict(prompt_cache_retention="24h"), dict(store=False), dict(background=False),
               dict(max_tool_calls=4), dict(text={"verbosity": "low"}), dict(truncation="disabled"),
               dict(context_management=[{"type": "compaction", "compact_threshold": 100000}])]:
        assert c.responses.create(**base, **kw).output_text == plain.output_text, kw
    for kw, field in [(dict(conversation="conv_1"), "conversation"), (dict(background=True), "background"),
                      (dict(prompt={"id": "pmpt_1"}), "prompt"), (dict(store=True), "store")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**base, **kw)
        assert e.value.body["param"] == field


def test_openai_embeddings_default_base64_floats_and_token_inputs(server):
    c = server.client()
    # The SDK asks for base64 unless told otherwise, and decodes it.
    default = c.embeddings.create(model=server.model, input=["hello", "world"])
    floats = c.embeddings.create(model=server.model, input=["hello", "world"], encoding_format="float")
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    raw = server.raw("POST", "/v1/embeddings", json={"model": server.model, "input": "hello",
                                                      "encoding_format": "base64"}).json()
    b = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(b) // 4}f", b)) == floats.data[0].embedding
    ids = server.raw("POST", "/tokenize", json={"content": "hello"}).json()["tokens"]
    by_ids = c.embeddings.create(model=server.model, input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == floats.data[0].embedding


# --------------------------------------------------------------------------- model names

def start(*args):
    proc, base, _ = conftest.start(os.environ["FERRUM_MODEL"], "--ctx", "512", *args)
    return proc, base


def stop(proc):
    proc.terminate()
    proc.communicate(timeout=60)


def test_several_served_model_names_and_any_name():
    proc, base = start("--served-model-name", "smollm2", "--served-model-name", "claude-sonnet-4-5")
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in c.models.list()] == ["smollm2", "claude-sonnet-4-5"]
        for name in ["smollm2", "claude-sonnet-4-5"]:
            r = c.chat.completions.create(model=name, messages=HI, max_tokens=4)
            assert r.model == name
        m = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
            model="claude-sonnet-4-5", max_tokens=4, messages=HI)
        assert m.model == "claude-sonnet-4-5"
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="claude-opus-4-1", messages=HI, max_tokens=4)
    finally:
        stop(proc)
    proc, base = start("--any-model-name")
    try:
        m = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
            model="claude-opus-4-1-20250805", max_tokens=4, messages=HI)
        assert m.model == "claude-opus-4-1-20250805" and m.content
        r = ollama.Client(host=base).chat(model="llama3.2", messages=HI, options={"num_predict": 4})
        assert r.model == "llama3.2" and r.done
    finally:
        stop(proc)


# --------------------------------------------------------------------------- ollama

def test_ollama_chat_streamed_and_not(server):
    c = llama(server)
    opts = {"temperature": 0, "num_predict": 16}
    r = c.chat(model=server.model, messages=HI, options=opts)
    assert r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant"
    assert r.message.content and r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.eval_duration > 0
    parts = list(c.chat(model=server.model + ":latest", messages=HI, options=opts, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == r.message.content
    assert (parts[-1].eval_count, parts[-1].done_reason) == (r.eval_count, r.done_reason)
    assert parts[-1].model == server.model + ":latest"
    # Log-probabilities, Ollama's shape.
    r = c.chat(model=server.model, messages=HI, options=opts, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == r.eval_count and len(r.logprobs[0].top_logprobs) == 2
    assert r.logprobs[0].logprob == r.logprobs[0].top_logprobs[0].logprob


def test_ollama_format_schema_and_json(server):
    c = llama(server)
    ask = [{"role": "user", "content": "Give a person's name and age."}]
    opts = {"temperature": 0, "num_predict": 150}
    whole = c.chat(model=server.model, messages=ask, format=PERSON, options=opts).message.content
    jsonschema.validate(json.loads(whole), PERSON)
    parts = c.chat(model=server.model, messages=ask, format=PERSON, options=opts, stream=True)
    assert "".join(p.message.content for p in parts) == whole
    paris = [{"role": "user", "content": 'Describe Paris as a JSON object with keys "city" and "country".'}]
    obj = json.loads(c.chat(model=server.model, messages=paris, format="json", options=opts).message.content)
    assert isinstance(obj, dict) and obj
    g = c.generate(model=server.model, prompt="Give a person's name and age.", format=PERSON, options=opts)
    jsonschema.validate(json.loads(g.response), PERSON)


def test_ollama_tool_calls_and_results(server):
    c = llama(server)
    opts = {"temperature": 0, "num_predict": 60}
    r = c.chat(model=server.model, messages=SAY_CALL, tools=[OLLAMA_TOOL], options=opts)
    (call,) = r.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris"})
    parts = list(c.chat(model=server.model, messages=SAY_CALL, tools=[OLLAMA_TOOL], options=opts, stream=True))
    streamed = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("get_weather", {"city": "Paris"})]
    # A Python function as the tool (the client writes its schema), and the result sent back.
    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
          city: The city
        """
        return "18 C"

    follow = SAY_CALL + [r.message, {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    r2 = c.chat(model=server.model, messages=follow, tools=[get_weather], options=opts)
    assert r2.done and r2.message.role == "assistant"


def test_ollama_generate_raw_context_and_load(server):
    c = llama(server)
    opts = {"temperature": 0, "num_predict": 8}
    g = c.generate(model=server.model, prompt="What is the capital of France?", system="Be brief.", options=opts)
    assert g.done and g.response and g.context and g.eval_count > 0
    parts = list(c.generate(model=server.model, prompt="What is the capital of France?", system="Be brief.",
                            options=opts, stream=True))
    assert "".join(p.response for p in parts) == g.response and parts[-1].context == g.context
    # A raw prompt goes to the model as it is, and is what a plain completion of it gives.
    raw = c.generate(model=server.model, prompt="The capital of France is", raw=True, options=opts)
    comp = server.client().completions.create(model=server.model, prompt="The capital of France is",
                                              max_tokens=8, temperature=0)
    assert raw.response == comp.choices[0].text
    # `context` continues an earlier exchange.
    more = c.generate(model=server.model, prompt="And of Italy?", context=g.context, options=opts)
    assert more.prompt_eval_count > len(g.context)
    # Nothing to generate: the model is loaded.
    assert c.generate(model=server.model).done_reason == "load"
    assert c.chat(model=server.model, messages=[]).done_reason == "load"


def test_ollama_embed_and_embeddings(server):
    c = llama(server)
    e = c.embed(model=server.model, input=["hello", "world"])
    assert len(e.embeddings) == 2 and e.prompt_eval_count > 0
    for v in e.embeddings:
        assert abs(sum(x * x for x in v) - 1) < 1e-4  # unit length, as Ollama's
    raw = c.embeddings(model=server.model, prompt="hello").embedding
    norm = sum(x * x for x in raw) ** 0.5
    assert max(abs(a - b / norm) for a, b in zip(e.embeddings[0], raw)) < 1e-5
    cut = c.embed(model=server.model, input="hello", dimensions=64).embeddings[0]
    assert len(cut) == 64 and abs(sum(x * x for x in cut) - 1) < 1e-4


def test_ollama_list_show_ps_pull(server):
    c = llama(server)
    (m,) = c.list().models
    assert m.model == server.model + ":latest" and m.size > 0 and m.details.family == "llama"
    s = c.show(server.model)
    assert s.modelinfo["general.architecture"] == "llama" and "completion" in s.capabilities
    assert "im_start" in s.template
    (p,) = c.ps().models
    assert p.model == m.model and p.context_length > 0 and p.size >= m.size
    # Pulling what is served: there already.
    assert c.pull(server.model).status == "success"
    assert [x.status for x in c.pull(server.model, stream=True)][-1] == "success"


def test_ollama_errors_in_its_shape(server):
    c = llama(server)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="no-such-model", messages=HI)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=server.model, messages=HI, options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.base).list()  # no API key
    assert e.value.status_code == 401
    r = server.raw("POST", "/api/chat", json={"model": server.model, "messages": [
        {"role": "user", "content": "What is this?", "images": ["aGk="]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]
    # What Ollama's API does not know is left out, as Ollama does (Open WebUI passes on
    # custom options and fields); what would change the answer is refused by name.
    r = server.raw("POST", "/api/chat", json={"model": server.model, "messages": HI, "stream": False,
                                               "tool_ids": ["x"], "options": {"my_param": 1, "num_predict": 2}})
    assert r.status_code == 200 and r.json()["done"], r.text
    r = server.raw("POST", "/api/generate", json={"model": server.model, "prompt": "hi", "template": "{{ .Prompt }}"})
    assert r.status_code == 400 and "template" in r.json()["error"]
    # The guard's refusals come in Ollama's shape too.
    r = httpx.post(server.base + "/api/chat", content=b"{}", headers={"Authorization": f"Bearer {API_KEY}",
                                                                   "Content-Type": "text/plain"})
    assert r.status_code == 415 and "Content-Type" in r.json()["error"]
