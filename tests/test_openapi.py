"""The OpenAPI document says what the server does (statuses, content types, bounds), and the request bodies refuse
what the document refuses: each case here is one that schemathesis found (tests/test_openapi_fuzz.py runs it).
Against the suite's shared `pagoda serve` of the default model."""

from __future__ import annotations

import httpx
import pytest

from tests.test_server import MODEL

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


@pytest.fixture(scope="module")
def url(default_server) -> str:
    return default_server.url


@pytest.fixture(scope="module")
def schema(url) -> dict:
    return httpx.get(f"{url}/openapi.json", timeout=30).json()


def post(url: str, path: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):  # JSON text as sent, e.g. with NaN, which json= refuses to write
        return httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_validation_errors_are_documented_as_the_400s_they_are(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429", "503"} <= set(chat)
    for status in ("400", "404", "413", "429", "503"):
        assert chat[status]["content"]["application/json"]["schema"] == ERROR_REF
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "404" in schema["paths"]["/v1/models/{model}"]["get"]["responses"]
    assert "404" in schema["paths"]["/v1/responses/{response_id}"]["delete"]["responses"]


def test_health_and_metrics_are_documented_with_their_content_types(url, schema):
    health = schema["paths"]["/health"]["get"]["responses"]
    assert not health["200"].get("content") and health["503"]["content"]["application/json"]["schema"] == ERROR_REF
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200 and r.content == b""
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert httpx.get(f"{url}/metrics").headers["content-type"].startswith("text/plain")


def test_token_ids_are_bounded_by_the_vocabulary_in_the_document(schema):
    tokens = schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"] == {"type": "integer", "minimum": 0, "maximum": 49151}  # SmolLM2's 49,152 tokens
    dimensions = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]["dimensions"]
    assert dimensions["anyOf"][0]["const"] == 576


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/detokenize", {"tokens": [False]}, "tokens[0]"),
        ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
        ("/detokenize", {"tokens": ["7"]}, "tokens[0]"),
        ("/v1/completions", {"prompt": [[False]], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [True], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "echo": 0}, "echo"),
        ("/v1/embeddings", {"input": [False]}, "input"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": True}, "n"),
    ],
)
def test_booleans_are_not_integers_and_integers_not_booleans(url, path, body, param):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_an_integral_float_is_an_integer(url):
    r = post(url, "/detokenize", {"tokens": [42.0]})  # JSON Schema's integer: 42.0 is one
    assert r.status_code == 200 and r.json()["prompt"] == post(url, "/detokenize", {"tokens": [42]}).json()["prompt"]


def test_nan_and_infinity_are_refused_by_name(url):
    r = post(url, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}')
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "temperature is not a number (NaN)",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }
    r = post(url, "/v1/completions", '{"prompt": "Hi", "top_p": Infinity}')
    assert r.status_code == 400 and r.json()["error"]["message"] == "top_p must be finite"


def test_a_missing_body_and_empty_lists_are_400s(url):
    r = httpx.post(f"{url}/v1/completions", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request needs a JSON body"
    for path, body, param in [
        ("/tokenize", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/responses", {"input": []}, "input"),
    ]:
        r = post(url, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_bounds_the_engine_checks_are_checked_and_documented(url, schema):
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert completion["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    r = post(url, "/v1/completions", {"prompt": "Hi", "stop": ["x"] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_a_405_allows_every_method_of_the_path(url):
    r = httpx.request("OPTIONS", f"{url}/v1/responses/resp_x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    assert "OPTIONS /v1/responses/resp_x" in r.json()["error"]["message"]


def test_the_documented_shapes_are_still_served(url):
    # The strict types refuse nothing a client sends in the right type.
    r = post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": [[1, 2, 3]], "max_tokens": 2, "echo": False, "n": 1, "best_of": 1, "stream": False},
    )
    assert r.status_code == 200, r.text
    r = post(url, "/tokenize", {"prompt": "Hi", "messages": None})
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_a_top_p_too_small_for_float32_keeps_the_top_token_and_the_engine_alive(url):
    # Found by schemathesis: 1e-50 is a valid top_p (> 0), but 0 in the sampler's float32, which kept no token
    # and killed the engine loop (every later request 503).
    for top_k in (0, 5):
        r = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "top_p": 1e-50, "top_k": top_k})
        assert r.status_code == 200, r.text
    greedy = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}).json()
    assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]  # only the top token is left
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_reasoning_item_with_text_content_is_taken(url):
    # Found by schemathesis: a reasoning input item whose content is a string (as a message's may be) was a 500.
    body = {
        "input": [{"type": "reasoning", "content": "Thinking."}, {"role": "user", "content": "Hi"}],
        "max_output_tokens": 1,
        "store": False,
    }
    r = post(url, "/v1/responses", body)
    assert r.status_code == 200, r.text
