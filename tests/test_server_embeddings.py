"""POST /v1/embeddings end to end: the suite's `pagoda serve` of the default model, the real `openai` SDK
and LangChain's OpenAIEmbeddings as clients, vectors checked against the offline LLM.embed."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from engine import LLM
from tests.conftest import KV_BYTES
from tests.test_server import LONG_PROMPT, MODEL, scrape

HIDDEN = 576  # SmolLM2-135M's hidden size
TEXTS = ["The capital of France is Paris.", "Bees make honey.", "A train left the station at noon, late again."]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_client(server):
    # An async client belongs to one event loop, so each asyncio.run gets its own.
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(default_model_dir):
    """The same model offline, as the server runs it (float32, its context length)."""
    return LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=1024, cpu_kv_cache_bytes=KV_BYTES)


def embed_offline(llm: LLM, prompts) -> np.ndarray:
    return np.array([out.embedding for out in llm.embed(prompts, use_tqdm=False)])


def test_a_batch_of_texts_equals_the_offline_vectors(client, offline):
    reply = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert reply.object == "list" and reply.model == MODEL
    assert [d.index for d in reply.data] == [0, 1, 2] and all(d.object == "embedding" for d in reply.data)
    got = np.array([d.embedding for d in reply.data])
    assert got.shape == (3, HIDDEN)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    want = embed_offline(offline, TEXTS)
    assert np.abs(got - want).max() < 1e-5
    lengths = [len(offline.tokenizer.encode(t)) for t in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(lengths)
    single = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert len(single.data) == 1 and single.usage.prompt_tokens == lengths[1]
    assert np.abs(np.array(single.data[0].embedding) - want[1]).max() < 1e-5


def test_base64_and_float_encodings_agree(client, server):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    # The SDK asks for base64 when no format is given, and decodes it back to floats.
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)
    for a, b in zip(floats.data, decoded.data):
        assert np.array_equal(np.float32(a.embedding), np.float32(b.embedding))
    # Little-endian float32, read without the SDK. (The same batch as above: a step's batch can change the
    # last bits of a vector, as matrix products of other sizes round differently.)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": TEXTS, "encoding_format": "base64"})
    for item, want in zip(raw.json()["data"], floats.data):
        vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert np.array_equal(vector, np.float32(want.embedding))


def test_token_id_inputs(client, offline):
    ids = [offline.tokenizer.encode(t) for t in TEXTS]
    texts = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    lists = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[2], encoding_format="float")
    assert lists.usage.prompt_tokens == sum(map(len, ids)) and one.usage.prompt_tokens == len(ids[2])
    for a, b in zip(texts.data, lists.data):
        assert np.abs(np.array(a.embedding) - np.array(b.embedding)).max() < 1e-5
    assert np.abs(np.array(one.data[0].embedding) - np.array(texts.data[2].embedding)).max() < 1e-5
    assert client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=HIDDEN).data


def test_embeddings_beside_a_stream_and_in_the_metrics(async_client, client, server):
    reference = client.completions.create(model=MODEL, prompt="The alphabet:", temperature=0, max_tokens=10)
    before = scrape(server.url)

    async def main():
        c = async_client()
        stream = await c.completions.create(
            model=MODEL, prompt="The alphabet:", temperature=0, max_tokens=10, stream=True
        )
        replies = await asyncio.gather(*(c.embeddings.create(model=MODEL, input=TEXTS) for _ in range(4)))
        text = "".join([chunk.choices[0].text async for chunk in stream])
        return text, replies

    text, replies = asyncio.run(main())
    assert text == reference.choices[0].text
    assert all(np.array_equal(r.data[1].embedding, replies[0].data[1].embedding) for r in replies)
    after = scrape(server.url)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    # Each input is an engine request that finishes with "stop"; the completion ends by length.
    assert moved("pagoda:request_success_total", (("finished_reason", "stop"),)) == 4 * len(TEXTS)
    assert moved("pagoda:request_success_total", (("finished_reason", "length"),)) == 1
    want = reference.usage.prompt_tokens + 4 * replies[0].usage.prompt_tokens
    assert moved("pagoda:prompt_tokens_total") == want
    assert moved("pagoda:generation_tokens_total") == 10
    assert after[("pagoda:num_requests_running", ())] == 0 and after[("pagoda:kv_cache_usage_perc", ())] == 0


ERRORS = [
    # (body, status, param, words in the message)
    ({"input": []}, 400, "input", "empty"),
    ({"input": ""}, 400, "input", "empty string"),
    ({"input": ["fine", ""]}, 400, "input", "input[1]"),
    ({"input": [[1, 2], []]}, 400, "input", "empty"),
    ({"input": [1, 2, 10**9]}, 400, "input", "vocabulary"),
    ({"input": ["fine", LONG_PROMPT]}, 400, "input", "context length"),
    ({"input": "hi", "dimensions": 64}, 400, "dimensions", str(HIDDEN)),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", ""),
    ({"input": "hi", "pooling": "max"}, 400, "pooling", ""),
    ({"input": [{"text": "hi"}]}, 400, "input", ""),
    ({}, 400, "input", ""),
    ({"input": "hi", "model": "text-embedding-3-small"}, 404, "model", ""),
]


@pytest.mark.parametrize("body,status,param,words", ERRORS, ids=[f"{e[2]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_are_openai_shaped(server, body, status, param, words):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"] and "Traceback" not in r.text


def test_sdk_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="hi", dimensions=256)
    assert err.value.body["param"] == "dimensions" and "576" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")


def test_langchain_openai_embeddings(server, offline):
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(
        base_url=f"{server.url}/v1", api_key="unused", model=MODEL, check_embedding_ctx_length=False, max_retries=0
    )
    got = np.array(embedder.embed_documents(TEXTS))
    assert np.abs(got - embed_offline(offline, TEXTS)).max() < 1e-5
    assert np.abs(np.array(embedder.embed_query(TEXTS[0])) - got[0]).max() < 1e-5
