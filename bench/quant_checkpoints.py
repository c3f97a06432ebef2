"""Write quantized checkpoints of a full-precision HF directory in the exact on-disk formats of the real tools.

No quantizing tool runs here (see README "Quantized models"), so pagoda's tests and bench/quant_ppl.py
quantize with round-to-nearest (engine.quant.quantize_rtn) and pack with pagoda's own packers
(engine/quant/{gptq,awq,compressed_tensors}.py `pack`), writing the tensors and the quantization_config
each tool writes: GPTQ as auto-gptq / GPTQModel (`format="gptq"`, or `gptq_v2`), AWQ as AutoAWQ's GEMM
version, compressed-tensors as llm-compressor (pack-quantized W4A16/W8A16, int-quantized W8A8,
float-quantized FP8). Beside each, `reference/` holds the dequantized weights as a plain float32
checkpoint: what the quantized model stands for, which transformers loads as the oracle.

    python -m bench.quant_checkpoints MODEL_DIR OUT_DIR gptq-w4g128 [awq-w4g128 ct-w8a8-int8 ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.layers.linear import FP8, quantize_per_row
from engine.quant import IntWeight, awq, compressed_tensors, gptq, quantize_rtn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Recipe:
    """One checkpoint kind: the format, the bits and groups, and the options that change the layout."""

    fmt: str  # gptq, gptq_v2, awq, ct (pack-quantized), ct-int8 (W8A8), ct-fp8 (W8A8)
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    static_input: bool = False  # W8A8: one calibrated activation scale per layer instead of per-token ones


RECIPES = {
    "gptq-w4g128": Recipe("gptq"),
    "gptq-w4g128-asym": Recipe("gptq", symmetric=False),
    "gptq-w4g32-actorder": Recipe("gptq", group_size=32, act_order=True),
    "gptq-w8g-1": Recipe("gptq", bits=8, group_size=-1),
    "gptqv2-w4g64-asym": Recipe("gptq_v2", group_size=64, symmetric=False),
    "awq-w4g128": Recipe("awq", symmetric=False),
    "ct-w4a16-g128": Recipe("ct"),
    "ct-w4a16-g32-asym": Recipe("ct", group_size=32, symmetric=False),
    "ct-w8a16-channel": Recipe("ct", bits=8, group_size=-1),
    "ct-w8a8-int8": Recipe("ct-int8", bits=8, group_size=-1),
    "ct-w8a8-fp8": Recipe("ct-fp8", bits=8, group_size=-1),
    "ct-w8a8-int8-static": Recipe("ct-int8", bits=8, group_size=-1, static_input=True),
    "ct-w8a8-fp8-static": Recipe("ct-fp8", bits=8, group_size=-1, static_input=True),
}
CALIBRATION_SKIP = 8192  # static scales calibrate on text past what bench/quant_ppl.py scores by default


def _quantization_config(r: Recipe) -> dict:
    if r.fmt in ("gptq", "gptq_v2"):
        return {
            "quant_method": "gptq", "bits": r.bits, "group_size": r.group_size, "desc_act": r.act_order,
            "sym": r.symmetric, "checkpoint_format": r.fmt, "lm_head": False, "true_sequential": True,
            "damp_percent": 0.01, "static_groups": False,
        }  # fmt: skip
    if r.fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": r.group_size, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": r.bits, "type": "int", "symmetric": r.symmetric, "dynamic": False, "actorder": None}
    acts = None
    fmt = "pack-quantized"
    if r.fmt == "ct":
        weights.update(
            strategy="group" if r.group_size > 0 else "channel", group_size=r.group_size if r.group_size > 0 else None
        )
    else:
        kind = "int" if r.fmt == "ct-int8" else "float"
        weights.update(type=kind, strategy="channel", group_size=None)
        acts = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True}
        if r.static_input:
            acts.update(strategy="tensor", dynamic=False, observer="minmax")
        fmt = f"{kind}-quantized"
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
             "format": fmt}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None}  # fmt: skip


def input_absmax(model_dir: Path) -> dict[str, torch.Tensor]:
    """Linear module name -> the largest |input| of each input channel ([K]) on calibration text (4 x 256
    tokens of the bundled text past the scored part; seeded random tokens for a model without a tokenizer):
    its maximum is the min-max observer llm-compressor makes a static activation scale of."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.quant_ppl import TEXT

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if (Path(model_dir) / "tokenizer.json").is_file():
        ids = AutoTokenizer.from_pretrained(model_dir)(TEXT.read_text())["input_ids"]
        ids = torch.tensor(ids[CALIBRATION_SKIP : CALIBRATION_SKIP + 1024]).reshape(4, 256)
    else:
        ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    seen: dict[str, torch.Tensor] = {}

    def observe(name: str, x: torch.Tensor) -> None:
        channels = x.abs().reshape(-1, x.shape[-1]).amax(0)
        seen[name] = torch.maximum(seen[name], channels) if name in seen else channels

    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            module.register_forward_pre_hook(lambda m, args, name=name: observe(name, args[0]))
    with torch.no_grad():
        model(input_ids=ids)
    return seen


def _quantize(weight: torch.Tensor, r: Recipe, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint tensors of one [N, K] linear weight, and the float32 weight they dequantize to."""
    if r.fmt in ("ct-int8", "ct-fp8"):
        q, scale = quantize_per_row(weight, torch.int8 if r.fmt == "ct-int8" else FP8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    g_idx = None
    if r.act_order:  # a random act order: GPTQ's desc_act assigns groups in an order of its own
        k = weight.shape[1]
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // r.group_size
    iw = quantize_rtn(weight, r.bits, r.group_size, r.symmetric, g_idx)
    iw = IntWeight(iw.q, iw.scales.half(), iw.zeros, iw.bits, iw.group_size, iw.g_idx)  # the tools store fp16 scales
    if r.fmt in ("gptq", "gptq_v2"):
        tensors = gptq.pack(iw, v2=r.fmt == "gptq_v2")
    elif r.fmt == "awq":
        tensors = awq.pack(iw)
    else:
        tensors = compressed_tensors.pack(iw, symmetric=r.symmetric)
    return tensors, iw.dequantize().t()


def write(model_dir: str | Path, out_dir: str | Path, recipe: Recipe) -> Path:
    """`out_dir` with the quantized checkpoint, and `out_dir/reference` with its dequantized weights."""
    src, out = Path(model_dir), Path(out_dir)
    ref = out / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    absmax = input_absmax(src) if recipe.static_input else {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            module, _, suffix = name.rpartition(".")
            if suffix == "weight" and module.rpartition(".")[2] in LINEARS:
                # Projections of one input (q/k/v, gate/up) share an act order, as GPTQ's Hessian of that input gives.
                shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
                tensors, deq = _quantize(tensor.float(), recipe, seed=zlib.crc32(shared.encode()))
                if recipe.static_input:
                    qmax = 127.0 if recipe.fmt == "ct-int8" else torch.finfo(FP8).max
                    tensors["input_scale"] = (absmax[module].max() / qmax).reshape(1)
                quantized.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
                dequantized[name] = deq.to(tensor.dtype).contiguous()
            else:
                quantized[name] = dequantized[name] = tensor.contiguous()
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, ref / "model.safetensors", metadata={"format": "pt"})
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            shutil.copy(file, out / file.name)
            shutil.copy(file, ref / file.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quantization_config(recipe)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("recipes", nargs="+", choices=sorted(RECIPES))
    args = parser.parse_args()
    for name in args.recipes:
        print(write(args.model_dir, Path(args.out_dir) / name, RECIPES[name]))


if __name__ == "__main__":
    main()
