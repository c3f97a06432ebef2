"""A request is validated once: the server (through AsyncEngine.new_request) checks each prompt, and neither
AsyncEngine nor LLMEngine checks it again; the 400s stay OpenAI-shaped, with their param. The offline
LLM.generate path still validates."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine import LLM, EngineConfig, InvalidParameter, SamplingParams
from engine.async_engine import AsyncEngine
from server.api import ServerSettings, build_app

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine(default_model_dir):
    engine = AsyncEngine(EngineConfig(model=str(default_model_dir), dtype="float32", device="cpu", max_model_len=256))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture
def checks(engine, monkeypatch):
    """Every check_request call on the engine, as (prompt length, max_tokens)."""
    calls = []
    real = engine.engine.check_request

    def counted(token_ids, params):
        calls.append((len(token_ids), params.max_tokens))
        return real(token_ids, params)

    monkeypatch.setattr(engine.engine, "check_request", counted)
    return calls


def post(engine, path: str, body: dict) -> httpx.Response:
    app = build_app(engine, ServerSettings([MODEL], "unused"))  # the engine runs already: no lifespan needed

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body, timeout=120)

    return asyncio.run(main())


def test_one_chat_request_is_checked_once(engine, checks):
    reply = post(engine, "/v1/chat/completions", CHAT)
    assert reply.status_code == 200, reply.text
    assert len(checks) == 1
    assert checks[0] == (reply.json()["usage"]["prompt_tokens"], 2)


def test_each_prompt_of_a_completion_is_checked_once(engine, checks):
    reply = post(engine, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3, 4, 5], [6]], "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert sorted(checks) == [(1, 1), (2, 1), (3, 1)]


def test_a_bad_prompt_in_a_list_is_a_400_and_queues_nothing(engine, checks):
    reply = post(engine, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [1] * 300], "max_tokens": 1})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt" and reply.json()["error"]["type"] == "invalid_request_error"
    assert checks == [(2, 1), (300, 1)]
    assert not engine.engine.has_unfinished_requests()


def test_chat_errors_name_the_parameter_the_client_sent(engine, checks):
    reply = post(engine, "/v1/chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 1000})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_completion_tokens"
    assert len(checks) == 1


def test_async_engine_generate_checks_once(engine, checks):
    async def main():
        return [out async for out in engine.generate("gen-1", [1, 2, 3], SamplingParams(max_tokens=2))]

    assert asyncio.run(main())[-1].finished
    assert checks == [(3, 2)]


def test_the_offline_path_still_validates(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(InvalidParameter) as err:
        llm.generate([[1] * 100], SamplingParams(max_tokens=1), use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameter) as err:
        llm.generate([[1, 2]], SamplingParams(max_tokens=100), use_tqdm=False)
    assert err.value.param == "max_tokens"
