"""Online serving benchmark (`pagoda bench serve`): streaming clients against any OpenAI-compatible server.

    python bench/latency.py --base-url http://127.0.0.1:8000 --max-concurrency 16 --num-prompts 200 \
        [--dataset-name random|corpus|repeat] [--endpoint /v1/completions|/v1/chat/completions] \
        [--request-rate 4 --burstiness 1] [--duration 60] [--num-warmups 4] [--goodput ttft:500 tpot:50] \
        [--result-file out.json | --result-dir DIR] [--save-detailed] [--label pagoda]
    python bench/latency.py --sweep-concurrency 1,4,16,64,256 --result-file pagoda.json --plot sweep.png
    python bench/latency.py plot pagoda.json vllm.json --out sweep.png     # one curve per result file

The same command measures `pagoda serve` and `vllm serve`. Every request streams (stream_options.include_usage)
and sets max_tokens and ignore_eos, so its output length is exact whatever the model says. Arrivals are all at
once (--request-rate inf, the default) or gamma-distributed gaps of mean 1/rate (shape --burstiness: 1 is a
Poisson process), optionally capped at --max-concurrency requests in flight, as `vllm bench serve` does.

Metrics are vLLM's: TTFT (send to first content chunk), TPOT per request ((e2e - ttft) / (output tokens - 1)),
ITL (every gap between successive content chunks of a stream, all streams pooled), E2E latency; each with mean,
median, std and percentiles; throughputs over the whole run's duration (first send to last response);
goodput = requests/s meeting every --goodput SLO. Output tokens come from the server's usage chunk and are
checked against max_tokens and against a tokenizer count of the streamed text (mismatches are counted).

Datasets:
  random  seeded random token ids (--random-input-len/--random-output-len/--random-range-ratio as in vLLM),
          sent as token-id prompts on /v1/completions (no tokenizer needed; vLLM accepts them too), decoded
          to text with the tokenizer for the chat endpoint.
  corpus  passages of a public-domain text, --input-len tokens each, --output-len tokens out. Default text:
          bench/data/jargon-file-4.4.7.txt (The Jargon File 4.4.7, from Debian's jargon-text; see its header).
  repeat  the speculative-decoding workload (bench/spec_workload.py): chat requests asking to repeat a passage of
          that text with one word changed, so most of the output is in the prompt (n-gram lookup finds it);
          --output-len tokens out; /v1/chat/completions only.
The tokenizer is the server's own (/tokenize and /detokenize, which pagoda and vLLM both serve: always the
served model's), or --tokenizer DIR_OR_ID for a local Hugging Face tokenizer.

A request that fails (connection refused, server killed mid-stream, HTTP 4xx/5xx, an error event) is counted
as failed with its error string; the run goes on. Exit status: 0, or 1 when some run completed no request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gzip
import itertools
import json
import math
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

from bench.cli import require_plotting

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "jargon-file-4.4.7.txt"
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


# ----- tokenizers: the server's own, or a local one -----


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ServerTokenizer:
    """The served model's tokenizer through /tokenize and /detokenize (pagoda and vLLM both serve them).

    The robust default: it is always the tokenizer of the model being measured, with nothing to download.
    Used only outside the timed part of a run (building prompts, checking token counts afterwards).
    """

    def __init__(self, base_url: str, model: str | None, headers: dict[str, str]):
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=120, trust_env=False)
        self.model = model

    def encode(self, text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False, **({"model": self.model} if self.model else {})}
        response = self.client.post("/tokenize", json=body)
        response.raise_for_status()
        return response.json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        body = {"tokens": ids, **({"model": self.model} if self.model else {})}
        response = self.client.post("/detokenize", json=body)
        response.raise_for_status()
        return response.json()["prompt"]

    def close(self) -> None:
        self.client.close()


class LocalTokenizer:
    """A Hugging Face tokenizer from a directory or a model id in the local cache."""

    def __init__(self, name: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(name)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


# ----- datasets -----


@dataclass
class Prompt:
    prompt: str | list[int]  # text, or token ids (random dataset on /v1/completions)
    prompt_len: int  # tokens as built; the server's usage.prompt_tokens replaces it once known
    output_len: int


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    """Lengths uniform in [floor(mean * (1 - r)), ceil(mean * (1 + r))], at least 1, as vLLM's random dataset."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_dataset(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    token_range: tuple[int, int] = (1000, 20000),
    tokenizer: Tokenizer | None = None,
) -> list[Prompt]:
    """`num` prompts of random token ids; decoded to text when a tokenizer is given (for chat).

    Ids come from token_range, below the vocabulary of any model in use and past the special tokens most
    tokenizers put first, so no tokenizer is needed to send them as token-id prompts.
    """
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens, out_lens = _lengths(rng, input_len, range_ratio, num), _lengths(rng, output_len, range_ratio, num)
    prompts = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        ids = rng.integers(token_range[0], token_range[1], size=int(n_in)).tolist()
        prompts.append(Prompt(tokenizer.decode(ids) if tokenizer else ids, int(n_in), int(n_out)))
    return prompts


