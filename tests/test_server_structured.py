"""Structured outputs, tool calling and reasoning through a real `pagoda serve`, with the clients applications
use: the openai SDK (parse() with pydantic models, tools, streaming) and LangChain's ChatOpenAI.

The server runs the default model behind a Qwen3-style chat template written for these tests
(tests/data/qwen3_style.jinja), with the hermes tool-call parser and the qwen3 reasoning parser, as a
Qwen3 deployment would. Every schema bounds its strings and arrays, so the grammar ends each output
within max_tokens whatever the small model prefers to write.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server import MODEL, SERVER_FLAGS, start_server

TEMPLATE = Path(__file__).parent / "data" / "qwen3_style.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("structured"),
        *SERVER_FLAGS,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        str(TEMPLATE),
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Reply in JSON."}])
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(model=MODEL, temperature=0, **kw)


# ----- response_format -----


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    favourite: Color
    address: Address
    nickname: str | None = Field(default=None, max_length=12)
    hobbies: list[str] = Field(max_length=3)


class Inventory(BaseModel):
    items: list[Address] = Field(max_length=2)
    total: float


@pytest.mark.parametrize("model", [Person, Address, Inventory])
def test_sdk_parse_returns_pydantic_objects(client, model):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": f"Make up an example {model.__name__.lower()}."}],
        response_format=model,
        temperature=0,
        max_tokens=200,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, model)
    assert model.model_validate_json(message.content) == message.parsed


def _bounded_string(n: int = 12) -> dict:
    return {"type": "string", "maxLength": n}


# A small model may write digits forever where nothing bounds them.
INT = {"type": "integer", "minimum": 0, "maximum": 999}


SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"word": _bounded_string()}, "required": ["word"]},
    {"type": "object", "properties": {"c": {"enum": ["cat", "dog", "bird"]}}, "required": ["c"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
    {
        "type": "object",
        "properties": {"list": {"type": "array", "items": INT, "minItems": 1, "maxItems": 3}},
        "required": ["list"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _bounded_string(6), "maxItems": 2}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"a": INT}, "required": ["a"]}},
        "required": ["inner"],
    },
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 5}}, "required": ["maybe"]},
    {
        "type": "object",
        "properties": {"kind": {"anyOf": [INT, {"type": "boolean"}]}},
        "required": ["kind"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
        "required": ["code"],
    },
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": _bounded_string(8), "minItems": 1, "maxItems": 2},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": INT, "y": INT},
                    "required": ["x", "y"],
                },
                "maxItems": 2,
            }
        },
        "required": ["points"],
    },
    {
        "type": "object",
        "properties": {"ref": {"$ref": "#/$defs/item"}},
        "required": ["ref"],
        "$defs": {"item": {"type": "object", "properties": {"id": INT}, "required": ["id"]}},
    },
    {
        "type": "object",
        "properties": {"first": _bounded_string(8), "second": INT, "third": {"type": "boolean"}},
        "required": ["first", "second", "third"],
    },
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["ratio"]},
]


def test_json_schema_outputs_validate_over_many_schemas(server):
    """All the schemas at once, as one batch of concurrent requests: each output parses and validates."""

    async def one(client, i, schema):
        response = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Example {i}: answer with JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            temperature=0,
            max_tokens=120,
        )
        return response.choices[0]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i, s) for i, s in enumerate(SCHEMAS)))

    assert len(SCHEMAS) >= 20
    for schema, choice in zip(SCHEMAS, asyncio.run(run())):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_mode(client):
    messages = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    choice = chat(client, messages=messages, response_format={"type": "json_object"}, max_tokens=60).choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def test_vllm_structured_outputs_and_guided_fields(client):
    regex = r"[A-Z][a-z]{2,6} [0-9]{3}"
    choices = ["Paris", "Rome", "Berlin"]
    cases = [
        ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"guided_json": {"type": "object", "properties": {"k": INT}, "required": ["k"]}}, None),
        ({"structured_outputs": {"grammar": 'root ::= "<" [a-z]+ ">"'}}, lambda t: re.fullmatch(r"<[a-z]+>", t)),
    ]
    for extra, check in cases:
        text = chat(client, messages=[{"role": "user", "content": "Capital of France?"}], extra_body=extra)
        text = text.choices[0].message.content
        if check is None:
            assert isinstance(json.loads(text)["k"], int)
        else:
            assert check(text), (extra, text)
        # Completions take them too.
        completion = client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=40, temperature=0, extra_body=extra
        )
        if check is not None:
            assert check(completion.choices[0].text), (extra, completion.choices[0].text)


def test_streamed_constrained_output_equals_non_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    whole = chat(client, response_format=fmt).choices[0].message.content
    stream = chat(client, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    Person.model_validate_json(whole)


def test_max_tokens_mid_object_is_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    choice = chat(client, response_format=fmt, max_tokens=6).choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_bad_schemas_get_400_naming_the_field_and_others_run_on(server, client):
    good = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[0]}}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"guided_regex": "a("}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= nothing"}}}, "structured_outputs.grammar"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as aclient:
            ok = asyncio.ensure_future(
                aclient.chat.completions.create(
                    model=MODEL, messages=ASK_WEATHER, response_format=good, temperature=0, max_tokens=40
                )
            )
            errors = []
            for kw, _ in cases:
                try:
                    await aclient.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, **kw)
                    errors.append(None)
                except openai.BadRequestError as exc:
                    errors.append(exc)
            return errors, await ok

    errors, ok = asyncio.run(run())
    for (kw, param), exc in zip(cases, errors):
        assert exc is not None, kw
        assert exc.status_code == 400 and exc.body["param"] == param, (kw, exc.body)
        assert "Traceback" not in exc.body["message"] and "/project/" not in exc.body["message"]
    jsonschema.validate(json.loads(ok.choices[0].message.content), SCHEMAS[0])
    assert httpx.get(f"{server.url}/health").status_code == 200


# ----- tools -----


def rendered(server, **body) -> str:
    """The prompt the server's template makes of a chat (/tokenize), special tokens included."""
    from transformers import AutoTokenizer

    from engine.default_model import default_model_dir

    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    return AutoTokenizer.from_pretrained(str(default_model_dir())).decode(tokens)


