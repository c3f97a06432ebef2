"""Quantize a model with AutoAWQ itself, writing AWQ GEMM checkpoints and AutoAWQ's own dequantization of them.

AutoAWQ 0.2.9 (its last release) was written for transformers 4.4x-4.51, so this runs in a venv of its own
(torch stays 2.13.0 CPU; autoawq goes in without its deps, which would pull triton; datasets only because
AutoAWQ imports it; nothing of pagoda is imported here):

    python3 -m venv /tmp/awqv && /tmp/awqv/bin/pip install torch==2.13.0 transformers==4.51.3 accelerate==1.15.0 \
        datasets==5.0.1 && /tmp/awqv/bin/pip install --no-deps autoawq==0.2.9
    PYTHONPATH=. /tmp/awqv/bin/python bench/autoawq_checkpoints.py MODEL_DIR OUT_DIR [awq-w4g64 ...]

For each scheme it writes:
- OUT_DIR/<scheme>/: the checkpoint as save_quantized writes it, with the source's tokenizer files;
- OUT_DIR/<scheme>-dequantized/: a float32 copy of the model whose q/k/v/o/gate/up/down weights are AutoAWQ's
  dequantize_gemm of the packed tensors (scales cast to float32 first) and whose other tensors come from the AWQ
  checkpoint, not the source: AWQ folds its input scales into the RMSNorm weights;
- OUT_DIR/<scheme>.tool.json: two prompts and the first 16 greedy tokens transformers generates from the
  checkpoint loaded back by AutoAWQ's from_quantized.

Calibration: 8 x 64 tokens of the Jargon File past the text bench/quant_ppl.py scores (its first 8192 tokens),
so the scored text stays held out. Groups of 64: SmolLM2-135M's 576 inputs are not a multiple of 128, which
AutoAWQ asserts. Float32 weights in, as float16 is slow on CPUs without half arithmetic (AutoAWQ still rounds
the weights and keeps the scales in float16).

AutoAWQ is a GPU tool; on the CPU this needs (each where it is done, below):
- a fix to its scale search, which on the CPU compounds every grid point's scaling (a garbled model otherwise);
- its clip search over 32 of the tokens, not 512, and one torch thread, for about 7 s a layer on 2 shared
  cores (its default, pile at 128 x 512, took 6 minutes a layer and needs the network);
- from_quantized without its switch to IPEX kernels (intel-extension-for-pytorch has no build for torch 2.13):
  the greedy tokens come from WQLinear_GEMM's plain-torch fallback, dequantize_gemm and a float16 matmul.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from bench.tool_common import calibration_rows, greedy, prompts, write_float_copy, write_record

SCHEMES = {"awq-w4g64": {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}}
CLIP_TOKENS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _quantizer_cls():
    from awq.quantize.quantizer import AwqQuantizer

    class CpuAwqQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, *rest):
            # The grid search scales the weights in place and restores them from `state_dict()` moved by .cpu(),
            # a copy only on a GPU: on the CPU each grid point compounded the last one's scales (layer 0's
            # output 58% off the float model's, against 10% for plain rounding). Hand it copies.
            state_dict = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {n: t.clone() for n, t in state_dict(*a, **k).items()}
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect, *rest)
            finally:
                del module2inspect.state_dict  # the class's method again

        def _compute_best_clip(self, w: torch.Tensor, input_feat: torch.Tensor) -> torch.Tensor:
            # Its cost grows with the tokens it samples (512 by default, not an argument of quantize()): 45 of a
            # layer's 58 s here. 32 of the 512 calibration tokens; the scale search still sees all of them.
            return super()._compute_best_clip(w, input_feat, n_sample_token=CLIP_TOKENS)

    return CpuAwqQuantizer


def _copy_tokenizer(src: Path, dst: Path) -> None:
    # Copied, not re-saved: transformers 4.51 would rewrite a 5.x tokenizer_config.json under another class name.
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def _dequantize(quant: Path, dst: Path, bits: int, group: int) -> None:
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    packed = load_file(quant / "model.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for name, value in packed.items():
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            scales = packed[prefix + ".scales"].float()
            # dequantize_gemm gives (in, out); an nn.Linear weight is (out, in).
            tensors[prefix + ".weight"] = dequantize_gemm(value, packed[prefix + ".qzeros"], scales, bits, group).t()
        elif not name.endswith((".qzeros", ".scales")):
            tensors[name] = value
    write_float_copy(quant, dst, tensors)


def _greedy(quant: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    import awq.models.base
    from awq import AutoAWQForCausalLM
    from awq.modules.linear import WQLinear_GEMM

    # from_quantized switches CPU models to IPEX kernels (not installable with torch 2.13); any device name
    # but "cpu" keeps WQLinear_GEMM, whose forward falls back to plain torch without its CUDA extension.
    best_device = awq.models.base.get_best_device
    awq.models.base.get_best_device = lambda: "cpu-without-ipex"
    try:
        model = AutoAWQForCausalLM.from_quantized(
            str(quant), torch_dtype=torch.float32, fuse_layers=False, device_map={"": "cpu"}
        )
    finally:
        awq.models.base.get_best_device = best_device
    # Float32 around the kernels, as pagoda's tests run (in float16 the chat prompt's first token, a 0.02-logit
    # tie, flipped). The load cast the float16 scales to float32 too, and the kernel's float16 matmul wants them
    # back: exact, float16 -> float32 -> float16.
    for module in model.model.modules():
        if isinstance(module, WQLinear_GEMM):
            module.scales = module.scales.half()
    return greedy(model.model, prompt_ids)


def main() -> None:
    from awq import AutoAWQForCausalLM
    from transformers import PreTrainedTokenizerFast

    # One thread: with the other core busy with other jobs, two threads' OpenMP barriers made a layer 5x slower.
    torch.set_num_threads(1)
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    # The class, not AutoTokenizer: transformers 4.51 does not know the 5.x "TokenizersBackend" the config names.
    tok = PreTrainedTokenizerFast.from_pretrained(src)
    prompt_ids = prompts(tok)
    calib = calibration_rows(tok, 8, 64)
    for scheme in sys.argv[3:] or list(SCHEMES):
        start = time.perf_counter()
        cfg = SCHEMES[scheme]
        model = AutoAWQForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32, device_map={"": "cpu"})
        model.quantize(
            tok,
            quant_config=cfg,
            calib_data=calib,
            max_calib_samples=len(calib),
            max_calib_seq_len=len(calib[0]),
            quantizer_cls=_quantizer_cls(),
        )
        model.save_quantized(str(out / scheme))
        _copy_tokenizer(src, out / scheme)
        print(f"{scheme}: quantized in {time.perf_counter() - start:.0f} s", flush=True)
        _dequantize(out / scheme, out / f"{scheme}-dequantized", cfg["w_bit"], cfg["q_group_size"])
        write_record(out / f"{scheme}.tool.json", "autoawq 0.2.9", prompt_ids, _greedy(out / scheme, prompt_ids))
        print(f"{scheme}: {out / scheme} in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
