"""Quantize a model with GPTQModel itself, writing GPTQ checkpoints pagoda's tests load.

GPTQModel 7.7 (auto-gptq's maintained successor, writing auto-gptq's format) needs torch>=2.14.1, which pagoda's
environment does not take, so this runs in a venv of its own (torch 2.14.1 from local disk; nothing of pagoda is
imported here):

    python3 -m venv /tmp/gptqm && /tmp/gptqm/bin/pip install torch==2.14.1 && \
        /tmp/gptqm/bin/pip install gptqmodel==7.7.0 optimum==2.3.0
    GPTQMODEL_CPU_WORKERS=2 /tmp/gptqm/bin/python bench/gptqmodel_checkpoints.py MODEL_DIR OUT_DIR [gptq-w4g64 ...]

(GPTQMODEL_CPU_WORKERS: GPTQModel asks for two loader threads, and a 2-core machine gives it one by default.)
For each scheme it writes, with the tool's own code only:
- OUT_DIR/<scheme>/: the checkpoint as GPTQModel saves it (GPTQ calibrated on 8 x 128 tokens of the Jargon File
  past the text bench/quant_ppl.py scores, so the scored text stays held out);
- OUT_DIR/<scheme>-dequantized/: a float32 copy of the model whose quantized linears hold GPTQModel's own
  dequantization of its packed tensors (its torch kernel's unpacking, in float32): what the checkpoint stands
  for, which transformers loads as the oracle;
- OUT_DIR/<scheme>.tool.json: two prompts and the greedy tokens transformers generates from the checkpoint
  through GPTQModel's kernels.
tests/test_quant_tools.py looks for them in $PAGODA_CACHE/gptqmodel/.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "jargon-file-4.4.7.txt"
SCORED_TOKENS = 8192  # bench/quant_ppl.py's default
GREEDY_TOKENS = 16
# Groups of 64 and 32 divide SmolLM2-135M's 576 and 1536 inputs; -1 is one group per output channel.
SCHEMES = {
    "gptq-w4g64": dict(bits=4, group_size=64, sym=True, desc_act=False),
    "gptq-w4g32-actorder-asym": dict(bits=4, group_size=32, sym=False, desc_act=True),
    # act_group_aware (GPTQModel's default) orders by groups, which one group per channel lacks.
    "gptq-w8g-1": dict(bits=8, group_size=-1, sym=True, desc_act=False, act_group_aware=False),
}


def _calibration(tok, samples: int = 8, length: int = 128) -> list[dict]:
    ids = tok(TEXT.read_text())["input_ids"][SCORED_TOKENS:]
    rows = [ids[i * length : (i + 1) * length] for i in range(samples)]
    return [{"input_ids": row, "attention_mask": [1] * length} for row in rows]


def _prompts(tok) -> list[list[int]]:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]
    return [chat, list(range(100, 160))]


def _dequantized(ckpt: Path, out: Path) -> None:
    """A float32 copy of the checkpoint with each quantized linear's packed tensors replaced by its weight as
    GPTQModel unpacks it (the other tensors, the embedding and norms, as the checkpoint stores them)."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import load_file, save_file

    # float16, the checkpoint's scales' dtype (its torch kernel takes float16 or bfloat16, and bfloat16 would round
    # the scales as it loads them).
    model = GPTQModel.load(str(ckpt), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    linears = {name: m for name, m in model.model.named_modules() if isinstance(m, BaseQuantLinear)}
    if not linears:
        raise SystemExit(f"{ckpt}: GPTQModel loaded no quantized linear")
    tensors = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        for key, value in load_file(file).items():
            owner, _, leaf = key.rpartition(".")
            if owner not in linears or leaf == "bias":
                tensors[key] = value.float().contiguous()
    for name, module in linears.items():
        # float32 scales, so the product scale * (q - zero) is not rounded to float16.
        module.scales = module.scales.float()
        tensors[f"{name}.weight"] = module.dequantize_weight().T.float().contiguous()  # [K, N] -> [N, K]
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("*.safetensors", "quantize_config.json", "quant_log.csv"))
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out / "model.safetensors")
    del model
    torch.cuda.empty_cache()


def _tool_greedy(ckpt: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the checkpoint as transformers loads it (GPTQModel's kernels through optimum)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, device_map="cpu").eval()
    model.generation_config.eos_token_id = None  # as pagoda's ignore_eos: EOS neither stops nor is suppressed
    greedy = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        greedy.append(out[0, len(ids) :].tolist())
    return greedy


def main() -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    for scheme in sys.argv[3:] or list(SCHEMES):
        start = time.perf_counter()
        ckpt, record = out / scheme, out / f"{scheme}.tool.json"
        if record.is_file():
            continue  # written last: the scheme is complete
        if not (ckpt / "model.safetensors").is_file():
            model = GPTQModel.load(str(src), QuantizeConfig(**SCHEMES[scheme]), device="cpu")
            model.quantize(_calibration(tok), batch_size=1)
            model.save(str(ckpt))
            del model
        if (src / "chat_template.jinja").is_file() and not (ckpt / "chat_template.jinja").is_file():
            shutil.copy(src / "chat_template.jinja", ckpt)
        _dequantized(ckpt, out / f"{scheme}-dequantized")
        prompts = _prompts(tok)
        greedy = _tool_greedy(ckpt, prompts)
        record.write_text(json.dumps({"tool": "gptqmodel 7.7.0", "prompts": prompts, "greedy": greedy}))
        print(f"{scheme}: {ckpt} in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