def _validate_call(call) -> dict:
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, spec)
    assert call.id.startswith("call_") and call.type == "function"
    return args


def _streamed_calls(stream) -> tuple[list[dict], str, str | None]:
    """Tool calls assembled from stream deltas as the openai SDK's users do; plus content and finish_reason."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id:
                    assert call["id"] is None, "the id comes once, first"
                    call["id"], call["name"] = piece.id, piece.function.name
                assert call["id"] is not None, "the first delta of a call carries its id and name"
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_valid_calls(client, parallel):
    kw = dict(messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
    response = chat(client, **kw)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        _validate_call(call)
    streamed, content, finish = _streamed_calls(chat(client, stream=True, **kw))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]


def test_named_tool_choice_returns_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named)
    choice = chat(client, **kw).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "tool_calls"
    _validate_call(call)
    streamed, content, finish = _streamed_calls(chat(client, stream=True, **kw))
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_time", call.function.arguments)]
    assert finish == "tool_calls" and content == ""


def test_auto_tool_choice_parses_the_models_calls(client):
    """The model's own hermes-format output (held to that format by a regex so the small model writes it)
    is parsed into calls, streamed and not; the markup never reaches content."""
    regex = (
        r'I will check\.\n<tool_call>\n\{"name": "get_weather", '
        r'"arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>'
    )
    kw = dict(messages=ASK_WEATHER, tools=[WEATHER, TIME], extra_body={"guided_regex": regex})
    choice = chat(client, **kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check.\n"
    (call,) = choice.message.tool_calls
    args = _validate_call(call)
    streamed, content, finish = _streamed_calls(chat(client, stream=True, **kw))
    assert content == choice.message.content and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", args)]


def test_auto_without_a_call_is_content(client):
    choice = chat(client, messages=[{"role": "user", "content": "Say hi."}], tools=[WEATHER], max_tokens=12).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert "<tool_call>" not in choice.message.content


def test_tool_history_is_rendered_by_the_template(server, client):
    history = ASK_WEATHER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    text = rendered(server, messages=history, tools=[WEATHER])
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert '"name": "get_weather"' in text.split("<tools>")[1].split("</tools>")[0]
    response = chat(client, messages=history, tools=[WEATHER], max_tokens=16)
    assert response.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages=ASK_WEATHER + [{"role": "tool", "content": "x"}], max_tokens=4)
    assert info.value.body["param"] == "messages[1].tool_call_id"


def test_bad_tool_requests_are_400(client):
    cases = [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=[WEATHER]), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, messages=ASK_WEATHER, max_tokens=4, **kw)
        assert info.value.body["param"] == param, (kw, info.value.body)


# ----- reasoning and templates -----


def test_reasoning_content_is_split_from_the_answer(client):
    regex = r"<think>\n[a-z ]{8,30}\n</think>\n\n[A-Z][a-z ]{4,30}\."
    kw = dict(messages=[{"role": "user", "content": "Think, then answer."}], extra_body={"guided_regex": regex})
    message = chat(client, **kw).choices[0].message
    assert message.reasoning_content and message.content
    assert "<think>" not in message.content and "</think>" not in message.reasoning_content
    reasoning = content = ""
    for chunk in chat(client, stream=True, **kw):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_chat_template_kwargs_reach_the_template(server):
    assert rendered(server, messages=ASK_WEATHER).endswith("<|im_start|>assistant\n")
    text = rendered(server, messages=ASK_WEATHER, chat_template_kwargs={"enable_thinking": False})
    assert text.endswith("<think>\n\n</think>\n\n")


def test_langchain_structured_output_and_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=200)
    person = llm.with_structured_output(Address).invoke("Make up an address.")
    assert isinstance(person, Address)

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls[:1]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    # tool_choice left to the model ("auto"): whatever it writes comes back as an AIMessage.
    assert llm.bind_tools([get_weather]).invoke("Hello!").content is not None
