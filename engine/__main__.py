"""`python -m engine "prompt" ...`: chat with a model offline (the embedded default unless --model)."""

from __future__ import annotations

import argparse

from engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="user messages, one chat each")
    parser.add_argument(
        "--model", default=None, help="HF model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in args.prompts]
    for prompt, out in zip(args.prompts, llm.chat(conversations, params)):
        print(f"> {prompt}\n{out.outputs[0].text}\n")


if __name__ == "__main__":
    main()
