"""Quantize a model with llm-compressor itself, writing compressed-tensors checkpoints pagoda's tests load.

llm-compressor 0.14 pins transformers<=5.17, which pagoda's environment does not take, so this runs in a
venv of its own (torch stays 2.13.0 CPU; nothing of pagoda is imported here):

    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 transformers==5.17.0 llmcompressor==0.14.0.1
    PYTHONPATH=. /tmp/llmc/bin/python bench/llmcompressor_checkpoints.py MODEL_DIR OUT_DIR [w4a16-g64-gptq ...]

Each scheme lands in OUT_DIR/<scheme> (tests/test_quant_tools.py looks in $PAGODA_CACHE/llmcompressor/).
The GPTQ and SmoothQuant (w8a8-int8-sq) schemes calibrate on the Jargon File past the text
bench/quant_ppl.py scores (its first 8192 tokens), so the scored text stays held out. Groups of 64,
not 128: SmolLM2-135M's 576 inputs are not a multiple of 128, which llm-compressor refuses.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.tool_common import calibration_rows


def _recipe(scheme: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    if scheme in ("w4a16-g64-gptq", "w4a16-g64-rtn"):
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
        cls = GPTQModifier if scheme.endswith("gptq") else QuantizationModifier
        return cls(config_groups=groups, ignore=["lm_head"])
    if scheme == "w8a16":
        # 8-bit weights per output channel (llm-compressor's W8A16 preset is groups of 128, which 576 inputs refuse).
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
        return QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    if scheme == "w8a8-int8-sq":
        # Activation outliers moved into the weights first, alpha 0.5 (bench/quant_sensitivity.py's best), on the
        # mappings llm-compressor infers for Llama (q/k/v and gate/up into the norms; adding down_proj into
        # up_proj measured worse: WRITEUP.md).
        smooth = SmoothQuantModifier(smoothing_strength=0.5)
        return [smooth, QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    preset = {"w8a8-int8": "W8A8", "w8a8-fp8": "FP8_DYNAMIC"}[scheme]
    return QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])


def _calibration(tok, samples: int = 8, length: int = 128):
    # Small: calibrating 32 x 256 tokens took 5 minutes a layer on 2 shared cores.
    from datasets import Dataset

    rows = calibration_rows(tok, samples, length)
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * length for _ in rows]})


def main() -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = sys.argv[1], Path(sys.argv[2])
    # w4a16-g64-gptq only when named: its calibration takes most of an hour on 2 shared cores (GPTQModel's
    # checkpoints test a GPTQ-calibrated model in CI, bench/gptqmodel_checkpoints.py).
    for scheme in sys.argv[3:] or ["w4a16-g64-rtn", "w8a16", "w8a8-int8", "w8a8-int8-sq", "w8a8-fp8"]:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(src, dtype="float32")
        tok = AutoTokenizer.from_pretrained(src)
        kwargs = {}
        if scheme.endswith(("gptq", "-sq")):
            kwargs = dict(dataset=_calibration(tok), num_calibration_samples=8, max_seq_length=128)
        oneshot(model=model, recipe=_recipe(scheme), **kwargs)
        model.save_pretrained(out / scheme, save_compressed=True)
        tok.save_pretrained(out / scheme)
        print(f"{scheme}: {out / scheme} in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
