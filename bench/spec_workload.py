"""The prompt-lookup-friendly workload of the speculative-decoding benchmarks: ask the model to repeat a passage of
the Jargon File (bench/data/jargon-file-4.4.7.txt) with one word changed, so most of the output is text the
prompt already holds. Offline (bench/spec_decode.py) and online (`pagoda bench serve --dataset-name repeat`,
bench/latency.py) ask the same question of passages cut the same way. Light on purpose: the online client
imports it, not torch.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "jargon-file-4.4.7.txt"
_FIRST = 20_000  # characters skipped: the file's front matter


def _corpus() -> str:
    return CORPUS.read_text(encoding="utf-8", errors="replace")


def passages(count: int, chars: int = 700) -> list[str]:
    """`count` (at most 5) passages of about `chars` characters from the body of the Jargon File, 23,000 characters
    apart, each from a line start to a line end (bench/spec_decode.py's offline prompts)."""
    text = _corpus()
    out = []
    for i in range(count):
        start = text.index("\n", _FIRST + i * 23_000) + 1
        end = text.index("\n", start + chars)
        out.append(text[start:end].strip())
    return out


def line_passages(count: int, first: int = 0, chars: int = 700) -> list[str]:
    """`count` passages starting at successive lines of the body, line `first` onwards (wrapping around after the
    last of its ~400 lines), each about `chars` characters to a line end, or cut at a space at 2 x `chars`
    (some lines are long paragraphs). Distinct starts: no two prompts share more than their instruction in a
    prefix cache, up to as many prompts as the body has lines."""
    text = _corpus()
    starts = [_FIRST]
    while (end := text.find("\n", starts[-1])) >= 0 and end + 1 + 2 * chars < len(text):
        starts.append(end + 1)
    out = []
    for i in range(first, first + count):
        start = starts[i % len(starts)]
        end = text.find("\n", start + chars)
        if end < 0 or end > start + 2 * chars:
            end = text.rindex(" ", start + chars, start + 2 * chars)
        out.append(text[start:end].strip())
    return out


def prompt_of(passage: str, task: str = "repeat") -> list[dict]:
    """repeat: the prompt-lookup-friendly task; free: a story the passage brings to mind, in new words."""
    if task == "repeat":
        content = "Repeat the following text exactly, but write 'computer' instead of 'machine':\n\n" + passage
    else:
        content = "In your own words, tell a short story about a programmer that this text reminds you of:\n\n"
        content += passage[:200]
    return [{"role": "user", "content": content}]
