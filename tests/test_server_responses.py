"""The Responses API (/v1/responses) through a real `pagoda serve` and the openai SDK's responses client:
create, stream, parse, tools, stored conversations, retrieve, and the refusals.

The server is set up as tests/test_server_structured.py's (the Qwen3-style template, the hermes tool-call
parser, the qwen3 reasoning parser), so that the chat endpoint of the same server is the reference: a
response's greedy text and its prompt must be the chat endpoint's for the same messages. The reasoning
item, which the small model never writes unprompted, is checked on the event writer directly.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server import MODEL, SERVER_FLAGS, scrape, start_server
from tests.test_server_structured import TEMPLATE, TIME, WEATHER

FRANCE = "What is the capital of France?"
# The Responses API's flat function tool shape.
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
TIME_TOOL = {"type": "function", **TIME["function"]}
STORED = 4  # --max-stored-responses


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("responses"),
        *SERVER_FLAGS,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        str(TEMPLATE),
        "--max-stored-responses",
        str(STORED),
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def respond(client, **kw):
    kw.setdefault("max_output_tokens", 24)
    return client.responses.create(model=MODEL, temperature=0, **kw)


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def prompt_tokens(server, messages, **kw) -> int:
    """The length of the prompt the server's template makes of chat messages (/tokenize)."""
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages, **kw}).json()["count"]


def summary(response) -> dict:
    """A response's content, without the ids that differ between two runs of the same output."""
    items = []
    for item in response.output:
        if item.type == "message":
            items.append(("message", item.status, [(part.type, part.text, part.annotations) for part in item.content]))
        elif item.type == "function_call":
            items.append(("function_call", item.status, item.name, item.arguments))
        else:
            items.append((item.type, item.status))
    return {"status": response.status, "items": items, "usage": response.usage.model_dump()}


# ----- create -----