def load_corpus(path: Path) -> list[str]:
    """The corpus's paragraphs, minus a leading '# ' header; a .gz is read compressed.

    Paragraphs are separated by blank lines (wrapped text, e.g. Debian's jargon.txt.gz) or, in a text with
    no blank line, are one a line (bench/data's excerpt).
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    while lines and lines[0].startswith("# "):
        lines.pop(0)
    paragraphs, current = [], []
    if all(line.strip() for line in lines):
        paragraphs = [line.strip() for line in lines]
    else:
        for line in [*lines, ""]:
            if line.strip():
                current.append(line.strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
    if not paragraphs:
        raise ValueError(f"{path}: no text")
    return paragraphs


def corpus_dataset(
    num: int, input_len: int, output_len: int, tokenizer: Tokenizer, seed: int = 0, path: Path = DEFAULT_CORPUS
) -> list[Prompt]:
    """`num` passages of the corpus, each starting at a random paragraph and cut to `input_len` tokens.

    The passage is sent as text (so the server's tokenizer is part of what is measured); re-encoding the cut
    text may differ by a token from input_len, which is why the server's usage.prompt_tokens is what counts.
    """
    paragraphs = load_corpus(path)
    rng = np.random.default_rng(seed)
    # Characters per token, from a sample, to take just enough text before tokenizing it.
    sample = "\n".join(paragraphs[:50])[:20000]
    chars_per_token = len(sample) / max(1, len(tokenizer.encode(sample)))
    want_chars = int(input_len * chars_per_token * 1.5) + 64
    prompts = []
    for _ in range(num):
        i, text = int(rng.integers(len(paragraphs))), ""
        while len(text) < want_chars:  # wraps around the end of the corpus
            text += paragraphs[i % len(paragraphs)] + "\n"
            i += 1
        ids = tokenizer.encode(text)[:input_len]
        prompts.append(Prompt(tokenizer.decode(ids), len(ids), output_len))
    return prompts


def encode_all(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids, 16 at a time: the server's tokenizer is one HTTP call a text (~50 ms on a busy server,
    which one after another made a 1,024-request run wait a minute before and after it)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(tokenizer.encode, texts))


def repeat_dataset(num: int, output_len: int, tokenizer: Tokenizer | None, seed: int = 0) -> list[Prompt]:
    """`num` chat prompts of the speculative-decoding workload (bench/spec_workload.py), on passages starting at
    lines seed * num onwards of the text: the runs of a sweep (seeds 0, 1, 2, ...) ask about passages no earlier
    run left in a prefix cache, as long as the text has lines enough (about 400)."""
    from bench.spec_workload import line_passages, prompt_of

    texts = [prompt_of(passage)[0]["content"] for passage in line_passages(num, first=seed * num)]
    counts = [len(ids) for ids in encode_all(tokenizer, texts)] if tokenizer else [0] * len(texts)
    return [Prompt(text, n, output_len) for text, n in zip(texts, counts)]


# ----- arrivals -----


def inter_arrival_times(rate: float, burstiness: float = 1.0, seed: int | None = 0) -> Iterator[float]:
    """Endless gaps (seconds) between successive request arrivals.

    Gamma with shape=burstiness and scale=1/(rate*burstiness): the mean gap is 1/rate whatever the
    burstiness; burstiness 1 is the exponential (a Poisson process), below 1 burstier, above 1 more even.
    rate inf: every gap is 0 (all requests at once).
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = np.random.default_rng(seed)
    while True:  # in blocks: one numpy call per 1024 gaps
        yield from rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=1024).tolist()


