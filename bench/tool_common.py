"""What the quantizing tools' scripts (bench/{llmcompressor,gptqmodel,autoawq}_checkpoints.py) share.

They run in the tools' own venvs (bench/tool_checkpoints.sh puts the repository on their PYTHONPATH), so this
imports nothing of pagoda's and only what every one of those venvs has: torch, transformers, safetensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "jargon-file-4.4.7.txt"
SCORED_TOKENS = 8192  # bench/quant_ppl.py's default: calibration reads past it, so the scored text stays held out
GREEDY_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def calibration_rows(tok, samples: int, length: int) -> list[list[int]]:
    """`samples` runs of `length` token ids of the bundled text past what bench/quant_ppl.py scores."""
    ids = tok(TEXT.read_text())["input_ids"][SCORED_TOKENS:]
    return [ids[i * length : (i + 1) * length] for i in range(samples)]


def prompts(tok) -> list[list[int]]:
    """The two prompts of a tool's greedy record: the chat question, templated, and 60 plain token ids."""
    chat = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return [tok(chat, add_special_tokens=False)["input_ids"], list(range(100, 160))]


def greedy(model, prompt_ids: list[list[int]]) -> list[list[int]]:
    """GREEDY_TOKENS greedy tokens a transformers model generates for each prompt, EOS neither stopping nor
    suppressed (as pagoda's ignore_eos)."""
    import torch

    model.generation_config.eos_token_id = None
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        # use_cache: a quantizing tool may have saved use_cache=False in the config.
        y = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0,
            use_cache=True,
        )  # fmt: skip
        out.append(y[0, len(ids) :].tolist())
    return out


def write_record(path: Path, tool: str, prompt_ids: list[list[int]], tokens: list[list[int]]) -> None:
    path.write_text(json.dumps({"tool": tool, "prompts": prompt_ids, "greedy": tokens}))


def write_float_copy(ckpt: Path, out: Path, tensors: dict) -> None:
    """A float32 HF directory beside a quantized checkpoint: its files but the weights and quantization files,
    its config without `quantization_config`, and `tensors` (name -> tensor) as the weights."""
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    skip = shutil.ignore_patterns("*.safetensors", "quantize_config.json", "quant_config.json", "quant_log.csv")
    shutil.copytree(ckpt, out, ignore=skip)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, out / "model.safetensors")
