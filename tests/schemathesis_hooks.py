"""Schemathesis hooks for tests/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS): generation is bounded to
a few tokens, so every generated request costs a few forward passes of the default model on a CPU.

Only lengths are cut, within the bounds the document states, so a valid request stays valid and an invalid one
stays invalid."""

from __future__ import annotations

import os

import schemathesis

_MAX_GENERATED = 4  # tokens per choice
_MAX_N = 2
_LENGTH_FIELDS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


@schemathesis.hook
def before_call(ctx, case, **kwargs) -> None:
    fields = _LENGTH_FIELDS.get(case.operation.path)
    body = case.body
    if fields is None or not isinstance(body, dict):
        return
    for name in fields:
        value = body.get(name)
        if value is None:
            body[name] = _MAX_GENERATED  # unset: up to the context length
        elif _is_integer(value) and value > _MAX_GENERATED:
            body[name] = _MAX_GENERATED
    if _is_integer(body.get("min_tokens")) and body["min_tokens"] > _MAX_GENERATED:
        body["min_tokens"] = _MAX_GENERATED
    if _is_integer(body.get("n")) and body["n"] > _MAX_N:
        body["n"] = _MAX_N


def _is_integer(value) -> bool:
    # 7.0 is a JSON integer too; 7.5 is not, and is left as it is (an invalid request stays invalid).
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()


# A schema-valid request may still be refused (400) for what JSON Schema cannot say: a value that must agree
# with another field or the server's configuration (tool_choice naming one of the tools, unique tool names,
# "auto" without --enable-auto-tool-choice, min_tokens <= max_tokens, a logit_bias key inside the vocabulary),
# or text that must parse (a regex, a grammar, a JSON schema to compile). Those refusals, and only those, are
# not failures: the error names one of these parameters.
_SEMANTIC_PARAMS = (
    "tools",
    "tool_choice",
    "min_tokens",
    "logit_bias",
    "guided_",
    "structured_outputs",
    "response_format",
    "text.format",
)


@schemathesis.hook
def filter_failure(ctx, failure, case, response) -> bool:
    if failure.code != "ST202" or response.status_code != 400:
        return True
    error = response.json().get("error") or {}
    keep = not (error.get("param") or "").startswith(_SEMANTIC_PARAMS)
    if not keep and os.environ.get("PAGODA_FUZZ_FILTERED"):  # a file to list the refusals let through, for review
        with open(os.environ["PAGODA_FUZZ_FILTERED"], "a") as out:
            out.write(f"{case.operation.path}\t{error.get('param')}\t{error.get('message')}\n")
    return keep