# ----- one streaming request -----


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens, else the dataset's count
    output_tokens: int = 0  # the server's usage.completion_tokens, else the tokenizer's count of the text
    max_tokens: int = 0
    usage_reported: bool = False
    tokenizer_output_tokens: int | None = None  # the cross-check, filled in after the run
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0  # seconds
    e2el: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    text: str = ""


def _content(event: dict, chat: bool) -> str | None:
    """The text a chunk carries, or None when it carries no token.

    Completions: every chunk with a choice is a token's chunk (as vllm bench counts them; a token whose text
    is held back may come with empty text). Chat: only deltas with content count; the opening role chunk
    (sent by some servers before any token exists) and the closing finish_reason chunk carry no token.
    """
    choices = event.get("choices")
    if not choices:
        return None
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text or None


async def send_request(client: httpx.AsyncClient, endpoint: str, payload: dict, prompt: Prompt) -> RequestResult:
    """One streaming request, timed at every SSE line as it arrives. Never raises: an error fails the result.

    httpx rather than the openai SDK: each chunk is stamped the moment its line is read, with no SDK parsing or
    retries in between, and errors surface as the transport's own exceptions (connection refused, peer gone).
    """
    chat = "chat" in endpoint
    result = RequestResult(prompt_len=prompt.prompt_len, max_tokens=prompt.output_len)
    result.start = time.perf_counter()
    last = None
    text: list[str] = []
    try:
        async with client.stream("POST", endpoint, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {body[:300]}")
            done = False
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    raise RuntimeError(f"error event: {message}")
                piece = _content(event, chat)
                if piece is not None:
                    if last is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(piece)
                if usage := event.get("usage"):
                    result.usage_reported = True
                    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
                    result.output_tokens = usage.get("completion_tokens", 0)
            if not done:
                raise RuntimeError("the stream ended before [DONE]")
        result.e2el = time.perf_counter() - result.start
        if last is None:
            raise RuntimeError("no token was streamed")
        result.text = "".join(text)
        result.success = True
    except Exception as exc:  # noqa: BLE001 - any failure is the request's, never the run's
        result.success = False
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return result


# ----- a run -----


@dataclass
class RunConfig:
    endpoint: str = "/v1/completions"
    model: str = ""
    duration: float | None = None  # seconds; then requests go on until it is over, cycling through the prompts
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    disable_tqdm: bool = False


def build_payload(config: RunConfig, prompt: Prompt) -> dict:
    body: dict[str, Any] = {
        "model": config.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": config.temperature,
        "ignore_eos": True,
    }
    if "chat" in config.endpoint:
        text = prompt.prompt if isinstance(prompt.prompt, str) else ""
        body.update(messages=[{"role": "user", "content": text}], max_completion_tokens=prompt.output_len)
    else:
        body.update(prompt=prompt.prompt, max_tokens=prompt.output_len)
    return {**body, **config.extra_body}


async def run_requests(
    client: httpx.AsyncClient, prompts: list[Prompt], config: RunConfig
) -> tuple[list[RequestResult], float, int]:
    """Issue the requests on their arrival schedule; (results in issue order, duration in s, peak in flight).

    Arrival times are absolute offsets from the start, so a request held back by --max-concurrency does not
    shift the ones after it: it waits for a slot in arrival order, as in vllm bench.
    """
    from tqdm import tqdm

    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    gaps = inter_arrival_times(config.request_rate, config.burstiness, config.seed)
    progress = tqdm(
        total=None if config.duration else len(prompts),
        unit="req",
        disable=config.disable_tqdm,
        file=sys.stderr,
        desc=f"c={config.max_concurrency or 'inf'}",
    )
    in_flight, peak = 0, 0

    async def one(prompt: Prompt) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await send_request(client, config.endpoint, build_payload(config, prompt), prompt)
        finally:
            in_flight -= 1
            if slots:
                slots.release()
            progress.update(1)

    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    arrival = 0.0
    for i in itertools.count():
        if config.duration is None and i >= len(prompts):
            break
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots:
            await slots.acquire()
        if config.duration is not None and time.perf_counter() - start >= config.duration:
            if slots:
                slots.release()
            break
        tasks.append(asyncio.create_task(one(prompts[i % len(prompts)])))
        arrival += next(gaps)
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    progress.close()
    for r in results:
        r.start -= start
    return results, duration, peak


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """mean, median, std and percentiles in ms (numpy's linear interpolation, as vLLM); None when empty."""
    keys = ["mean", "median", "std", *[f"p{p:g}" for p in percentiles]]
    if not values:
        return dict.fromkeys(keys)
    ms = np.asarray(values) * 1000.0
    out = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    out.update({f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})
    return out


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    goodput_slos: dict[str, float] | None = None,
    percentiles: list[float] = (90, 95, 99),
) -> dict[str, Any]:
    """vllm bench serve's metrics over one run. goodput_slos: {"ttft"|"tpot"|"e2el": milliseconds}."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.e2el for r in ok]
    # TPOT is per request and needs 2 tokens; for goodput a 1-token request's TPOT counts as 0, as in vLLM.
    tpot_of = {id(r): (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in ok}
    tpots = [tpot_of[id(r)] for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        # With ignore_eos and max_tokens every completion_tokens must equal max_tokens.
        "usage_missing": sum(not r.usage_reported for r in ok),
        "usage_vs_max_tokens_mismatches": sum(r.output_tokens != r.max_tokens for r in ok),
        "tokenizer_count_mismatches": sum(
            r.tokenizer_output_tokens is not None and r.tokenizer_output_tokens != r.output_tokens for r in ok
        ),
    }
    if goodput_slos:

        def good(r: RequestResult) -> bool:
            value = {"ttft": r.ttft, "tpot": tpot_of[id(r)], "e2el": r.e2el}
            return all(value[k] * 1000.0 <= slo for k, slo in goodput_slos.items())

        good_count = sum(good(r) for r in ok)
        metrics["good_requests"] = good_count
        metrics["request_goodput"] = good_count / duration if duration > 0 else 0.0
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats(values, list(percentiles)).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def check_token_counts(results: list[RequestResult], tokenizer: Tokenizer | None) -> None:
    """Fill in each completed request's tokenizer count of its streamed text (and output_tokens without usage).

    Re-encoding text need not give back the generated tokens (special tokens print as nothing, merges differ
    across chunk boundaries), so a mismatch is counted and reported, not treated as a failure.
    """
    done = [r for r in results if r.success]
    if tokenizer is None or not done:
        return
    try:
        counts = [len(ids) for ids in encode_all(tokenizer, [r.text for r in done])]
    except Exception as exc:  # noqa: BLE001 - e.g. the server gone after the run: the check is left undone
        print(f"warning: token count check stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    for r, n in zip(done, counts):
        r.tokenizer_output_tokens = n
        if not r.usage_reported:
            r.output_tokens = n


# ----- reporting -----


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_summary(run: dict, title: str = "Serving Benchmark Result") -> str:
    """A table in the layout of vllm bench serve's."""
    m = run["metrics"]
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(name: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{name:<40} {_fmt(value, digits):<10}")

    row("Maximum request concurrency:", run["max_concurrency"] or "inf")
    row("Request rate (req/s) / burstiness:", f"{run['request_rate']} / {run['burstiness']}")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    if "request_goodput" in m:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row("Peak concurrent requests:", run["peak_concurrency"])
    row("Usage != max_tokens (requests):", m["usage_vs_max_tokens_mismatches"])
    row("Tokenizer count != usage (requests):", m["tokenizer_count_mismatches"])
    for key, heading, short in LATENCY_METRICS:
        lines.append(f"{heading:-^50}")
        for stat_key in [k for k in m if k.endswith(f"_{key}_ms")]:
            stat = stat_key[: -len(f"_{key}_ms")]
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(stat, stat.upper())
            row(f"{label} {short} (ms):", m[stat_key])
    if spec := run.get("spec_decode"):
        lines.append(f"{'Speculative Decoding':-^50}")
        rate = spec["acceptance_rate"]
        row("Acceptance rate (%):", None if rate is None else 100 * rate)
        row("Acceptance length:", spec["acceptance_length"])
        row("Drafts:", spec["drafts"])
        row("Draft tokens:", spec["draft_tokens"])
        row("Accepted tokens:", spec["accepted_tokens"])
        for i, value in enumerate(spec["per_position_acceptance"]):
            row(f"Position {i} acceptance (%):", None if value is None else 100 * value)
    if run.get("errors"):
        lines.append(f"{'Errors':-^50}")
        lines += [f"{count:>5} x {error[:120]}" for error, count in run["errors"].items()]
    lines.append("=" * 50)
    return "\n".join(lines)


def format_sweep(runs: list[dict]) -> str:
    header = (
        f"{'conc':>6} {'rate':>6} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'ITL p50':>9}"
    )
    lines = [header]
    for run in runs:
        m = run["metrics"]
        lines.append(
            f"{run['max_concurrency'] or 'inf'!s:>6} {run['request_rate']:>6} {m['completed']:>5} "
            f"{m['failed']:>5} {m['request_throughput']:>8.2f} {m['output_throughput']:>10.1f} "
            f"{_fmt(m['median_ttft_ms'], 1):>9} {_fmt(m.get('p95_ttft_ms'), 1):>9} "
            f"{_fmt(m['median_tpot_ms'], 1):>9} {_fmt(m['median_itl_ms'], 1):>9}"
        )
    return "\n".join(lines)


def plot_results(files: list[dict], out: Path, title: str | None = None) -> Path:
    """Latency against output throughput, one curve per result file (server), one point per run.

    Left: TTFT median (solid) and p95 (dashed). Right: TPOT median (solid) and ITL median (dotted).
    Each point is labelled with its concurrency.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tok) = plt.subplots(1, 2, figsize=(13, 5))
    labels = Counter(f.get("label", "?") for f in files)
    for n, data in enumerate(files):
        label = data.get("label", "?")
        if labels[label] > 1:  # two files of one server: tell them apart
            label = f"{label} ({data.get('_path', n)})"
        runs = sorted(data["runs"], key=lambda r: r["metrics"]["output_throughput"])
        x = [r["metrics"]["output_throughput"] for r in runs]
        color = f"C{n}"

        def series(key: str, runs=runs) -> list[float]:
            return [math.nan if r["metrics"].get(key) is None else r["metrics"][key] for r in runs]

        ax_ttft.plot(x, series("median_ttft_ms"), "o-", color=color, label=f"{label} TTFT p50")
        ax_ttft.plot(x, series("p95_ttft_ms"), "^--", color=color, label=f"{label} TTFT p95")
        ax_tok.plot(x, series("median_tpot_ms"), "o-", color=color, label=f"{label} TPOT p50")
        ax_tok.plot(x, series("median_itl_ms"), "s:", color=color, label=f"{label} ITL p50")
        for r, xi, yi in zip(runs, x, series("median_ttft_ms"), strict=True):
            ax_ttft.annotate(
                f"c={r['max_concurrency'] or 'inf'}",
                (xi, yi),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=color,
            )
    for ax, name in ((ax_ttft, "time to first token (ms)"), (ax_tok, "per-token latency (ms)")):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.margins(x=0.12, y=0.1)  # room for the concurrency labels
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency vs output throughput")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _jsonable(value: Any) -> Any:
    """inf (an unbounded request rate) as the string "inf": JSON has no infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def load_result_file(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if "runs" not in data:
        raise ValueError(f"{path}: not a bench/latency.py result file (no 'runs')")
    data["_path"] = Path(path).stem
    return data


# ----- the command -----


def _slos(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise argparse.ArgumentTypeError(f"--goodput takes {'/'.join(SLO_METRICS)}:MS, got {item!r}")
        slos[name] = float(value)
    return slos


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_argument_group("server")
    target.add_argument(
        "--base-url",
        default=None,
        help="the server, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine); default http://HOST:PORT",
    )
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    target.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    target.add_argument(
        "--label",
        default=None,
        help="server label for results and plots (default: the server's owned_by from /v1/models, e.g. pagoda or vllm)",
    )
    target.add_argument(
        "--tokenizer",
        default=None,
        help="a local Hugging Face tokenizer (directory or cached id); default: the server's /tokenize and /detokenize",
    )
    target.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--num-prompts",
        type=int,
        default=1000,
        help="requests per run (with --duration: the pool of prompts cycled through); default 1000",
    )
    load.add_argument(
        "--duration",
        type=float,
        default=None,
        help="issue requests for this many seconds instead of --num-prompts (then wait for those in flight)",
    )
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the inter-arrival times: 1 Poisson, <1 burstier, >1 more even",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument(
        "--sweep-concurrency",
        default=None,
        metavar="C1,C2,...",
        help="one run per concurrency, "
        "each with its own prompts (seed + index, so a prefix cache gains nothing across runs)",
    )
    load.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=0,
        metavar="K",
        help="with a concurrency C: at least K x C requests (so every level runs K rounds)",
    )
    load.add_argument("--num-warmups", type=int, default=0, help="warm-up requests before measuring (not counted)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    load.add_argument("--disable-tqdm", action="store_true")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", "--dataset", default="random", choices=["random", "corpus", "repeat"])
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1",
    )
    data.add_argument(
        "--random-token-range", default="1000,20000", metavar="LO,HI", help="token ids drawn from [LO, HI)"
    )
    data.add_argument(
        "--corpus-file",
        type=Path,
        default=DEFAULT_CORPUS,
        help="text (or .gz) for --dataset-name corpus; default: the Jargon File excerpt in bench/data",
    )
    data.add_argument("--input-len", type=int, default=512, help="corpus passage length, tokens")
    data.add_argument("--output-len", type=int, default=128, help="corpus and repeat output length, tokens")

    out = parser.add_argument_group("results")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs, e.g. ttft:500 tpot:50 e2el:10000; goodput counts the requests meeting all",
    )
    out.add_argument("--metric-percentiles", default="90,95,99", help="percentiles reported besides the median")
    out.add_argument("--result-file", type=Path, default=None, help="write the results JSON here")
    out.add_argument(
        "--result-dir", type=Path, default=None, help="write the results JSON here, named by label, dataset and load"
    )
    out.add_argument("--skip-token-check", action="store_true", help="no tokenizer count of the streamed outputs")
    out.add_argument(
        "--save-detailed", action="store_true", help="per-request details (timings, ITLs, text, errors) in the JSON"
    )
    out.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="plot this run's latency vs throughput (with --plot-with files as more curves)",
    )
    out.add_argument(
        "--plot-with",
        nargs="+",
        default=[],
        metavar="RESULT.json",
        help="other result files to draw with --plot (e.g. a vllm sweep)",
    )
    return parser


