"""Quantize a model with GPTQModel itself, writing GPTQ checkpoints pagoda's tests load.

GPTQModel 7.7 (auto-gptq's maintained successor, writing auto-gptq's format) needs torch>=2.14.1, which pagoda's
environment does not take, so this runs in a venv of its own (torch 2.14.1 from local disk; nothing of pagoda is
imported here):

    python3 -m venv /tmp/gptqm && /tmp/gptqm/bin/pip install torch==2.14.1 && \
        /tmp/gptqm/bin/pip install gptqmodel==7.7.0 optimum==2.3.0
    GPTQMODEL_CPU_WORKERS=2 PYTHONPATH=. /tmp/gptqm/bin/python bench/gptqmodel_checkpoints.py MODEL_DIR OUT_DIR [...]

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

import shutil
import sys
import time
from pathlib import Path

from bench.tool_common import calibration_rows, greedy, prompts, write_float_copy, write_record

# Groups of 64 and 32 divide SmolLM2-135M's 576 and 1536 inputs; -1 is one group per output channel.
SCHEMES = {
    "gptq-w4g64": dict(bits=4, group_size=64, sym=True, desc_act=False),
    "gptq-w4g32-actorder-asym": dict(bits=4, group_size=32, sym=False, desc_act=True),
    # act_group_aware (GPTQModel's default) orders by groups, which one group per channel lacks.
    "gptq-w8g-1": dict(bits=8, group_size=-1, sym=True, desc_act=False, act_group_aware=False),
}


def _dequantized(ckpt: Path, out: Path) -> None:
    """A float32 copy of the checkpoint with each quantized linear's packed tensors replaced by its weight as
    GPTQModel unpacks it (the other tensors, the embedding and norms, as the checkpoint stores them)."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import load_file

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
                tensors[key] = value
    for name, module in linears.items():
        # float32 scales, so the product scale * (q - zero) is not rounded to float16.
        module.scales = module.scales.float()
        tensors[f"{name}.weight"] = module.dequantize_weight().T  # [K, N] -> nn.Linear's [N, K]
    write_float_copy(ckpt, out, tensors)


def _tool_greedy(ckpt: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the checkpoint as transformers loads it (GPTQModel's kernels through optimum)."""
    import torch
    from transformers import AutoModelForCausalLM

    return greedy(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, device_map="cpu").eval(), prompt_ids)


def main() -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(src)
    calibration = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in calibration_rows(tok, 8, 128)]
    prompt_ids = prompts(tok)
    for scheme in sys.argv[3:] or list(SCHEMES):
        start = time.perf_counter()
        ckpt = out / scheme
        model = GPTQModel.load(str(src), QuantizeConfig(**SCHEMES[scheme]), device="cpu")
        model.quantize(calibration, batch_size=1)
        model.save(str(ckpt))
        del model
        if (src / "chat_template.jinja").is_file() and not (ckpt / "chat_template.jinja").is_file():
            shutil.copy(src / "chat_template.jinja", ckpt)
        _dequantized(ckpt, out / f"{scheme}-dequantized")
        write_record(out / f"{scheme}.tool.json", "gptqmodel 7.7.0", prompt_ids, _tool_greedy(ckpt, prompt_ids))
        print(f"{scheme}: {ckpt} in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