def test_greedy_text_and_usage_equal_the_chat_endpoints(client):
    response = respond(client, input=FRANCE)
    reference = chat(client, [{"role": "user", "content": FRANCE}])
    assert response.output_text == reference.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "completed" and response.incomplete_details is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].annotations == []
    usage = response.usage
    assert usage.input_tokens == reference.usage.prompt_tokens
    assert usage.output_tokens == reference.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_and_input_parts_reach_the_prompt(server, client):
    instructions = "You are a pirate. Answer in one sentence."
    parts = [{"type": "input_text", "text": "Hello!"}, {"type": "input_text", "text": "Who are you?"}]
    response = respond(client, instructions=instructions, input=[{"role": "user", "content": parts}])
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "Hello!\nWho are you?"}]
    reference = chat(client, messages)
    assert response.output_text == reference.choices[0].message.content
    assert response.usage.input_tokens == reference.usage.prompt_tokens == prompt_tokens(server, messages)
    assert response.instructions == instructions
    # A developer message in the input is a system message too.
    developer = respond(client, input=[{"role": "developer", "content": instructions}, *messages[1:]])
    assert developer.output_text == response.output_text


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = respond(client, input=FRANCE, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete" and response.usage.output_tokens == 3
    events = list(respond(client, input=FRANCE, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert summary(events[-1].response) == summary(response)


# ----- streaming -----

ITEM_EVENTS = {
    "message": r"added part\.added (output_text\.delta )*output_text\.done part\.done done",
    "function_call": r"added (function_call_arguments\.delta )*function_call_arguments\.done done",
}


def check_event_order(events) -> None:
    """Sequence numbers count up from 0; created, in_progress, then each output item's events in its order,
    item after item, and the final response last."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type in ("response.completed", "response.incomplete")
    per_item: list[tuple[str, list[str]]] = []
    for event in events[2:-1]:
        name = event.type.removeprefix("response.").replace("output_item.", "").replace("content_part.", "part.")
        if event.type == "response.output_item.added":
            assert event.output_index == len(per_item)
            per_item.append((event.item.type, []))
        assert event.output_index == len(per_item) - 1, "an event of an item that is not the open one"
        per_item[-1][1].append(name)
    assert len(per_item) == len(events[-1].response.output)
    for kind, names in per_item:
        assert re.fullmatch(ITEM_EVENTS[kind], " ".join(names)), (kind, names)


def test_stream_equals_the_non_streamed_response(client):
    kw = dict(input="Name a colour, in one short sentence.", max_output_tokens=24)
    whole = respond(client, **kw)
    events = list(respond(client, stream=True, **kw))
    check_event_order(events)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == whole.output_text
    assert summary(events[-1].response) == summary(whole)
    # The SDK's stream helper assembles the same response.
    with client.responses.stream(model=MODEL, temperature=0, **kw) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text and final.status == "completed"
    assert summary(final) == summary(whole)


# ----- structured output and tools -----


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


def test_parse_returns_a_valid_instance(client):
    response = client.responses.parse(
        model=MODEL, input="Make up an address.", text_format=Address, temperature=0, max_output_tokens=80
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Address)
    assert Address.model_validate_json(response.output_text) == response.output_parsed
    assert response.text.format.type == "json_schema"


def _check_call(item) -> dict:
    spec = {t["name"]: t["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}[item.name]
    args = json.loads(item.arguments)
    jsonschema.validate(args, spec)
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    return args


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_time"}], ids=["required", "named"]
)
def test_tool_choice_yields_function_calls_streamed_alike(client, tool_choice):
    kw = dict(
        input="What is the weather in Paris? Use the tools.",
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
        max_output_tokens=60,
    )
    response = respond(client, **kw)
    assert response.status == "completed" and response.output
    assert all(item.type == "function_call" for item in response.output) and response.output_text == ""
    for item in response.output:
        _check_call(item)
    if tool_choice != "required":
        assert [item.name for item in response.output] == ["get_time"]
    events = list(respond(client, stream=True, **kw))
    check_event_order(events)
    assert summary(events[-1].response) == summary(response)
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]


def test_tool_call_history_renders_as_chat_does(server, client):
    """A function_call and its function_call_output in the input render as an assistant tool call and a tool
    message; the assistant output items of one turn (reasoning, message, call) are one assistant message."""
    arguments = '{"city": "Paris", "unit": "celsius"}'
    turn = [
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Look it up."}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"},
    ]
    question = "What is the weather in Paris?"
    response = respond(
        client, input=[{"role": "user", "content": question}, *turn], tools=[WEATHER_TOOL], tool_choice="none"
    )
    messages = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    reference = chat(client, messages, tools=[WEATHER], tool_choice="none")
    assert response.usage.input_tokens == prompt_tokens(server, messages, tools=[WEATHER])
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.output_text == reference.choices[0].message.content


# ----- stored responses -----


def test_previous_response_id_continues_the_conversation(server, client):
    first = respond(client, input="Hi, my name is Bob.", max_output_tokens=8)
    second = respond(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=8)
    history = [
        {"role": "user", "content": "Hi, my name is Bob."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(server, history)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == chat(client, history, max_tokens=8).choices[0].message.content
    # A response's instructions lead its own prompt and do not carry over to the next response.
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}]
    third = respond(
        client, instructions="Be brief.", input="Thanks.", previous_response_id=second.id, max_output_tokens=2
    )
    assert third.usage.input_tokens == prompt_tokens(server, [{"role": "system", "content": "Be brief."}, *history])
    history += [{"role": "assistant", "content": third.output_text}, {"role": "user", "content": "Bye."}]
    fourth = respond(client, input="Bye.", previous_response_id=third.id, max_output_tokens=2)
    assert fourth.usage.input_tokens == prompt_tokens(server, history)


def test_retrieve_delete_and_the_bounded_store(client):
    kept = respond(client, input="Hello.", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    unstored = respond(client, input="Hello.", max_output_tokens=2, store=False)
    for call in (lambda: client.responses.retrieve(unstored.id), lambda: client.responses.retrieve("resp_unknown")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as info:
        respond(client, input="Hi.", previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(kept.id)
    assert info.value.body["param"] == "response_id"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    # The store keeps the last STORED responses; the oldest is dropped first.
    made = [respond(client, input=f"Count {i}.", max_output_tokens=1) for i in range(STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0].id)
    assert client.responses.retrieve(made[-1].id).id == made[-1].id


def test_metrics_count_responses(server, client):
    before = scrape(server.url)
    response = respond(client, input=FRANCE, max_output_tokens=3)
    after = scrape(server.url)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("pagoda:prompt_tokens_total") == response.usage.input_tokens
    assert moved("pagoda:request_success_total", (("finished_reason", "length"),)) == 1


# ----- refusals -----


def test_unsupported_tools_fields_and_items_are_400_naming_the_param(client):
    cases = [
        (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(tools=[WEATHER_TOOL, {"type": "file_search", "vector_store_ids": ["vs_1"]}]), "tools[1].type"),
        (dict(tools=[{"type": "function", "name": "bad name!"}]), "tools[0].name"),
        (dict(tools=[WEATHER_TOOL], tool_choice={"type": "web_search_preview"}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(background=True), "background"),
        (dict(include=["reasoning.encrypted_content"]), "include"),
        (dict(truncation="auto"), "truncation"),
        (dict(reasoning={"effort": "high"}), "reasoning"),
        (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            "input[0].content[0].type",
        ),
        (dict(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
        (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
        (dict(input=[]), "input"),
        (
            dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}),
            "text.format.schema",
        ),
        (dict(text={"format": {"type": "json_object"}}, tools=[WEATHER_TOOL], tool_choice="required"), "text.format"),
        (dict(max_output_tokens=5000), "max_output_tokens"),
        (dict(extra_body={"frequency": 1}), "frequency"),
    ]
    for kw, param in cases:
        kw.setdefault("input", "Hi.")
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, **kw)
        assert info.value.body["param"] == param, (kw, info.value.body)
        assert "Traceback" not in info.value.body["message"]
        if param == "include":  # what pagoda does not do is said so, not as a list-length rule
            assert "not supported" in info.value.body["message"], info.value.body
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="gpt-4o", input="Hi.")
    assert info.value.body["param"] == "model"


# ----- the event writer, with reasoning -----


def test_reasoning_item_streamed_and_whole_alike():
    """A reasoning model's output, split at every character: the stream's items equal the whole output's."""
    from engine.sequence import CompletionOutput, RequestOutput
    from server.chat import ChatOptions, OutputParser, ToolPlan
    from server.reasoning import Qwen3ReasoningParser
    from server.responses import EventWriter, ResponseObject, output_items

    parser = OutputParser(ToolPlan("none"), ChatOptions(reasoning_parser=Qwen3ReasoningParser))
    draft = ResponseObject(
        id="resp_1", created_at=0, model=MODEL, instructions=None, max_output_tokens=None,
        previous_response_id=None, parallel_tool_calls=True, temperature=0.0, top_p=1.0, tool_choice="auto",
        tools=[], text={"format": {"type": "text"}}, store=False, metadata={}, user=None,
    )  # fmt: skip
    for text, finish, kinds in [
        ("<think>\nThe user greets me.\n</think>\n\nHello there!", "stop", ["reasoning", "message"]),
        ("<think>\nStill thinking", "length", ["reasoning", "message"]),
        ("  Just an answer.", "stop", ["message"]),
    ]:
        writer = EventWriter(draft, parser.stream())
        stream = writer.opening()
        for end in range(1, len(text) + 1):
            done = finish if end == len(text) else None
            out = RequestOutput("r", None, [1], [CompletionOutput(0, text[:end], [2] * end, done)], done is not None)
            stream += writer.update(out)
        whole = output_items(parser, text, finish)
        strip = lambda items: [item.model_dump(exclude={"id"}) for item in items]  # noqa: E731
        assert strip(writer.items) == strip(whole) and [item.type for item in whole] == kinds, text
        assert whole[-1].status == ("incomplete" if finish == "length" else "completed")
        events = [json.loads(line[len("data: ") :]) for line in stream.splitlines() if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        parsed = parser.parse(text, finish)
        assert (reasoning or None, answer or None) == (parsed.reasoning, parsed.content), text