def build_plot_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda bench serve plot",
        description="Latency vs output throughput from result files of bench/latency.py, one curve per file.",
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--title", default=None)
    return parser


def _server_info(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    """owned_by and the first model from /v1/models, and /version; {} parts when the server does not answer."""
    info: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=base_url, headers=headers, timeout=10, trust_env=False) as client:
            models = client.get("/v1/models").json()["data"]
            info.update(
                model=models[0]["id"], owned_by=models[0].get("owned_by"), max_model_len=models[0].get("max_model_len")
            )
            with contextlib.suppress(Exception):  # /version is optional
                info["version"] = client.get("/version").json().get("version")
    except Exception as exc:  # noqa: BLE001 - an unreachable server still gets a run, all failed
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


# The speculative-decoding counters of a server's /metrics (pagoda's and vLLM's names, any prefix).
_SPEC_COUNTER = re.compile(
    r"^(?:\w+:)?spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens)(?:_total)?(?:\{[^}]*\})?\s+(\S+)$"
)
_SPEC_PER_POS = re.compile(
    r'^(?:\w+:)?spec_decode_num_accepted_tokens_per_pos(?:_total)?\{[^}]*position="(\d+)"[^}]*\}\s+(\S+)$'
)


def spec_decode_counters(base_url: str, headers: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The server's speculative-decoding counters now (None when it exports none: it does not speculate, or
    has no /metrics)."""
    try:
        text = httpx.get(f"{base_url}/metrics", headers=headers or {}, timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return None
    counters: dict[str, Any] = {"per_pos": {}}
    for line in text.splitlines():
        if m := _SPEC_COUNTER.match(line):
            counters[m[1]] = float(m[2])
        elif m := _SPEC_PER_POS.match(line):
            counters["per_pos"][int(m[1])] = float(m[2])
    return counters if "num_drafts" in counters else None


def spec_decode_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What speculation did between two scrapes, as vllm bench serve reports it: acceptance rate (accepted /
    proposed draft tokens), acceptance length (tokens a verify step emits: 1 + accepted per draft), and the
    acceptance of each draft position."""
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after.get("num_draft_tokens", 0.0) - before.get("num_draft_tokens", 0.0)
    accepted = after.get("num_accepted_tokens", 0.0) - before.get("num_accepted_tokens", 0.0)
    per_pos = [
        (after["per_pos"][i] - before["per_pos"].get(i, 0.0)) / drafts if drafts else None
        for i in sorted(after["per_pos"])
    ]
    return {
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": per_pos,
    }


def _make_prompts(args: argparse.Namespace, seed: int, num: int, tokenizer: Tokenizer | None) -> list[Prompt]:
    if args.dataset_name == "corpus":
        if tokenizer is None:
            raise RuntimeError("the corpus dataset needs a tokenizer")
        return corpus_dataset(num, args.input_len, args.output_len, tokenizer, seed, args.corpus_file)
    if args.dataset_name == "repeat":
        if "chat" not in args.endpoint:
            raise ValueError("the repeat dataset is chat requests: use --endpoint /v1/chat/completions")
        return repeat_dataset(num, args.output_len, tokenizer, seed)
    lo, hi = (int(v) for v in args.random_token_range.split(","))
    as_text = "chat" in args.endpoint  # chat takes text; completions take the ids themselves
    return random_dataset(
        num,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        seed,
        (lo, hi),
        tokenizer if as_text else None,
    )


async def _run(
    args: argparse.Namespace,
    base_url: str,
    headers: dict[str, str],
    config: RunConfig,
    points: list[int | None],
    tokenizer: Tokenizer | None,
    slos: dict[str, float] | None,
    percentiles: list[float],
) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(p or 0 for p in points) or 1024)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    runs = []
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        if args.num_warmups:
            # Prompts of their own (another seed), so what they leave in a prefix cache does not help the runs.
            warm = _make_prompts(args, args.seed + 10_000, args.num_warmups, tokenizer)
            warm_config = RunConfig(
                **{
                    **asdict(config),
                    "max_concurrency": points[0] or args.num_warmups,
                    "request_rate": math.inf,
                    "duration": None,
                    "disable_tqdm": True,
                }
            )
            results, _, _ = await run_requests(client, warm, warm_config)
            failed = sum(not r.success for r in results)
            print(f"warm-up: {len(results)} requests, {failed} failed", file=sys.stderr)
        for k, concurrency in enumerate(points):
            run_config = RunConfig(**{**asdict(config), "max_concurrency": concurrency, "seed": args.seed + k})
            num = max(args.num_prompts, args.prompts_per_concurrency * (concurrency or 0))
            prompts = _make_prompts(args, args.seed + k, num, tokenizer)
            spec_before = await asyncio.to_thread(spec_decode_counters, base_url, headers)
            results, duration, peak = await run_requests(client, prompts, run_config)
            spec_after = await asyncio.to_thread(spec_decode_counters, base_url, headers)
            check_token_counts(results, tokenizer if not args.skip_token_check else None)
            run = {
                "max_concurrency": concurrency,
                "request_rate": config.request_rate,
                "burstiness": config.burstiness,
                "seed": run_config.seed,
                "num_requests": len(results),
                "peak_concurrency": peak,
                "metrics": compute_metrics(results, duration, slos, percentiles),
                "errors": dict(Counter(r.error for r in results if not r.success).most_common(10)),
            }
            if spec_before is not None and spec_after is not None:
                run["spec_decode"] = spec_decode_summary(spec_before, spec_after)
            if args.save_detailed:
                run["requests"] = [asdict(r) for r in results]
            print(format_summary(run), flush=True)
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        plot_args = build_plot_parser().parse_args(argv[1:])
        require_plotting()
        out = plot_results([load_result_file(f) for f in plot_args.files], plot_args.out, plot_args.title)
        print(f"wrote {out}")
        return 0

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot is not None:
        require_plotting()  # before the run, not after it
    try:
        slos = _slos(args.goodput)
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
        points: list[int | None] = (
            [int(c) for c in args.sweep_concurrency.split(",")] if args.sweep_concurrency else [args.max_concurrency]
        )
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    base_url = base_url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = _server_info(base_url, headers)
    if "error" in server:
        print(f"warning: {base_url}/v1/models did not answer ({server['error']}); going on", file=sys.stderr)
    model = args.model or server.get("model") or "default"
    label = args.label or server.get("owned_by") or base_url.split("//")[-1]
    tokenizer: Tokenizer | None = (
        LocalTokenizer(args.tokenizer) if args.tokenizer else ServerTokenizer(base_url, model, headers)
    )
    config = RunConfig(
        endpoint=args.endpoint,
        model=model,
        duration=args.duration,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        temperature=args.temperature,
        extra_body=extra_body,
        disable_tqdm=args.disable_tqdm,
    )
    try:
        runs = asyncio.run(_run(args, base_url, headers, config, points, tokenizer, slos, percentiles))
    except (httpx.HTTPError, RuntimeError, ValueError, OSError) as exc:
        # Only the set-up can get here (building prompts with the server's tokenizer); requests never raise.
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if isinstance(tokenizer, ServerTokenizer):
            tokenizer.close()
    if len(runs) > 1:
        print(format_sweep(runs))

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "label": label,
        "base_url": base_url,
        "model": model,
        "endpoint": args.endpoint,
        "dataset": args.dataset_name,
        "server": server,
        "client": {"machine": platform.machine(), "python": platform.python_version()},
        "command": " ".join(sys.argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("api_key",)},
        "goodput_slos_ms": slos,
        "runs": runs,
    }
    path = args.result_file
    if path is None and args.result_dir is not None:
        load = (
            f"sweep{args.sweep_concurrency.replace(',', '-')}"
            if args.sweep_concurrency
            else f"c{args.max_concurrency or 'inf'}-r{args.request_rate:g}"
        )
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = args.result_dir / f"{label}-{args.dataset_name}-{load}-{stamp}.json"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_jsonable(result), indent=1, allow_nan=False, default=str))
        print(f"wrote {path}")
    if args.plot is not None:
        files = [{**result, "_path": "this run"}, *[load_result_file(f) for f in args.plot_with]]
        print(f"wrote {plot_results(files, args.plot)}")
    return 0 if all(run["metrics"]["completed"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
