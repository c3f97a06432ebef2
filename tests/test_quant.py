"""Quantized checkpoints and load-time quantization (engine/quant): layouts, detection, and models that load them.

The checkpoints are written by bench/quant_checkpoints.py in the tools' exact on-disk formats (round-to-nearest
values packed by pagoda's packers; no quantizing tool runs here, see README). The layouts are also checked
against words built by hand from the formats' definitions, so a packer and unpacker wrong the same way fail.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from bench.live_bytes import LiveBytes
from bench.quant_checkpoints import LINEARS, RECIPES, write
from engine.layers.linear import FP8, ScaledLinear, quantize_per_row
from engine.quant import (
    IntWeight,
    UnsupportedQuantization,
    awq,
    compressed_tensors,
    detect_scheme,
    gptq,
    pack_int32,
    quantize_rtn,
    unpack_int32,
)


def _rand_int_weight(k: int, n: int, bits: int, group: int, seed: int, act_order: bool = False) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    top = 1 << bits
    groups = k // group
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=g)] = torch.arange(k, dtype=torch.int32) // group
    return IntWeight(
        torch.randint(0, top, (k, n), generator=g, dtype=torch.int32),
        torch.rand(groups, n, generator=g).half() + 0.01,
        torch.randint(0, top, (groups, n), generator=g, dtype=torch.int32),
        bits,
        group,
        g_idx,
    )


def _same(a: IntWeight, b: IntWeight) -> None:
    assert torch.equal(a.q, b.q) and torch.equal(a.zeros, b.zeros) and torch.equal(a.scales, b.scales)
    assert (a.bits, a.group_size) == (b.bits, b.group_size)
    assert (a.g_idx is None) == (b.g_idx is None) and (a.g_idx is None or torch.equal(a.g_idx, b.g_idx))


# ----- layouts -----


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_int32_packing_round_trips_with_the_top_bit_set(bits, dim):
    values = torch.randint(0, 1 << bits, (16, 32), dtype=torch.int32)
    values[0, :] = (1 << bits) - 1  # words whose top bit is set are negative int32s
    packed = pack_int32(values, bits, dim)
    assert packed.dtype == torch.int32 and (packed < 0).any()
    assert torch.equal(unpack_int32(packed, bits, dim), values)


def test_packed_fields_run_from_the_low_bits():
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_int32(word, 4, dim=0).flatten().tolist() == list(range(8))
    assert unpack_int32(torch.tensor([[0x04030201]], dtype=torch.int32), 8, dim=1).flatten().tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("bits, group, act_order", [(4, 32, False), (4, 64, True), (8, 128, False), (8, 128, True)])
@pytest.mark.parametrize("v2", [False, True])
def test_gptq_round_trip(bits, group, act_order, v2):
    w = _rand_int_weight(256, 64, bits, group, seed=bits + group, act_order=act_order)
    scheme = gptq.GPTQ(bits, group, v2=v2, sym=False, desc_act=act_order)
    _same(scheme.unpack(gptq.pack(w, v2=v2)), w)


def test_gptq_v1_stores_zero_points_minus_one():
    """auto-gptq's format: a symmetric 4-bit zero point of 8 is stored as 7 (0x77777777 words), and a zero
    point of 0 wraps to 15; gptq_v2 stores 8 and 0 themselves."""
    k, n = 32, 8
    q = torch.zeros(k, n, dtype=torch.int32)
    zeros = torch.full((1, n), 8, dtype=torch.int32)
    zeros[0, 1] = 0
    w = IntWeight(q, torch.ones(1, n).half(), zeros, 4, k)
    v1 = gptq.pack(w)["qzeros"]
    assert unpack_int32(v1, 4, dim=1)[0].tolist() == [7, 15, 7, 7, 7, 7, 7, 7]
    assert unpack_int32(gptq.pack(w, v2=True)["qzeros"], 4, dim=1)[0].tolist() == [8, 0, 8, 8, 8, 8, 8, 8]
    assert (
        gptq.GPTQ(4, -1, v2=False, sym=True, desc_act=False).unpack(gptq.pack(w)).zeros[0].tolist() == zeros[0].tolist()
    )


def test_awq_interleaves_columns_within_a_word():
    """AutoAWQ's GEMM packer puts column AWQ_ORDER[i] of each eight in field i: fields 0..7 holding 0..7
    mean columns 0..7 hold 0, 4, 1, 5, 2, 6, 3, 7."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    t = {"qweight": word, "qzeros": word, "scales": torch.ones(1, 8).half()}
    w = awq.AWQ(-1).unpack(t)
    assert w.q[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert w.zeros[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("group", [32, 128])
def test_awq_round_trip(group):
    w = _rand_int_weight(256, 64, 4, group, seed=group)
    _same(awq.AWQ(group).unpack(awq.pack(w)), w)


@pytest.mark.parametrize("bits, group, symmetric", [(4, 128, True), (4, 32, False), (8, -1, True), (8, 64, False)])
def test_compressed_tensors_round_trip(bits, group, symmetric):
    k, n = 256, 40  # N not a multiple of 8: asymmetric zero points are packed along N with padding
    w = quantize_rtn(torch.randn(n, k), bits, group, symmetric)
    scheme = compressed_tensors.CompressedWeightOnly(bits, None if group == -1 else group)
    tensors = compressed_tensors.pack(w, symmetric)
    assert tensors["weight_packed"].shape == (n, k * bits // 32)
    assert tensors["weight_shape"].tolist() == [n, k]
    _same(scheme.unpack(tensors), w)


def test_compressed_tensors_stores_signed_values_offset():
    """pack_to_int32 stores a signed q as q + 2**(bits-1): stored field 0 is q = -8, i.e. 8 below the
    (symmetric) zero point."""
    t = {
        "weight_packed": torch.zeros(1, 1, dtype=torch.int32),
        "weight_scale": torch.ones(1, 1),
        "weight_shape": torch.tensor([1, 8]),
    }
    w = compressed_tensors.CompressedWeightOnly(4, None).unpack(t)
    assert w.dequantize().flatten().tolist() == [-8.0] * 8


def test_rtn_dequantizes_within_half_a_step():
    weight = torch.randn(48, 256)
    for symmetric in (True, False):
        w = quantize_rtn(weight, 4, 64, symmetric)
        step = w.scales.float().repeat_interleave(64, 0).t()
        assert ((w.dequantize().t() - weight).abs() <= step / 2 + 1e-6).all()


# ----- detection -----


def _dir_with(tmp_path, qc: dict | None, files: dict | None = None):
    cfg = {"architectures": ["LlamaForCausalLM"]}
    if qc is not None:
        cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name, body in (files or {}).items():
        (tmp_path / name).write_text(json.dumps(body))
    return cfg


def test_detection_reads_config_and_the_older_side_files(tmp_path):
    cfg = _dir_with(tmp_path, None, {"quantize_config.json": {"bits": 4, "group_size": 128, "desc_act": True}})
    scheme = detect_scheme(cfg, tmp_path)
    assert isinstance(scheme, gptq.GPTQ) and scheme.desc_act and not scheme.v2
    cfg = _dir_with(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM"})
    assert isinstance(detect_scheme(cfg, tmp_path, "awq"), awq.AWQ)
    cfg = _dir_with(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "gptq_v2"})
    assert detect_scheme(cfg, tmp_path).v2
    assert detect_scheme(_dir_with(tmp_path / "..", None), tmp_path / "..") is None


@pytest.mark.parametrize(
    "qc, override, words",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None, ["bits=3", "supported: bits 4/8"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, None, ["marlin"]),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None, ["version=gemv", "gemm"]),
        ({"quant_method": "bitsandbytes"}, None, ["'bitsandbytes'", "gptq, awq, compressed-tensors"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "awq", ["quantized with gptq", "--quantization awq"]),
        (None, "gptq", ["needs a checkpoint quantized with it"]),
        (None, "marlin", ["not supported", "gptq, awq, compressed-tensors, fp8, int8"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": "x"}, None, ["group_size should be an integer, not 'x'"]),
        ({"quant_method": "awq", "w_bit": 4.5}, None, ["w_bit should be an integer, not 4.5"]),
        ([{"quant_method": "gptq"}], None, ["quantization_config should be an object"]),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
                "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
            None,
            ["weights int4 group", "group_size None"],
        ),
        (
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
                "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
            None,
            ["weights float4 tensor_group", "W4A16 / W8A16"],
        ),
    ],
)  # fmt: skip
def test_unsupported_quantization_fails_naming_what_and_what_is_supported(tmp_path, qc, override, words):
    cfg = _dir_with(tmp_path, qc)
    with pytest.raises(UnsupportedQuantization) as err:
        detect_scheme(cfg, tmp_path, override)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_load_time_schemes_need_no_config(tmp_path):
    cfg = _dir_with(tmp_path, None)
    assert detect_scheme(cfg, tmp_path, "fp8").name == "fp8"
    assert detect_scheme(cfg, tmp_path, "int8").name == "int8"


# ----- W8A8 reference -----


@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_scaled_linear_reference_is_close_to_the_float_product(qdtype):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 128, generator=g), torch.randn(5, 128, generator=g)
    q, scale = quantize_per_row(w, qdtype)
    layer = ScaledLinear(q, scale.flatten(), None, torch.float32)
    out, exact = layer(x), x @ w.t()
    tol = 0.08 if qdtype == FP8 else 0.02  # E4M3 keeps 3 mantissa bits, int8 ~7
    assert (out - exact).norm() / exact.norm() < tol
    assert (out - exact).norm() / exact.norm() > 1e-4  # it did quantize


# ----- whole models -----

LOGIT_RECIPES = ["gptq-w4g128", "gptq-w4g32-actorder", "gptq-w8g-1", "gptqv2-w4g64-asym", "awq-w4g128",
                 "ct-w4a16-g32-asym", "ct-w8a16-channel"]  # fmt: skip


@pytest.fixture(scope="module")
def quantized_dirs(tiny_model_dir, tmp_path_factory):
    """Recipe name -> a tiny Qwen2 (fused qkv with bias, tied head) checkpoint written in that format, groups of
    128 made 32 (the tiny model's layers have 64 inputs)."""
    made = {}

    def make(name: str):
        if name not in made:
            recipe = RECIPES[name]
            if recipe.group_size > 32:
                recipe = dataclasses.replace(recipe, group_size=32)
            made[name] = write(tiny_model_dir("qwen2"), tmp_path_factory.mktemp(name), recipe)
        return made[name]

    return make


PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [5, 6, 7], list(range(40, 80))]


@pytest.mark.parametrize("name", LOGIT_RECIPES)
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(quantized_dirs, name):
    """pagoda serving a quantized checkpoint gives the greedy tokens transformers gives on the weights it
    dequantizes to (fused qkv with bias and fused gate/up concatenated from their quantized shards)."""
    from tests.test_greedy_equality import hf_greedy, pagoda_greedy

    qdir = quantized_dirs(name)
    expected = hf_greedy(qdir / "reference", PROMPTS, 16)
    got, llm = pagoda_greedy(qdir, PROMPTS, 16, {}, alone=False)
    assert got == expected
    assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # dequantized on CPU


def test_gptq_checkpoint_with_a_quantized_lm_head_matches_transformers(tiny_model_dir, tmp_path):
    """GPTQModel quantizes the LM head too when asked (`lm_head: true`, lm_head.qweight / qzeros / scales / g_idx
    beside the layers'): pagoda takes it like any other quantized linear, and its greedy tokens are transformers'
    on the dequantized weights, the head's included."""
    from safetensors.torch import load_file, save_file

    from tests.test_greedy_equality import hf_greedy, pagoda_greedy

    qdir = write(tiny_model_dir("llama"), tmp_path / "q", dataclasses.replace(RECIPES["gptq-w4g128"], group_size=32))
    tensors = load_file(qdir / "model.safetensors")
    head = quantize_rtn(tensors.pop("lm_head.weight").float(), 4, 32)
    head = dataclasses.replace(head, scales=head.scales.half())  # as GPTQ stores them
    tensors |= {f"lm_head.{k}": v for k, v in gptq.pack(head).items()}
    save_file(tensors, qdir / "model.safetensors")
    reference = load_file(qdir / "reference" / "model.safetensors")
    reference["lm_head.weight"] = head.dequantize().t().contiguous()
    save_file(reference, qdir / "reference" / "model.safetensors")
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["lm_head"] = True
    (qdir / "config.json").write_text(json.dumps(config))

    expected = hf_greedy(qdir / "reference", PROMPTS, 16)
    got, llm = pagoda_greedy(qdir, PROMPTS, 16, {}, alone=False)
    assert got == expected
    assert torch.equal(llm.engine.runner.model.lm_head.weight, reference["lm_head.weight"])  # dequantized on CPU


@pytest.mark.parametrize("name", ["ct-w8a8-int8", "ct-w8a8-fp8", "ct-w8a8-int8-static", "ct-w8a8-fp8-static"])
def test_w8a8_matches_transformers_rounding_inputs_the_same_way(quantized_dirs, name):
    """pagoda's W8A8 logits are transformers' on the dequantized weights with every linear's input rounded to
    8 bits as the checkpoint says: per token (dynamic), or at the layer's calibrated per-tensor scale (static)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from bench.quant_ppl import prompt_logits
    from engine.llm import LLM

    qdir = quantized_dirs(name)
    scales = {k.rpartition(".")[0]: v for k, v in load_file(qdir / "model.safetensors").items() if "input_scale" in k}
    qdtype = torch.int8 if "int8" in name else FP8
    qmax = 127.0 if qdtype == torch.int8 else 448.0

    def round_input(module, args, scale):
        if scale is None:  # dynamic: each token's absolute maximum maps to qmax
            scale = args[0].abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
        q = (args[0] / scale).clamp(-qmax, qmax)
        return ((q.round() if qdtype == torch.int8 else q.to(FP8).float()) * scale,)

    ref = AutoModelForCausalLM.from_pretrained(qdir / "reference", dtype=torch.float32).eval()
    for module_name, module in ref.named_modules():
        if module_name.rpartition(".")[2] in LINEARS:
            scale = scales[module_name].float() if scales else None
            module.register_forward_pre_hook(lambda m, a, s=scale: round_input(m, a, s))
    ids = PROMPTS[2]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    llm = LLM(model=str(qdir), device="cpu", dtype="float32", max_model_len=64, cpu_kv_cache_bytes=8 << 20)
    layer = llm.engine.runner.model.layers[0].mlp.down_proj
    assert (layer.input_scale is not None) == name.endswith("static") and layer.weight.dtype == qdtype
    got = prompt_logits(llm, ids)
    assert (got - expected).norm() / expected.norm() < 1e-3


def test_prompt_logits_leaves_no_stale_prefix_cache_behind(tiny_model_dir):
    """bench.quant_ppl.prompt_logits writes K/V into blocks an earlier request left in the prefix cache; a later
    request with that prompt must not find them (it did: its greedy tokens went wrong from the second)."""
    from bench.quant_ppl import prompt_logits
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=str(tiny_model_dir("llama")), device="cpu", dtype="float32", cpu_kv_cache_bytes=8 << 20)
    prompt = list(range(1, 41))  # two full blocks of 16 tokens, cached once the request ends
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    prompt_logits(llm, list(range(200, 240)))
    after = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


@pytest.mark.parametrize("quantization, tol", [("int8", 0.02), ("fp8", 0.1)])
def test_load_time_quantization_stays_close_to_full_precision(tiny_model_dir, quantization, tol):
    from engine.attention.torch_ref import TorchBackend
    from engine.loader import load_model

    model_dir = tiny_model_dir("llama")
    full, _ = load_model(model_dir, torch.float32, torch.device("cpu"), backend=TorchBackend())
    quant, _ = load_model(
        model_dir, torch.float32, torch.device("cpu"), backend=TorchBackend(), quantization=quantization
    )
    gen = torch.Generator().manual_seed(3)
    for a, b in [(full.layers[0].self_attn.qkv_proj, quant.layers[0].self_attn.qkv_proj),
                 (full.layers[1].mlp.down_proj, quant.layers[1].mlp.down_proj)]:  # fmt: skip
        x = torch.randn(7, a.in_features, generator=gen)
        ref, out = a(x), b(x)
        err = (out - ref).norm() / ref.norm()
        assert 1e-5 < err < tol
    assert type(quant.lm_head) is torch.nn.Linear  # the LM head stays full precision


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    """A Llama of 8 tiny layers and a 64-token vocabulary: its linears are nearly all of its weights, so that
    reading the embedding is not the largest thing a load holds for a while."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deep_llama")
    LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 64, "num_hidden_layers": 8})).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "name, load_format",
    [("gptq-w4g128", "auto"), ("awq-w4g128", "auto"), ("ct-w8a8-int8", "auto"), ("ct-w8a8-int8", "dummy"),
     ("fp8", "auto"), ("int8", "auto"), ("int8", "dummy")],
)  # fmt: skip
def test_quantized_load_never_holds_the_full_precision_linears(deep_llama_dir, tmp_path, name, load_format):
    """Loading a quantized checkpoint allocates no full-precision weight for the linears it quantizes (a 32B GPTQ
    model's 65 GB of bf16 weights would not let its 18 GB of packed ones load on an 80 GB GPU); a dummy load of a
    quantized config.json, and `--quantization fp8 / int8` on a full-precision checkpoint (a 70B bf16 model
    served in fp8 on one 141 GB GPU), hold them one layer at a time: the bytes the load holds at its peak exceed
    what the loaded model keeps by less than half those linears' full-precision size. Once loaded, nothing but
    the model is alive (a name -> parameter map kept for loading held 12 GiB of a W4A16 Llama-3-8B's replaced
    16-bit weights). On the CPU a weight-only layer is dequantized, so its final weight counts in what the model
    keeps."""
    from engine.loader import load_model

    if name in ("fp8", "int8"):  # quantized at load from the full-precision checkpoint
        qdir, quantization = deep_llama_dir, name
    else:
        recipe = dataclasses.replace(RECIPES[name], group_size=min(RECIPES[name].group_size, 32))
        qdir, quantization = write(deep_llama_dir, tmp_path, recipe), None
    full, _ = load_model(deep_llama_dir, torch.float32, torch.device("cpu"))
    linears = sum(m.weight.nbytes for n, m in full.named_modules() if type(m) is torch.nn.Linear and n != "lm_head")
    with LiveBytes() as watch:
        model, _ = load_model(
            qdir, torch.float32, torch.device("cpu"), load_format=load_format, quantization=quantization
        )
    held = [*model.parameters(), *model.buffers()]
    held += [t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]  # K/V scales
    kept = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}.values())
    assert watch.live == kept  # what the load allocated and still holds is the model: the count sees it all
    assert watch.peak - kept < linears / 2


@pytest.mark.parametrize("name", ["gptq-w4g128", "awq-w4g128", "ct-w4a16-g128", "ct-w8a8-int8", "ct-w8a8-fp8-static"])
def test_dummy_weights_of_a_quantized_config_are_quantized(tiny_model_dir, tmp_path, name):
    """load_format="dummy" with a quantized config.json (benchmarks at shapes with no checkpoint at hand):
    every linear but the LM head holds the scheme's rounding of the random weight."""
    import shutil

    from bench.quant_checkpoints import _quantization_config
    from engine.loader import load_model

    recipe = dataclasses.replace(RECIPES[name], group_size=min(RECIPES[name].group_size, 32))
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config(recipe)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), load_format="dummy")
    layers = [model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj]
    assert type(model.lm_head) is torch.nn.Linear
    if recipe.bits == 8:  # W8A8: 8-bit weights served as such
        assert all(isinstance(layer, ScaledLinear) for layer in layers)
        assert all((layer.input_scale is not None) == recipe.static_input for layer in layers)
        return
    for layer in layers:  # W4A16 on the CPU: dequantized, so at most 16 values per group of 32 inputs of a row
        groups = layer.weight.detach().reshape(layer.out_features, -1, 32)
        assert max(len(torch.unique(g)) for g in groups.reshape(-1, 32)[:64]) <= 16
        assert len(torch.unique(layer.weight)) > 16


@pytest.mark.parametrize("name", ["gptq-w4g128", "ct-w8a8-fp8", None])  # None: --quantization int8
def test_dummy_quantized_layers_round_the_full_precision_dummy_weights(tiny_model_dir, tmp_path, name):
    """A dummy load of a quantized config makes each quantized linear's random weight only as it quantizes it, yet
    from the same seed: every layer is the scheme's rounding of the weight a full-precision dummy load holds."""
    import shutil

    from bench.quant_checkpoints import _quantization_config
    from engine.loader import load_model

    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    if name is not None:
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg["quantization_config"] = _quantization_config(dataclasses.replace(RECIPES[name], group_size=32))
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    quantization = None if name else "int8"
    model, hf_config = load_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", quantization=quantization)
    full, _ = load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"), "dummy")
    scheme = detect_scheme(hf_config, tmp_path, quantization)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    for layer in ["layers.0.self_attn.qkv_proj", "layers.1.self_attn.o_proj", "layers.1.mlp.down_proj"]:
        weight = full.get_submodule(layer).weight
        expected = scheme.make_linear([scheme.tensors_of(weight.detach())], None, torch.float32)
        got = model.get_submodule(layer)
        assert type(got) is type(expected)
        assert torch.equal(got(x[:, : weight.shape[1]]), expected(x[:, : weight.shape[1]]))
    assert torch.equal(model.lm_head.weight, full.lm_head.weight) and torch.equal(model.norm.weight, full.norm.weight)


K_PROJ = "model.layers.0.self_attn.k_proj."  # the tiny model's: 64 inputs, 32 outputs


def _shorter(suffix: str, dim: int = 0):
    """An edit of a checkpoint's tensors: k_proj's `suffix` one row (or column) short."""

    def edit(t: dict) -> None:
        tensor = t[K_PROJ + suffix]
        t[K_PROJ + suffix] = tensor.narrow(dim, 0, tensor.shape[dim] - 1).clone()

    return edit


def _set(suffix: str, change):
    return lambda t: t.__setitem__(K_PROJ + suffix, change(t[K_PROJ + suffix]))


def _drop(*suffixes: str):
    return lambda t: [t.pop(K_PROJ + s) for s in suffixes]


# case -> (recipe, edit of the tensors, edit of quantization_config, words the message holds)
QUANT_CORRUPTIONS = {
    "a fused shard's tensors missing": (
        "gptq-w4g128", _drop("qweight", "qzeros", "scales", "g_idx"), None,
        ["quantized layers.0.self_attn.q_proj but not layers.0.self_attn.k_proj beside it"],
    ),
    "gptq qweight a row short": (
        "gptq-w4g128", _shorter("qweight"), None,
        ["layers.0.self_attn.k_proj: qweight is int32 [7, 32]", "64 inputs and 32 outputs", "needs int32 [8, 32]"],
    ),
    "gptq qweight of floats": ("gptq-w4g128", _set("qweight", torch.Tensor.float), None, ["qweight is float32"]),
    "gptq scales a column short": ("gptq-w4g128", _shorter("scales", 1), None, ["scales is float16 [2, 31]"]),
    "gptq g_idx past the groups": (
        "gptq-w4g32-actorder", _set("g_idx", lambda g: g + 100), None, ["k_proj: g_idx names group", "groups 0 to 1"],
    ),
    "gptq g_idx a row short": ("gptq-w4g32-actorder", _shorter("g_idx"), None, ["g_idx is int32 [63]"]),
    "gptq config's groups contradict the tensors": (
        "gptq-w4g128", None, {"group_size": 64},
        ["layers.0.self_attn.q_proj: qzeros is int32 [2, 8]", "(4-bit, 1 group of 64) needs int32 [1, 8]"],
    ),
    "gptq config's bits contradict the tensors": (
        "gptq-w4g128", None, {"bits": 8}, ["q_proj: qweight is int32 [8, 64]", "(8-bit, 2 groups of 32)"],
    ),
    "awq qzeros a row short": ("awq-w4g128", _shorter("qzeros"), None, ["qzeros is int32 [1, 4]", "[2, 4]"]),
    "compressed-tensors weight_packed a row short": (
        "ct-w4a16-g32-asym", _shorter("weight_packed"), None, ["weight_packed is int32 [31, 8]"],
    ),
    "compressed-tensors zero points of one group": (
        "ct-w4a16-g32-asym", _shorter("weight_zero_point", 1), None, ["weight_zero_point is int32 [4, 1]"],
    ),
    "compressed-tensors weight_shape contradicts config.json": (
        "ct-w4a16-g32-asym", _set("weight_shape", lambda s: s * 2), None, ["weight_shape is [64, 128]", "[32, 64]"],
    ),
    "W8A8 fp8 scales a row short": (
        "ct-w8a8-fp8", _shorter("weight_scale"), None, ["weight_scale is float32 [31, 1]", "needs 32 float values"],
    ),
    "W8A8 int8 weight a row short": ("ct-w8a8-int8", _shorter("weight"), None, ["weight is int8 [31, 64]"]),
    "W8A8 fp8 weight stored as int8": (
        "ct-w8a8-fp8", _set("weight", lambda w: w.view(torch.int8)), None, ["weight is int8", "float8_e4m3fn"],
    ),
    "W8A8 static without its input_scale": (
        "ct-w8a8-int8-static", _drop("input_scale"), None, ["k_proj: input_scale is missing"],
    ),
}  # fmt: skip


def _corrupted_copy(quantized_dirs, tmp_path, case: str) -> tuple[Path, list[str]]:
    """A copy of the case's checkpoint, corrupted as QUANT_CORRUPTIONS says; the words its error must hold."""
    import shutil

    from safetensors.torch import load_file, save_file

    name, edit, qc_edit, words = QUANT_CORRUPTIONS[case]
    src = quantized_dirs(name)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    if edit is not None:
        tensors = load_file(src / "model.safetensors")
        edit(tensors)
        save_file(tensors, tmp_path / "model.safetensors")
    if qc_edit is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"].update(qc_edit)
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, words


@pytest.mark.parametrize("case", list(QUANT_CORRUPTIONS))
def test_corrupted_quantized_checkpoint_fails_at_load_naming_the_layer_and_tensor(quantized_dirs, tmp_path, case):
    """A quantized checkpoint whose tensors do not fit config.json (missing, a row short, of another dtype, group
    indices past the groups, a config whose bits or groups contradict them) is refused at load with one line
    naming the directory, the layer, the tensor as it is and what the layer needs; before the tensors were
    checked, some of these loaded and failed at the first request (W8A8 scales a row short), others ended in a
    bare torch error (a qweight of floats: "rshift_cpu" not implemented)."""
    from engine.loader import ModelLoadError, load_model

    path, words = _corrupted_copy(quantized_dirs, tmp_path, case)
    with pytest.raises(ModelLoadError) as err:
        load_model(path, torch.float32, torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    for word in words:
        assert word in message, message


def test_serve_refuses_a_corrupted_quantized_checkpoint_in_one_line(quantized_dirs, tmp_path, default_model_dir):
    """`pagoda serve` on a W8A8 checkpoint whose scales are a row short (which loaded, then failed at the first
    request) exits 1 before listening, its last line the loader's, with no traceback."""
    import shutil
    import subprocess
    import sys

    path, words = _corrupted_copy(quantized_dirs, tmp_path, "W8A8 fp8 scales a row short")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_dir) / name, path / name)
    pagoda = Path(sys.executable).with_name("pagoda")
    cmd = [str(pagoda), "serve", str(path), "--port", "0", "--dtype", "float32", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pagoda serve: {path}: layers.0.self_attn.k_proj: "), last
    assert all(word in last for word in words), last


# ----- the Triton W4A16 / W8A16 kernel (Triton's interpreter without a GPU, at small shapes) -----

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("bits, group, k", [(4, 32, 256), (4, 64, 256), (8, -1, 256), (4, -1, 256), (4, 128, 192)])
@pytest.mark.parametrize("m", [1, 3, 37, 70])  # the GEMV, the decode tl.dot kernel, prompt tiles with a ragged edge
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_only_kernel_matches_the_dequantized_reference(bits, group, k, m, dtype):
    """Including a short last group: 192 inputs in groups of 128 (SmolLM2's 576 are 4.5 groups of 128)."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import weight_only_matmul

    n = 96
    g = torch.Generator().manual_seed(m * 7 + bits)
    w = quantize_rtn(torch.randn(n, k, generator=g), bits, group, symmetric=bits == 8)
    x = torch.randn(m, k, generator=g).to(dtype)
    ref = x.float() @ w.dequantize().to(dtype).float()
    qweight = pack_int32(w.q, bits, dim=0)
    out = weight_only_matmul(x.to(DEV), qweight.to(DEV), w.scales.to(dtype).to(DEV), w.zeros.to(dtype).to(DEV),
                             bits, w.group_size)  # fmt: skip
    assert out.dtype == dtype and out.shape == (m, n)
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("k, n_full", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)])
def test_weight_only_kernel_decode_tiles_at_llama_8b_depths(k, n_full):
    """Decode, W4 g128, at Llama-3-8B's real K: the decode tl.dot kernel at 16 rows with the tiles an H100
    (132 SMs) picks for the layer's full N and large split tiles, and the GEMV at one row with the tiles for
    the shape; N is cut to 256 outputs (the interpreter is slow), which changes no program's work."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import gemv_tiles, mid_rule, mid_tiles, weight_only_matmul
    from engine.kernels.quant_tiles import MidTiles

    n = 256
    g = torch.Generator().manual_seed(k + n_full)
    w = quantize_rtn(torch.randn(n, k, generator=g), 4, 128)
    x = torch.randn(16, k, generator=g).half()
    ref = x.float() @ w.dequantize().half().float()
    args = (pack_int32(w.q, 4, dim=0).to(DEV), w.scales.half().to(DEV), w.zeros.half().to(DEV), 4, 128)
    counters = torch.zeros(n // 16, dtype=torch.int32, device=DEV)
    rule = mid_rule(16, n_full, k, 128, num_sms=132)  # K split to about two programs per SM
    assert rule.split == {6144: 16, 4096: 16, 28672: 4}[n_full]
    for config in (
        mid_tiles(4, 16, n_full, k, 128, num_sms=132),
        rule,
        MidTiles(16, 128, 128, 16, num_warps=8, num_stages=4, trans=True),
    ):
        # No fragment copies: the table's fragment tiles run as their plain twins on the packed weight.
        out = weight_only_matmul(x.to(DEV), *args, config=config, counters=counters, fragments={})
        assert (out.cpu().float() - ref).norm() / ref.norm() < 2e-3, config
        assert not counters.any()
    gemv = gemv_tiles(4, n_full, k, num_sms=132)  # on one slice of outputs: the rest is the same work
    qw, scales, zeros = (t[:, : gemv.block_n].contiguous() for t in args[:3])
    out = weight_only_matmul(x[:1].to(DEV), qw, scales, zeros, 4, 128, config=gemv)
    part = ref[:1, : gemv.block_n]
    assert (out.cpu().float() - part).norm() / part.norm() < 2e-3, gemv


@pytest.mark.parametrize("table", ["MID_TABLE", "MID_PLAIN_TABLE", "GEMV_TABLE"])
def test_every_table_tile_matches_the_reference_at_its_shape(table):
    """Every tile the GPU takes from the tables, at the table's K and groups (W4 g128, W8 per channel) and rows (16
    or 64 for the decode tl.dot kernel, one for the GEMV), against the dequantized reference: MID_TABLE's reading
    the fragment-layout copy a fragment tile reads, MID_PLAIN_TABLE's (which stand in for them without copies),
    GEMV_TABLE's. N is cut to one slice of the tile's width: every slice does the same work, K split as listed."""
    pytest.importorskip("triton")
    from engine.kernels import quant_tiles
    from engine.kernels.quant_gemm import fragment_pack, weight_only_matmul

    for key, tiles in getattr(quant_tiles, table).items():
        bits, k = key[:2]
        m = key[3] if len(key) == 4 else 1
        n = tiles.block_n
        g = torch.Generator().manual_seed(k + n + m)
        w = quantize_rtn(torch.randn(n, k, generator=g), bits, 128 if bits == 4 else -1, symmetric=bits == 8)
        x = torch.randn(m, k, generator=g).half()
        ref = x.float() @ w.dequantize().half().float()
        qweight = pack_int32(w.q, bits, dim=0).to(DEV)
        fragment = getattr(tiles, "fragment", 0)
        copies = {(fragment, tiles.trans): fragment_pack(qweight, fragment, tiles.trans)} if fragment else {}
        counters = torch.zeros(n // 16, dtype=torch.int32, device=DEV)
        rest = (w.scales.half().to(DEV), w.zeros.half().to(DEV), bits, w.group_size)
        out = weight_only_matmul(x.to(DEV), qweight, *rest, config=tiles, counters=counters, fragments=copies)
        assert (out.cpu().float() - ref).norm() / ref.norm() < 2e-3, (key, tiles)
        assert not counters.any()


def test_split_k_covers_decode_batches():
    from engine.kernels.quant_gemm import gemv_tiles, mid_rule, mid_tiles, tiles
    from engine.kernels.quant_tiles import MID_TABLE

    # A decode batch splits K to fill the GPU, one program covering all its rows.
    assert [mid_tiles(4, m, 4096, 4096, 128, num_sms=132).block_m for m in (3, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    # The rule for shapes MID_TABLE does not list (the 8B's are listed, from the H100 sweep).
    assert mid_rule(64, 4096, 4096, 128, num_sms=132).split == 8  # 32 slices of N; four steps of K each
    assert mid_rule(16, 28672, 4096, 128, num_sms=132).split == 4  # 112 slices of 256
    assert mid_rule(16, 4096, 14336, 128, num_sms=132).split == 16  # at most: the last program reads all
    assert mid_tiles(4, 16, 4096, 4096, 128, num_sms=132) == MID_TABLE[(4, 4096, 4096, 16)]
    assert mid_tiles(4, 16, 4096, 4096, 32, num_sms=132).block_k == 32  # the listed K step of 128 straddles groups
    assert tiles(256, 4096, 4096, 128).split == 1
    assert gemv_tiles(4, 4096, 4096, num_sms=132).split > 1  # 64 slices of N alone leave SMs idle
    assert gemv_tiles(4, 28672, 4096, num_sms=132).split == 1
    one, four = gemv_tiles(4, 4096, 4096, num_sms=132), gemv_tiles(4, 4096, 4096, num_sms=132, m=4)
    assert four.block_kw == one.block_kw // 2  # four rows' sums in registers: half the words a step


@pytest.mark.parametrize(
    "bits, group, symmetric, act_order",
    [(4, 32, False, True), (4, 128, True, False), (8, 64, False, False), (8, -1, True, True), (4, -1, False, False)],
)
def test_decode_dot_kernel_matches_the_dequantized_reference(bits, group, symmetric, act_order):
    """The decode tl.dot kernel (one program covers all rows) at 3..64 rows: its default tiles and explicit
    ones with K split 1, 2 and 3 ways (the last span shorter), either operand order, the scale applied per
    step and once per program; an act-order layer's inputs read through its permutation. Each launch
    leaves the layer's counters zeroed, as CUDA graphs replaying it need. The masked unpack (MidTiles.masked)
    and the packed one (MidTiles.packed: two 4-bit fields an instruction on a GPU; 8-bit weights and the
    interpreter unpack masked) give the same weights exactly, so the same output bit for bit."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import weight_only_matmul
    from engine.kernels.quant_tiles import MidTiles
    from engine.layers.linear import WeightOnlyLinear

    k, n = 256, 40  # a ragged last slice of outputs
    g = torch.Generator().manual_seed(bits * 100 + group)
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=g)] = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
    w = quantize_rtn(torch.randn(n, k, generator=g), bits, group, symmetric, g_idx)
    layer = WeightOnlyLinear(w, None, torch.float16).to(DEV)
    assert (layer.perm is not None) == act_order
    args = (layer.qweight, layer.scales, layer.zeros, bits, w.group_size)
    bk = 32 if w.group_size % 64 else 64
    for m in (3, 5, 16, 17, 33, 64):
        x = torch.randn(m, k, generator=g).half()
        ref = x.float() @ w.dequantize().half().float()
        bm = max(16, 1 << (m - 1).bit_length())
        configs = [
            None,
            MidTiles(bm, 32, bk, 3, trans=True),
            MidTiles(bm, 16, bk, 2),
            MidTiles(bm, 64, 32, 1, trans=True),
        ]
        for config in configs:
            out = weight_only_matmul(x.to(DEV), *args, config=config, counters=layer.counters, perm=layer.perm)
            assert out.dtype == torch.float16 and out.shape == (m, n)
            torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2, msg=f"{m} rows, {config}")
            assert not layer.counters.any(), config
            if config is not None:
                other = dataclasses.replace(config, masked=not config.masked)
                again = weight_only_matmul(x.to(DEV), *args, config=other, counters=layer.counters, perm=layer.perm)
                assert torch.equal(again, out), other
                packed = dataclasses.replace(config, packed=True)
                again = weight_only_matmul(x.to(DEV), *args, config=packed, counters=layer.counters, perm=layer.perm)
                assert torch.equal(again, out) and not layer.counters.any(), packed


def test_fragment_layout_round_trips_and_places_each_input_where_the_mma_operand_wants_it():
    """fragment_pack (MidTiles.fragment's weight layout) and fragment_unpack are inverses, and the words are the
    layout's definition built by hand: output n's inputs in blocks of 128, a block's word (t, c) at 4t + c,
    its field (half, p1, p0) at bit 16 half + 8 p1 + 4 p0 holding input 32c + 16 half + 8 p1 + 2t + p0 for
    mma.sync's operand with kWidth 2, 32c + 16 half + 4t + 2 p1 + p0 with kWidth 4."""
    from engine.kernels.quant_gemm import fragment_pack, fragment_unpack

    k, n = 256, 32
    q = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    packed = pack_int32(q, 4, dim=0)
    for kwidth, t_at, p1_at in ((2, 2, 8), (4, 4, 2)):
        frag = fragment_pack(packed, kwidth)
        assert frag.shape == (n, k // 8) and frag.dtype == torch.int32
        assert torch.equal(fragment_unpack(frag, kwidth), packed)
        for col, block, t, c in ((0, 0, 0, 0), (5, 1, 2, 3), (23, 1, 3, 1), (11, 0, 1, 2)):
            word = 0
            for half, p1, p0 in itertools.product((0, 1), repeat=3):
                row = 128 * block + 32 * c + 16 * half + p1_at * p1 + t_at * t + p0
                word |= int(q[row, col]) << (16 * half + 8 * p1 + 4 * p0)
            assert int(frag[col, 16 * block + 4 * t + c]) & 0xFFFFFFFF == word, (kwidth, col, block, t, c)
    frag = fragment_pack(
        packed, 2, trans=True
    )  # per 16 outputs and 64 inputs: word (r, t, r8, c) at 16r + 4t + 2r8 + c
    assert frag.shape == (n, k // 8) and torch.equal(fragment_unpack(frag, 2, trans=True), packed)
    flat = frag.flatten()
    for group, block, r, t, r8, c in ((0, 0, 0, 0, 0, 0), (1, 3, 7, 2, 0, 1), (0, 2, 3, 3, 1, 0), (1, 1, 5, 1, 1, 1)):
        word = 0
        for half, p1, p0 in itertools.product((0, 1), repeat=3):
            row, col = 64 * block + 32 * c + 16 * half + 8 * p1 + 2 * t + p0, 16 * group + 8 * r8 + r
            word |= int(q[row, col]) << (16 * half + 8 * p1 + 4 * p0)
        at = (group * (k // 64) + block) * 128 + 16 * r + 4 * t + 2 * r8 + c
        assert int(flat[at]) & 0xFFFFFFFF == word, (group, block, r, t, r8, c)
    with pytest.raises(ValueError, match="blocks of 128"):
        fragment_pack(packed[:8])
    with pytest.raises(ValueError, match="N of 16"):
        fragment_pack(packed[:, :20], 2, trans=True)


@pytest.mark.parametrize("group, act_order", [(128, False), (32, True), (-1, False)])
def test_decode_dot_kernel_fragment_layout_matches_the_dequantized_reference(group, act_order):
    """The decode tl.dot kernel reading a 4-bit weight in the fragment layout (MidTiles.fragment) at 3..64 rows,
    BLOCK_K 32 / 64 / 128, BLOCK_N 16 / 32 / 64 (a ragged last slice), K split 1..3 ways, the scale per step or
    once per program, an act-order weight's inputs read through its permutation: the dequantized reference's
    output, and bit for bit the plain layout's with the masked unpack (the same weights and products) and its
    own with the packed one (MidTiles.packed); either operand order (the trans layout for wgmma's first
    operand, BLOCK_K 64 / 128). The knob is refused for 8 bits, kWidths and K steps a layout does not take."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import fragment_pack, weight_only_matmul
    from engine.kernels.quant_tiles import MidTiles
    from engine.layers.linear import WeightOnlyLinear

    k, n = 256, 48
    g = torch.Generator().manual_seed(group + 7)
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=g)] = torch.arange(k, dtype=torch.int32) // group
    w = quantize_rtn(torch.randn(n, k, generator=g), 4, group, False, g_idx)
    layer = WeightOnlyLinear(w, None, torch.float16).to(DEV)
    frags = {(kw, False): fragment_pack(layer.qweight, kw) for kw in (2, 4)}
    frags[2, True] = fragment_pack(layer.qweight, 2, trans=True)
    rest = (layer.scales, layer.zeros, 4, w.group_size)
    for m in (3, 16, 33, 64):
        x = torch.randn(m, k, generator=g).half().to(DEV)
        ref = x.cpu().float() @ w.dequantize().half().float()
        bm = max(16, 1 << (m - 1).bit_length())
        kinds = [(False, 2), (False, 4), (True, 2)]
        for (bn, bk, split), (trans, kw) in itertools.product(((16, 32, 3), (32, 128, 1), (64, 64, 2)), kinds):
            if w.group_size % bk or (trans and bk == 32):
                continue
            config = MidTiles(bm, bn, bk, split, trans=trans, masked=True, fragment=kw)
            frag = frags[kw, trans]
            out = weight_only_matmul(x, frag, *rest, config=config, counters=layer.counters, perm=layer.perm)
            torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2, msg=f"{m} rows, {config}")
            assert not layer.counters.any(), config
            plain = dataclasses.replace(config, fragment=0)
            again = weight_only_matmul(x, layer.qweight, *rest, config=plain, counters=layer.counters, perm=layer.perm)
            assert torch.equal(again, out), config
            packed = dataclasses.replace(config, packed=True)
            again = weight_only_matmul(x, frag, *rest, config=packed, counters=layer.counters, perm=layer.perm)
            assert torch.equal(again, out), packed
    x = torch.randn(16, k, generator=g).half().to(DEV)
    bad = (MidTiles(16, 32, 32, 1, trans=True, fragment=2), MidTiles(16, 32, 16, 1, fragment=2))
    for config in (*bad, MidTiles(16, 32, 64, 1, fragment=3), MidTiles(16, 32, 64, 1, trans=True, fragment=4)):
        with pytest.raises(ValueError, match="fragment"):
            weight_only_matmul(x, frags[2, False], *rest, config=config, perm=layer.perm)
    w8 = quantize_rtn(torch.randn(n, k, generator=g), 8, 64, False, None)
    layer8 = WeightOnlyLinear(w8, None, torch.float16).to(DEV)
    with pytest.raises(ValueError, match="4-bit"):
        weight_only_matmul(x, layer8.qweight.view(n, -1), layer8.scales, layer8.zeros, 8, 64,
                           config=MidTiles(16, 32, 64, 1, fragment=2))  # fmt: skip


def test_weight_only_linear_keeps_fragment_copies_that_fragment_tiles_read():
    """WeightOnlyLinear keeps a copy of its weight in each fragment layout it is given (by default those MID_TABLE's
    tiles for its shape read), none in the checkpoint's state; weight_only_matmul given the copies takes the plain
    weight whatever the tiles: fragment tiles read the copy in their layout (the fragment_pack'd weight's output
    bit for bit) and run as their plain twin where no copy is kept. Every fragment tile MID_TABLE lists tiles its
    shape in that layout."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import fragment_layouts, fragment_pack, weight_only_matmul
    from engine.kernels.quant_tiles import MID_TABLE, MidTiles
    from engine.layers.linear import WeightOnlyLinear

    k, n = 256, 48
    g = torch.Generator().manual_seed(11)
    w = quantize_rtn(torch.randn(n, k, generator=g), 4, 128, False, None)
    assert WeightOnlyLinear(w, None, torch.float16).fragments() == {}  # a shape MID_TABLE does not list
    layer = WeightOnlyLinear(w, None, torch.float16, layouts={(2, True), (4, False)}).to(DEV)
    copies = layer.fragments()
    assert sorted(copies) == [(2, True), (4, False)]
    for (kw, trans), copy in copies.items():
        assert copy.device == layer.qweight.device and torch.equal(copy, fragment_pack(layer.qweight, kw, trans))
    assert set(layer.state_dict()) == {"qweight", "scales", "zeros"}
    rest = (layer.scales, layer.zeros, 4, w.group_size)
    x = torch.randn(16, k, generator=g).half().to(DEV)
    for kw, trans in ((2, True), (4, False), (2, False)):
        config = MidTiles(16, 16, 64, 2, trans=trans, masked=True, fragment=kw)
        out = weight_only_matmul(x, layer.qweight, *rest, config=config, counters=layer.counters, fragments=copies)
        if (kw, trans) in copies:
            want = weight_only_matmul(x, copies[kw, trans], *rest, config=config, counters=layer.counters)
        else:
            plain = dataclasses.replace(config, fragment=0)
            want = weight_only_matmul(x, layer.qweight, *rest, config=plain, counters=layer.counters)
        assert torch.equal(out, want), config
    for (bits, tk, tn, _rows), tiles in MID_TABLE.items():
        if tiles.fragment:
            assert (tiles.fragment, tiles.trans) in fragment_layouts(bits, tk, tn) and bits == 4
            tiles.check(tk, 128)
            assert not tiles.trans or tn % 16 == 0


def test_table_tiles_give_fragment_tiles_without_a_copy_the_plain_table_tiles():
    """quant_gemm.table_tiles: a MID_TABLE fragment tile with its layout among the weight's copies is taken as
    listed; without it, MID_PLAIN_TABLE's tiles for the shape (plain layout, tiling it), or the plain twin where
    those cannot take the group; every MID_PLAIN_TABLE entry stands in for a fragment entry. The GEMV's tiles at
    one row, the prompt kernel's past MID_MAX_M."""
    from engine.kernels.quant_gemm import table_tiles
    from engine.kernels.quant_tiles import MID_MAX_M, MID_PLAIN_TABLE, MID_TABLE, GemvTiles, MidTiles, Tiles

    fragment_keys = {key for key, t in MID_TABLE.items() if t.fragment}
    assert fragment_keys and set(MID_PLAIN_TABLE) == fragment_keys
    for bits, k, n, bm in fragment_keys:
        listed, plain = MID_TABLE[bits, k, n, bm], MID_PLAIN_TABLE[bits, k, n, bm]
        layout = (listed.fragment, listed.trans)
        assert table_tiles(bits, bm, n, k, 128, 132, {layout}) == listed
        assert table_tiles(bits, bm, n, k, 128, 132, set()) == plain
        assert table_tiles(bits, bm - 1, n, k, 128, 132, {(4, False)} - {layout}) == plain
        assert not plain.fragment and plain.block_m == bm
        plain.check(k, 128)
    narrow = next(key for key in fragment_keys if MID_TABLE[key].block_k == 64 and MID_PLAIN_TABLE[key].block_k > 64)
    bits, k, n, bm = narrow  # groups of 64: the plain table's K step does not divide them
    assert table_tiles(bits, bm, n, k, 64, 132, set()) == dataclasses.replace(MID_TABLE[narrow], fragment=0)
    assert isinstance(table_tiles(4, 1, 4096, 4096, 128, 132, set()), GemvTiles)
    prompt = table_tiles(4, MID_MAX_M + 1, 4096, 4096, 128, 132, set())
    assert type(prompt) is Tiles and not isinstance(prompt, MidTiles)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the CPU dequantizes 4-bit weights at load: no copies)")
def test_quant_fragment_copies_knob_keeps_or_drops_the_copies_on_cuda(tmp_path):
    """EngineConfig.quant_fragment_copies, through LLM and the loader to each WeightOnlyLinear of a one-layer
    Llama-3-8B-shaped GPTQ W4 g128 model: on, every linear keeps the fragment layouts MID_TABLE names for its
    shape (some do: the 8B's shapes); off, none does, and at 16 rows (fragment tiles, with the copies) each linear
    gives what it gives with them, on MID_PLAIN_TABLE's tiles without; both engines generate."""
    import gc

    from bench.quant_checkpoints import _quantization_config
    from engine import LLM, SamplingParams
    from engine.kernels.quant_gemm import fragment_layouts
    from engine.layers.linear import WeightOnlyLinear

    cfg = json.loads((Path(__file__).resolve().parents[1] / "bench/configs/llama3-8b/config.json").read_text())
    cfg |= {
        "num_hidden_layers": 1,
        "vocab_size": 512,
        "quantization_config": _quantization_config(RECIPES["gptq-w4g128"]),
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    x = torch.randn(16, cfg["intermediate_size"], device="cuda", dtype=torch.bfloat16)
    outs = {}
    for copies in (True, False):
        llm = LLM(str(tmp_path), dtype="bfloat16", load_format="dummy", quant_fragment_copies=copies,
                  max_model_len=256, num_gpu_blocks_override=64)  # fmt: skip
        layers = {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, WeightOnlyLinear)}
        assert len(layers) == 4  # qkv, o, gate/up, down
        for name, layer in layers.items():
            want = fragment_layouts(4, layer.in_features, layer.out_features) if copies else set()
            assert set(layer.fragments()) == want, name
        if copies:
            assert any(layer.fragments() for layer in layers.values())
        with torch.no_grad():
            outs[copies] = {n: m(x[:, : m.in_features].contiguous()).float() for n, m in layers.items()}
        done = llm.generate([[5, 6, 7, 8]] * 16, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert all(len(r.outputs[0].token_ids) == 4 for r in done)
        del llm, layers, done
        gc.collect()
        torch.cuda.empty_cache()
    for name, ref in outs[True].items():
        assert (outs[False][name] - ref).norm() / ref.norm() < 1e-2, name


def test_mid_sweep_candidates_are_valid_and_breadth_first():
    """Every candidate of the H100 sweep tiles its 8B shape; the first ones are all different kernels (a sweep
    cut by its budget has tried each kind), widest first, in the same order for every shape."""
    from bench.quant_gpu import SHAPES, mid_candidates

    orders = []
    for k, n in SHAPES:
        for m, group in ((16, 128), (64, k)):
            found = mid_candidates(m, n, k, group)
            for config in found:
                config.check(k, group)
                assert config.block_m == m and k // (config.block_k * config.split) >= 2
            kernels = [(c.block_n, c.block_k, c.num_warps, c.num_stages, c.trans, c.masked) for c in found]
            first = kernels[: len(set(kernels))]
            assert len(set(first)) == len(first) and {c.trans for c in found} == {c.masked for c in found} == {0, 1}
            assert first[0][0] == 256 and first[0][4] and first[0][5]  # widest, the weight first, masked
            orders.append(first)
    assert orders[0] == orders[2]  # 16 rows, groups of 128, K 4096: qkv and o


def test_mid_sweep_dry_run_prints_table_entries(tmp_path):
    """`bench.quant_gpu --sweep mid --dry-run`: the sweep's whole path at tiny shapes (each candidate checked
    against the reference), a JSON row per shape and rows, a layer total per bits and rows, and MID_TABLE
    entries that are each shape's fastest tiles (a fragment layout's too: WeightOnlyLinear keeps a copy of the
    weight in the layouts the table names), the fastest on the packed layout beside them."""
    pytest.importorskip("triton")
    from bench.quant_gpu import sweep_mid
    from engine.kernels.quant_tiles import MidTiles

    out = tmp_path / "mid.jsonl"
    entries = sweep_mid(out, dry_run=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shapes = [r for r in rows if "best" in r]
    assert len(shapes) == len(entries) == 8 and all(r["tried"] == 2 for r in shapes)
    assert sum("layer total" in r["sweep"] for r in rows) == 4
    for entry, row in zip(entries, shapes):
        key, tiles = entry.strip().rstrip(",").split(": ", 1)
        assert eval(key) == (int(row["sweep"][-1]), row["k"], row["n"], row["m"])
        assert eval(tiles, {"MidTiles": MidTiles}) == eval(row["best"], {"MidTiles": MidTiles})
        assert eval(row["best_plain"], {"MidTiles": MidTiles}).fragment == 0


def _compile_for_sm90(code: str) -> str:
    """The standard output of `code` run in a process of its own (this one's kernels are the interpreter's:
    TRITON_INTERPRET=1), which compiles kernels for sm_90 without a GPU; skips where this Triton has no NVIDIA
    backend."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend to compile for sm_90 with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _w4_table_twins_sass(variant: str, fields: str, setup: str = "") -> list[tuple[list[str], list[str]]]:
    """MID_TABLE's W4 g128 tiles at 16 rows (the 8B's four shapes) compiled for sm_90 twice each, as
    replace(tiles, <variant>) with `twin` False and True (after the statements `setup`): per shape the two
    lines (K, N, twin, instructions per weight and thread, then the Python expressions `fields` of the kernel
    and its loop's opcodes `ops`)."""
    code = (
        "from dataclasses import replace\n"
        "from bench.quant_sass import per_weight\n"
        "from engine.kernels.quant_tiles import MID_TABLE\n" + setup + ""
        "for (bits, k, n, m), t in MID_TABLE.items():\n"
        "    if bits == 4 and m == 16:\n"
        "        for twin in (False, True):\n"
        "            cost, kernel, ops = per_weight(4, replace(t, " + variant + "), k, n, 128)\n"
        "            print(k, n, int(twin), cost, " + fields + ")\n"
    )
    lines = [line.split() for line in _compile_for_sm90(code).splitlines()]
    assert len(lines) == 8
    for old, new in zip(lines[::2], lines[1::2]):
        assert old[:2] == new[:2] and (old[2], new[2]) == ("0", "1")
    return list(zip(lines[::2], lines[1::2]))


def test_decode_dot_kernel_fragment_layout_compiles_for_sm90_without_the_shared_memory_trip():
    """MID_TABLE's W4 g128 tiles at 16 rows (the 8B's four shapes), the weight as tl.dot's second operand, compile
    for sm_90 without a GPU (Triton and the ptxas of its wheel). In the plain layout the unpacked tile reaches
    mma.sync through shared memory every step (64 to 128 2-byte STS a thread, read back by LDSM); in the
    fragment layout for the kWidth this Triton gives its operand (MidTiles.fragment: 2 with Triton 3.9, 4 with 3.6)
    the TTGIR's reshape yields the dot operand's layout itself (no local_alloc of it), so the loop has no STS
    and fewer LDSM / LDS (the activations' alone), it keeps the cp.async copies (LDGSTS) of the raw words,
    spills nothing, needs at most half the shared memory and issues fewer instructions per weight and thread:
    Triton 3.9 4.21 to 5.09 against 5.94 to 6.70, Triton 3.6 4.39 to 5.77 against 5.85 to 6.58 (with 3.6, 64
    register moves a step gather the activations' operand, read by LDS.64 for kWidth 4)."""
    setup = (
        "import re\n"
        "_, probe, _ = per_weight(4, replace(next(iter(MID_TABLE.values())), trans=False, masked=True, fragment=2))\n"
        "kwidth = int(re.search(r'opIdx = 1, parent = #mma, kWidth = (\\d)', probe.asm['ttgir'])[1])\n"
    )
    operand = "'bf16, #ttg.dot_op<{opIdx = 1'"
    direct = "int(any('tt.reshape' in x and " + operand + " in x for x in kernel.asm['ttgir'].splitlines()))"
    fields = "ops['HMMA'], ops['STL'] + ops['LDL'], kernel.metadata.shared, ops['STS'], ops['LDSM'] + ops['LDS'], "
    fields += "ops['LDGSTS'], " + direct
    variant = "trans=False, masked=True, packed=False, fragment=twin * kwidth"
    for old, new in _w4_table_twins_sass(variant, fields, setup):
        assert float(new[3]) < float(old[3]) - 0.25, (old, new)
        assert int(old[7]) >= 64 and int(new[7]) == 0, (old, new)  # the unpacked tile's shared stores
        assert int(new[8]) < int(old[8]) and int(new[9]) > 0, (old, new)
        assert int(new[4]) > 0 and int(new[5]) == 0 and 2 * int(new[6]) <= int(old[6]), new
        assert (old[10], new[10]) == ("0", "1"), (old, new)


def test_decode_dot_kernel_trans_fragment_layout_compiles_for_sm90_with_the_weight_in_wgmma_registers():
    """MID_TABLE's W4 g128 tiles at 16 rows (the 8B's four shapes), the weight as tl.dot's first operand, compile
    for sm_90 without a GPU. With the masked unpack of the plain layout the unpacked tile goes to shared memory
    (16-byte STS, 8 to 16 a step) for wgmma; in the trans fragment layout (MidTiles.fragment 2 with trans) the
    TTGIR's reshape yields wgmma's register operand layout itself, so the loop stores at most 2 (Triton 3.9 at
    BLOCK_N 256 on 4 warps), spills nothing, keeps wgmma (HGMMA), needs about half the shared memory and
    issues no more instructions per weight and thread: Triton 3.6 3.79 to 4.81 against 3.99 to 5.48, Triton
    3.9 4.08 to 5.47 against 4.30 to 6.05."""
    operand = "'bf16, #ttg.dot_op<{opIdx = 0'"
    direct = "int(any('tt.reshape' in x and " + operand + " in x for x in kernel.asm['ttgir'].splitlines()))"
    fields = "ops['HGMMA'], ops['STL'] + ops['LDL'], kernel.metadata.shared, ops['STS'], " + direct
    pairs = _w4_table_twins_sass("trans=True, masked=True, packed=False, fragment=2 * twin", fields)
    for old, new in pairs:
        assert float(new[3]) < float(old[3]) + 0.05, (old, new)
        assert int(old[7]) >= 8 and int(new[7]) <= 2, (old, new)  # the unpacked tile's shared stores
        assert int(new[4]) > 0 and int(new[5]) == 0 and 2 * int(new[6]) <= int(old[6]) + 4096, new
        assert (old[8], new[8]) == ("0", "1"), (old, new)
    assert sum(float(new[3]) for _, new in pairs) < sum(float(old[3]) for old, _ in pairs) - 0.5


@pytest.mark.slow
@pytest.mark.parametrize("bits, m", [(4, 16), (4, 64), (8, 16), (8, 64)])
def test_decode_dot_kernel_default_tiles_compile_for_sm90_in_few_instructions(bits, m):
    """The rule's tiles (Llama-3-8B's o projection, 132 SMs) compile for sm_90 without a GPU (Triton and the
    ptxas of its wheel; bench/quant_sass.py) and the main loop issues few instructions per weight per thread:
    5.9 to 10.9 with Triton 3.6, where loading a word per weight (as the prompt kernel does) took 25 to 33,
    the cost that made decode batches of 16 and 64 slower than bf16 on an H100."""
    code = (
        "from bench.quant_sass import per_weight; from engine.kernels.quant_gemm import mid_rule\n"
        f"tiles = mid_rule({m}, 4096, 4096, 128, num_sms=132)\n"
        "cost, kernel, ops = per_weight(tiles=tiles, bits=" + str(bits) + ")\n"
        "print(cost, ops['HMMA'] + ops['HGMMA'], tiles)"
    )
    cost, mma, tiles = _compile_for_sm90(code).split(" ", 2)
    assert float(cost) < (8 if m <= 32 else 13), (tiles, cost)
    assert int(mma) > 0  # the product is on the tensor cores


@pytest.mark.slow
def test_decode_dot_kernel_masked_unpack_compiles_for_sm90_in_fewer_instructions():
    """MID_TABLE's W4 g128 tiles at 16 rows (the 8B's four shapes), the weight as tl.dot's first operand, compile
    for sm_90 without a GPU (Triton and the ptxas of its wheel): the masked unpack (MidTiles.masked: an AND and
    an FMA a field) issues fewer main-loop instructions per weight and thread than shifting each field out
    (a shift, an extract, an OR, a subtraction), with no spills, on wgmma (HGMMA) and with the same shared
    memory: with Triton 3.6 / 3.9, 3.99-5.48 / 4.30-6.05 against 5.26-6.48 / 5.29-6.70 (the weight as second
    operand, with a 2-byte shared store per weight: 5.85-6.58 / 5.94-6.70 masked, MID_TABLE's choice for three
    of the four today, 7.17-7.89 / 7.02-7.16 shifted)."""
    fields = "ops['HGMMA'], ops['STL'] + ops['LDL'], kernel.metadata.shared"
    for old, new in _w4_table_twins_sass("trans=True, masked=twin, packed=False, fragment=0", fields):
        assert float(new[3]) < min(6.5, float(old[3]) - 0.4), (old, new)
        assert int(new[4]) > 0 and int(new[5]) == 0 and new[6] == old[6], new


@pytest.mark.slow
def test_decode_dot_kernel_packed_unpack_compiles_for_sm90_in_fewer_instructions():
    """MID_TABLE's W4 g128 tiles at 16 rows (the 8B's four shapes), either operand order, compile for sm_90
    without a GPU with the packed unpack (MidTiles.packed: a PRMT, a LOP3 and a packed FMA, HADD2 in SASS, per
    two fields) in at least 0.8 fewer main-loop instructions per weight and thread than the masked unpack, no
    spills, within 1 KiB of its shared memory: with Triton 3.6 / 3.9, 2.80-4.19 / 2.77-3.98 against
    3.99-5.48 / 4.30-6.05 with the weight first, 4.25-5.86 / 4.04-5.08 against 5.85-6.58 / 5.94-6.70 with it
    second."""
    fields = "ops['HADD2'] + ops['HFMA2'], ops['STL'] + ops['LDL'], kernel.metadata.shared"
    for trans in (True, False):
        for old, new in _w4_table_twins_sass(f"trans={trans}, masked=True, packed=twin, fragment=0", fields):
            assert float(new[3]) < float(old[3]) - 0.8, (old, new)
            assert int(old[4]) == 0 and int(new[4]) > 0 and int(new[5]) == 0, new
            assert int(new[6]) <= int(old[6]) + 1024, (old, new)


@pytest.mark.slow
def test_w8a8_gemm_compiles_for_sm90_with_vector_loads_and_tensor_cores():
    """The 8-bit GEMM's rule tiles at 16 and 64 rows, int8 and fp8, unfused and fused, compile for sm_90 without
    a GPU (Triton and the ptxas of its wheel) with the product on the tensor cores; the unfused main loop
    stays short (71 to 144 instructions with Triton 3.9, its loads 16-byte asynchronous copies; byte loads, as
    when the K-sized arguments are not known to be multiples of 16, take ~700), and the fused one pays for
    quantizing its step (~420 at 16 rows, ~1,200 to 1,500 at 64)."""
    code = (
        "from bench.quant_gpu import compile_w8a8; from bench.quant_sass import loop_stats\n"
        "from engine.kernels.w8a8 import w8a8_rule\n"
        "for bm in (16, 64):\n"
        "    for int8 in (False, True):\n"
        "        for fused in (False, True):\n"
        "            n, ops = loop_stats(compile_w8a8(w8a8_rule(bm, bm, 4096, 4096, 132), int8, fused))\n"
        "            print(bm, int(int8), int(fused), n, sum(c for o, c in ops.items() if 'MMA' in o))\n"
    )
    for line in _compile_for_sm90(code).splitlines():
        bm, int8, fused, count, mma = map(int, line.split())
        assert mma > 0, line
        assert count < (200 if not fused else 600 if bm == 16 else 2000), line


@pytest.mark.slow
def test_decode_gemv_compiles_for_sm90_with_vector_loads_and_a_cheap_unpack():
    """The GEMV at GEMV_TABLE's tiles (the 8B's four shapes, W4 g128 and W8 per channel, one row) compiles for
    sm_90 without a GPU (Triton and the ptxas of its wheel): the words load 8 or 16 bytes a thread (16-byte
    cp.async copies where the tiles pipeline through shared memory, num_stages > 1), the main
    loop spills nothing, extracts no field with a shift and bit-field extract (SGXT) and issues few
    instructions per weight and thread: with Triton 3.6 / 3.9, 3.8-3.9 at 4 bits, 32 or 64 outputs (5.0 / 5.2
    when each field was ORed into 2**23 and had it subtracted, 6.4 with a shift, an SGXT and an OR), 5.3-5.5
    at 64 outputs and 8 bits and 4.8-4.9 at 32 (6.3-6.9 and 6.0-6.1); an H100 streaming 4-bit weights at full
    bandwidth leaves ~4.4, 8-bit ones ~8.8, an H200 ~3.1 and ~6.2."""
    code = (
        "from bench.quant_gpu import compile_gemv; from bench.quant_sass import loop_stats\n"
        "from engine.kernels.quant_tiles import GEMV_TABLE\n"
        "for (bits, k, n), t in GEMV_TABLE.items():\n"
        "    kernel = compile_gemv(bits, t, k, n, 128 if bits == 4 else k)\n"
        "    count, ops = loop_stats(kernel)\n"
        "    per = count / (t.block_n * t.block_kw * 32 / bits / (32 * t.num_warps))\n"
        "    ptx = kernel.asm['ptx']\n"
        "    v2, v4 = (ptx.count(f'ld.global.v{w}.b32') for w in (2, 4))\n"
        "    v4 += sum('cp.async.cg.shared.global' in line and '0x10' in line for line in ptx.splitlines())\n"
        "    print(bits, t.block_n, per, ops['SGXT'], ops['STL'], v2, v4)\n"
    )
    stdout = _compile_for_sm90(code)
    lines = stdout.splitlines()
    assert len(lines) == 8
    for line in lines:
        bits, block_n, per, sgxt, stl, v2, v4 = line.split()
        assert int(sgxt) < 4 and int(stl) == 0, line  # one per field would be 16 or more
        # A thread's words come 8 or 16 bytes at a time: v4 loads (or 16-byte cp.async copies) at 64 outputs, where
        # they also carry per-row scales; v2 or v4 at 32, where a 64-word-deep tile gives a thread 16 bytes.
        assert int(v4) >= 2 if int(block_n) >= 64 else int(v2) + int(v4) >= 2, line
        bound = {("4", "64"): 4.3, ("4", "32"): 4.3, ("8", "64"): 5.9, ("8", "32"): 5.4}[bits, block_n]
        assert float(per) < bound, line


@pytest.mark.slow
def test_decode_gemv_prefetching_into_l2_compiles_for_sm90_into_its_main_loop():
    """GemvTiles.l2_ahead at GEMV_TABLE's W4 tiles (the 8B's four shapes, one row), compiled for sm_90 without a
    GPU: per-thread L2 prefetches (CCTL.E.PF2, no uniform-register loop as a bulk prefetch would take) in the
    main loop, none without it; no spills, no fewer programs resident per SM than without it (registers in
    steps of 8 a thread, 64K a multiprocessor), and at most 15% more instructions in the loop (8-13% with
    Triton 3.9)."""
    code = (
        "import dataclasses\n"
        "from bench.quant_gpu import compile_gemv; from bench.quant_sass import loop_stats, _cubin_tool\n"
        "from engine.kernels.quant_tiles import GEMV_TABLE\n"
        "import re\n"
        "for (bits, k, n), t in GEMV_TABLE.items():\n"
        "    if bits != 4: continue\n"
        "    for l2 in (0, 4):\n"
        "        kernel = compile_gemv(bits, dataclasses.replace(t, l2_ahead=l2), k, n, 128)\n"
        "        count, ops = loop_stats(kernel)\n"
        "        regs = re.search(r'REG:(\\d+)', _cubin_tool(kernel, 'cuobjdump', '-res-usage'))[1]\n"
        "        print(k, n, l2, count, ops['CCTL'], ops['STL'] + ops['LDL'], regs, ops['UBLKPF'], t.num_warps)\n"
    )
    lines = _compile_for_sm90(code).splitlines()
    assert len(lines) == 8, lines
    rows = {tuple(line.split()[:3]): list(map(int, line.split()[3:])) for line in lines}

    def resident(regs: int, warps: int) -> int:
        return 65536 // (32 * warps * -(-regs // 8) * 8)

    for (k, n, l2), (count, cctl, spills, regs, bulk, warps) in rows.items():
        plain_count, _, _, plain_regs, _, _ = rows[k, n, "0"]
        assert spills == 0 and bulk == 0, (k, n, l2)
        if l2 == "0":
            assert cctl == 0, (k, n)
        else:
            assert cctl >= 1 and resident(regs, warps) >= resident(plain_regs, warps), (k, n, regs, plain_regs)
            assert count <= 1.15 * plain_count, (k, n, count, plain_count)


@pytest.mark.slow
def test_wide_64_row_fp8_candidates_compile_for_sm90_without_spills():
    """Every kernel of bench.quant_gpu.w8a8_wide_candidates at the 8B's shapes (BLOCK_N 128 / 256 on 4 or 8
    warps, BLOCK_N 32 / 64 with 6 or 8 stages) compiles for sm_90 with fp8 wgmma (QGMMA) and no local-memory
    spills (BLOCK_N 256 on 4 warps, 128 accumulators a thread and the promotion's second set, would spill)."""
    code = (
        "import os, subprocess, tempfile, triton\n"
        "from bench.quant_gpu import SHAPES, compile_w8a8, w8a8_wide_candidates\n"
        "nv = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'nvdisasm')\n"
        "kernels = {(t.block_n, t.num_warps, t.num_stages): t for k, n in SHAPES\n"
        "           for t in w8a8_wide_candidates(64, n, k, 132)}\n"
        "for key, t in sorted(kernels.items()):\n"
        "    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:\n"
        "        f.write(compile_w8a8(t, False, False).asm['cubin']); f.flush()\n"
        "        sass = subprocess.run([nv, '-c', f.name], capture_output=True, text=True, check=True).stdout\n"
        "    print(*key, sass.count('QGMMA'), sass.count('LDL') + sass.count('STL'))\n"
    )
    lines = _compile_for_sm90(code).splitlines()
    assert len(lines) >= 9, lines
    for line in lines:
        bn, warps, stages, qgmma, spills = map(int, line.split())
        assert qgmma > 0 and spills == 0, line


@pytest.mark.parametrize("bits, group, k", [(4, 32, 256), (4, 128, 192), (8, 32, 128), (8, -1, 256)])
def test_decode_gemv_split_tiles_match_the_dequantized_reference(bits, group, k):
    """The GEMV (no tl.dot) at 1 and 3 rows with K split four and two ways: the slice's last program adds the
    partials and leaves the counters zeroed for the next launch; scales applied per step (a step in one group),
    per word row (steps of several groups) and once per program (a program's span in one group: 4-128-192,
    8--1-256), prefetching 0, 1 and 2 steps ahead or pipelined in 3 stages, prefetching into L2 (on CUDA, where
    N and K are whole slices and steps; elsewhere the same kernel without it), and unmasked where N and K are
    whole slices and steps, each of which leaves every sum as it was (the default tiles are in
    test_weight_only_kernel_matches_the_dequantized_reference)."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import weight_only_matmul
    from engine.kernels.quant_tiles import GemvTiles

    n = 24  # a ragged last slice of outputs
    g = torch.Generator().manual_seed(bits * k + group)
    w = quantize_rtn(torch.randn(n, k, generator=g), bits, group, symmetric=bits == 8)
    args = (pack_int32(w.q, bits, dim=0).to(DEV), w.scales.half().to(DEV), w.zeros.half().to(DEV), bits, w.group_size)
    counters = torch.zeros(-(-n // 16), dtype=torch.int32, device=DEV)
    for m in (1, 3):
        x = torch.randn(m, k, generator=g).half()
        ref = x.float() @ w.dequantize().half().float()
        for config in (GemvTiles(32, 4, 4), GemvTiles(16, 8, 2, num_warps=2)):
            out = weight_only_matmul(x.to(DEV), *args, config=config, counters=counters)
            assert out.dtype == torch.float16 and out.shape == (m, n)
            torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2)
            assert not counters.any()
            for ahead, stages, l2 in ((0, 1, 0), (1, 1, 0), (0, 3, 0), (1, 1, 2)):
                other = dataclasses.replace(config, prefetch=ahead, num_stages=stages, l2_ahead=l2)
                assert torch.equal(weight_only_matmul(x.to(DEV), *args, config=other, counters=counters), out)
            if config.block_n == 16:  # whole slices and steps: the unmasked kernel (a prefetch past a span
                # re-reads its last step), the same sums, also prefetching into L2 (past the span: nothing)
                whole = (*(t[:, :16].contiguous() for t in args[:3]), *args[3:])
                for l2 in (0, 1, 4):
                    other = dataclasses.replace(config, l2_ahead=l2)
                    got = weight_only_matmul(x.to(DEV), *whole, config=other, counters=counters)
                    assert torch.equal(got, out[:, :16]), other


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_gemv_wide_one_and_two_warp_slices_match_the_reference(bits):
    """The sweep's wide GEMV tiles (bench.quant_gpu.gemv_candidates: 256-1024 outputs on one or two warps, a word
    row or a few a step, K split many ways): one and two rows, a ragged last slice and a split that leaves the
    last span short, against the dequantized product, counters left zeroed."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import weight_only_matmul
    from engine.kernels.quant_tiles import GemvTiles

    k, n = 256, 1100
    g = torch.Generator().manual_seed(bits)
    w = quantize_rtn(torch.randn(n, k, generator=g), bits, 128 if bits == 4 else -1)
    args = (pack_int32(w.q, bits, dim=0).to(DEV), w.scales.half().to(DEV), w.zeros.half().to(DEV), bits, w.group_size)
    counters = torch.zeros(-(-n // 16), dtype=torch.int32, device=DEV)
    for m in (1, 2):
        x = torch.randn(m, k, generator=g).half()
        ref = x.float() @ w.dequantize().half().float()
        for config in (GemvTiles(512, 2, 5, 1, prefetch=1), GemvTiles(1024, 1, 16, 2, prefetch=0),
                       GemvTiles(256, 4, 3, 1, prefetch=1)):  # fmt: skip
            out = weight_only_matmul(x.to(DEV), *args, config=config, counters=counters)
            torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2, msg=str(config))
            assert not counters.any()


@pytest.mark.parametrize("bits, m", [(4, 2), (8, 1), (8, 9)])  # the GEMV (4 and 8 bits), the decode tl.dot kernel
def test_decode_kernels_are_exact_in_float32(bits, m):
    """float32 in, float32 out: the GEMV's per-group factoring s * (sum q x - z sum x), and the tl.dot kernel's
    exact q - z with the scale applied to the step's product, stay within float32 rounding of the dequantized
    product; the tl.dot kernel with either unpack and either operand order."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import weight_only_matmul
    from engine.kernels.quant_tiles import MidTiles

    k, n = 256, 48
    g = torch.Generator().manual_seed(11)
    w = quantize_rtn(torch.randn(n, k, generator=g), bits, 64, symmetric=False)
    x = torch.randn(m, k, generator=g)
    args = (pack_int32(w.q, bits, 0).to(DEV), w.scales.float().to(DEV), w.zeros.float().to(DEV), bits, 64)
    both = (False, True)
    configs = [None] if m <= 2 else [None, *(MidTiles(16, 16, 64, 2, trans=t, masked=mk) for t in both for mk in both)]
    for config in configs:
        out = weight_only_matmul(x.to(DEV), *args, config=config)
        torch.testing.assert_close(out.cpu(), x @ w.dequantize(), atol=1e-4, rtol=1e-5, msg=str(config))


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_gemv_is_exact_for_activations_far_from_one(bits):
    """The GEMV reads each field as a subnormal float and scales x by up to 2**75 to match it (its sums kept times
    2**-GEMV_SHIFT): rows of activations around 2**-40, 1 and 2**40 still sum within float32 rounding of the
    float64 product (an x scaled past float32's range would give inf, products below it would lose their
    digits)."""
    pytest.importorskip("triton")
    from engine.kernels.quant_gemm import weight_only_matmul

    k, n = 256, 32
    g = torch.Generator().manual_seed(3)
    w = quantize_rtn(torch.randn(n, k, generator=g), bits, 64, symmetric=False)
    args = (pack_int32(w.q, bits, 0).to(DEV), w.scales.float().to(DEV), w.zeros.float().to(DEV), bits, 64)
    dense = w.dequantize().double()
    for e in (-40, 0, 40):
        x = torch.randn(1, k, generator=g) * 2.0 ** (e + torch.randint(-4, 5, (1, k), generator=g).float())
        out = weight_only_matmul(x.to(DEV), *args).cpu().double()
        ref, size = x.double() @ dense, x.double().abs() @ dense.abs()
        assert torch.all((out - ref).abs() <= 1e-5 * size), (e, ((out - ref).abs() / size).max())


def test_weight_only_linear_sorts_act_order_rows_and_gathers_inputs():
    """An act-order GPTQ layer (shards sharing one g_idx, bias) through the kernel equals its dequantized product."""
    pytest.importorskip("triton")
    from engine.layers.linear import WeightOnlyLinear
    from engine.quant import concat_outputs

    k = 128
    g = torch.Generator().manual_seed(5)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=g)] = torch.arange(k, dtype=torch.int32) // 32
    shards = [quantize_rtn(torch.randn(n, k, generator=g), 4, 32, False, g_idx) for n in (64, 32, 32)]
    fused = concat_outputs(shards)
    bias = torch.randn(128, generator=g)
    layer = WeightOnlyLinear(fused, bias, torch.float32).to(DEV)
    assert layer.perm is not None
    for shape in ((2, 5, k), (1, k)):  # the tl.dot kernel, and the decode GEMV
        x = torch.randn(*shape, generator=g)
        ref = x @ torch.cat([s.dequantize() for s in shards], 1) + bias
        torch.testing.assert_close(layer(x.to(DEV)).cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Llama-3-8B-sized bf16 shapes)")
@pytest.mark.parametrize("m", [1, 4, 16, 64, 512])
def test_weight_only_kernel_full_shapes_bf16_on_cuda(m):
    from engine.kernels.quant_gemm import weight_only_matmul

    k, n = 4096, 14336
    w = quantize_rtn(torch.randn(n, k, device="cuda"), 4, 128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x @ w.dequantize().to(torch.bfloat16)
    out = weight_only_matmul(x, pack_int32(w.q, 4, 0), w.scales.bfloat16(), w.zeros.bfloat16(), 4, 128)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch._scaled_mm / torch._int_mm)")
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_scaled_linear_cuda_matches_its_reference(qdtype, m):
    w = torch.randn(1024, 2048, device="cuda")
    q, scale = quantize_per_row(w, qdtype)
    layer = ScaledLinear(q, scale.flatten(), None, torch.bfloat16)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), layer._reference(x).float(), atol=0.05, rtol=0.02)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the GEMV at Llama-3-8B depth)")
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
def test_decode_gemv_full_shapes_bf16_on_cuda(bits, group):
    """GEMV tiles of the sweep's grid at the 8B's deepest layer (down: K 14336, N 4096), one counter array
    shared by all launches as a layer shares it between decode steps."""
    from bench.quant_gpu import gemv_candidates
    from engine.kernels.quant_gemm import weight_only_matmul

    k, n = 14336, 4096
    w = quantize_rtn(torch.randn(n, k, device="cuda"), bits, group)
    args = (pack_int32(w.q, bits, 0), w.scales.bfloat16(), w.zeros.bfloat16(), bits, w.group_size)
    counters = torch.zeros(n // 16, dtype=torch.int32, device="cuda")
    for m in (1, 3):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = (x @ w.dequantize().to(torch.bfloat16)).float()
        for config in [None, *gemv_candidates(bits, n, k)[::17]]:  # the sweep checks all it times; 17: every way
            out = weight_only_matmul(x, *args, config=config, counters=counters).float()
            assert (out - ref).norm() / ref.norm() < 1e-2, config
            assert not counters.any(), config


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the GEMV's L2 prefetch is PTX)")
def test_decode_gemv_prefetching_into_l2_changes_no_bit_on_cuda():
    """GEMV_TABLE's tiles at the 8B's shapes (W4 g128, W8 per channel), one and two rows: prefetching 2, 4 or 8
    steps ahead into L2 gives the same output bit for bit, the counters left zeroed."""
    from engine.kernels.quant_gemm import weight_only_matmul
    from engine.kernels.quant_tiles import GEMV_MAX_M, GEMV_TABLE

    for (bits, k, n), tiles in GEMV_TABLE.items():
        w = quantize_rtn(torch.randn(n, k, device="cuda"), bits, 128 if bits == 4 else -1)
        args = (pack_int32(w.q, bits, 0), w.scales.bfloat16(), w.zeros.bfloat16(), bits, w.group_size)
        counters = torch.zeros(n // 16, dtype=torch.int32, device="cuda")
        for m in range(1, GEMV_MAX_M[bits] + 1):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = weight_only_matmul(x, *args, config=tiles, counters=counters)
            for l2 in (2, 4, 8):
                other = dataclasses.replace(tiles, num_stages=1, l2_ahead=l2)
                assert torch.equal(weight_only_matmul(x, *args, config=other, counters=counters), out), (k, n, other)
                assert not counters.any()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the decode tl.dot kernel at Llama-3-8B shapes)")
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
def test_decode_dot_kernel_full_shapes_bf16_on_cuda(bits, group):
    """The decode tl.dot kernel at the 8B's four matmul shapes and 3 / 16 / 20 / 33 / 64 rows: the default tiles
    (20 rows: the rule's) and three candidates spread over the sweep's grid (the sweep checks every candidate it
    times; a denser sample here compiles hundreds of kernels, past one device call), one counter array shared by
    all launches as a layer shares it; each candidate's twin with the other unpack (MidTiles.masked) gives the
    same output bit for bit, its twin with the packed unpack flipped (MidTiles.packed) and for 4 bits three of
    the fragment layout's candidates (MidTiles.fragment; also either packed) the plain layout's output to within
    one bfloat16 step in a rare output."""
    from bench.quant_gpu import SHAPES, mid_candidates
    from engine.kernels.quant_gemm import fragment_pack, weight_only_matmul

    for k, n in SHAPES:
        w = quantize_rtn(torch.randn(n, k, device="cuda"), bits, group)
        args = (pack_int32(w.q, bits, 0), w.scales.bfloat16(), w.zeros.bfloat16(), bits, w.group_size)
        wd = w.dequantize().to(torch.bfloat16)
        counters = torch.zeros(n // 16, dtype=torch.int32, device="cuda")
        for m in (3, 16, 20, 33, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = (x @ wd).float()
            for config in [None, *_spread(mid_candidates(m, n, k, w.group_size), 3)]:
                out = weight_only_matmul(x, *args, config=config, counters=counters).float()
                assert (out - ref).norm() / ref.norm() < 1e-2, (k, n, m, config)
                assert not counters.any(), config
                if config is not None:
                    twin = dataclasses.replace(config, masked=not config.masked)
                    assert torch.equal(weight_only_matmul(x, *args, config=twin, counters=counters).float(), out)
                    twin = dataclasses.replace(config, packed=not config.packed)
                    _within_a_bfloat16_step(weight_only_matmul(x, *args, config=twin, counters=counters).float(), out)
            if bits == 4:  # the fragment layout's tiles: the plain layout's masked output bit for bit
                layouts = ((2, False), (4, False), (2, True))
                frag_args = {key: (fragment_pack(args[0], *key), *args[1:]) for key in layouts}
                fragments = [c for c in mid_candidates(m, n, k, w.group_size, fragment=True) if c.fragment]
                for config in _spread(fragments, 3):
                    weight = frag_args[config.fragment, config.trans]
                    out = weight_only_matmul(x, *weight, config=config, counters=counters).float()
                    twin = dataclasses.replace(config, packed=not config.packed)
                    _within_a_bfloat16_step(weight_only_matmul(x, *weight, config=twin, counters=counters).float(), out)
                    plain = dataclasses.replace(config, fragment=0)
                    _within_a_bfloat16_step(out, weight_only_matmul(x, *args, config=plain, counters=counters).float())
                    assert not counters.any(), config


def _spread(configs: list, count: int) -> list:
    """count of configs, evenly spaced over the list (the sweep's grid orders them by kind, then tiles)."""
    return configs[:: max(1, len(configs) // count)][:count]


def _within_a_bfloat16_step(out: torch.Tensor, want: torch.Tensor) -> None:
    """The same products, summed by another MMA form (the weight a register operand, or another operand
    layout): on the H100 a rare output (1 in 12,288-65,536 at 3-64 rows) rounds to the neighbouring bfloat16.
    The float32 sums differ by far less than a bfloat16 step of the outputs' scale, which bounds the difference
    of any output, one near zero too."""
    step = torch.finfo(torch.bfloat16).eps * want.abs().max()
    assert (out - want).abs().max() <= step
    assert (out != want).float().mean() < 1e-3


# ----- W8A8 kernels (engine/kernels/w8a8.py) -----


def _fp8_exact_rows(g: torch.Generator) -> torch.Tensor:
    """Rows of E4M3 values whose absolute maximum is 448 (a per-row scale of exactly 1): Triton's interpreter
    rounds float32 to fp8 half-up without carrying into the exponent, so off the GPU only values that need no
    rounding compare bit for bit (the CUDA test rounds random ones)."""
    x = (torch.randn(4, 300, generator=g) * 60).to(FP8).float()
    x[:, 5] = 448.0
    x[2, 5] = -448.0
    return x


@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_int8_is_the_reference_bit_for_bit(static):
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import RowTiles
    from engine.kernels.w8a8 import quantize_rows

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 300, generator=g) * 3
    x[1] = 0  # an all-zero row: the scale's floor
    x[2, 7] = 1000.0  # an outlier: everything else rounds to a few steps
    x[3, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, -127.5]) * x[3].abs().max() / 127.5
    layer = ScaledLinear(torch.zeros(8, 300, dtype=torch.int8), torch.ones(8), None, torch.float32,
                         input_scale=torch.tensor(0.03) if static else None)  # fmt: skip
    ref_q, ref_s = layer._quantize_input(x)
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16:
            ref_q, ref_s = layer._quantize_input(x.bfloat16())
        static_scale = None if layer.input_scale is None else layer.input_scale.to(DEV)
        q, s = quantize_rows(x.to(dtype).to(DEV), torch.int8, static_scale, config=RowTiles(128))  # 3 steps
        assert torch.equal(q.cpu(), ref_q) and torch.equal(s.cpu(), ref_s)


@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_fp8_scales_and_values(static):
    pytest.importorskip("triton")
    from engine.kernels.w8a8 import quantize_rows

    x = _fp8_exact_rows(torch.Generator().manual_seed(3))
    scale = torch.tensor([[0.5]]) if static else None  # a power of two: x / scale needs no rounding
    q, s = quantize_rows(x.to(DEV), FP8, None if scale is None else scale.to(DEV))
    ref_q, ref_s = quantize_per_row(x, FP8) if scale is None else ((x / 0.5).clamp(-448, 448).to(FP8), None)
    assert torch.equal(q.cpu().float(), ref_q.float())
    assert torch.equal(s.cpu(), ref_s if scale is None else scale.expand(4, 1))


@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize("static", [False, True])
def test_a_nan_in_a_row_makes_its_scale_and_output_nan(qdtype, static):
    """A NaN activation must reach the logits (where the engine fails that request alone), not be clamped to
    -qmax into a finite row: its row's scale is NaN, the other rows are untouched."""
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import Tiles
    from engine.kernels.w8a8 import quantize_rows, scaled_matmul

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 200, generator=g)
    x[1, 17] = float("nan")
    static_scale = torch.tensor([[0.05]], device=DEV) if static else None
    q, s = quantize_rows(x.to(DEV), qdtype, static_scale)
    clean_q, clean_s = quantize_rows(x[[0, 2]].to(DEV), qdtype, static_scale)
    assert torch.isnan(s[1]).all() and torch.isfinite(s[[0, 2]]).all()
    assert torch.equal(s[[0, 2]], clean_s) and torch.equal(q[[0, 2]].view(torch.int8), clean_q.view(torch.int8))
    wq, ws = quantize_per_row(torch.randn(40, 200, generator=g), qdtype)
    out = scaled_matmul(q, s, wq.to(DEV), ws.flatten().to(DEV), torch.float32, config=Tiles(16, 16, 64, 1))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("m", [1, 5, 20])
def test_int8_scaled_matmul_is_the_reference_bit_for_bit(m):
    """int32 accumulation is exact, and the scales apply in the reference's order."""
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import Tiles
    from engine.kernels.w8a8 import quantize_rows, scaled_matmul

    g = torch.Generator().manual_seed(m)
    wq, ws = quantize_per_row(torch.randn(40, 200, generator=g), torch.int8)  # K not a multiple of the step
    layer = ScaledLinear(wq, ws.flatten(), None, torch.float32)
    x = torch.randn(m, 200, generator=g)
    xq, xs = quantize_rows(x.to(DEV), torch.int8)
    out = scaled_matmul(xq, xs, layer.weight.to(DEV), layer.weight_scale.to(DEV), torch.float32,
                      config=Tiles(16, 16, 64, 1))  # fmt: skip
    assert torch.equal(out.cpu(), layer._reference(x))


def test_fp8_scaled_matmul_matches_the_reference():
    """E4M3 products summed in float32 (in another order than the reference's), scales in the epilogue."""
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import Tiles
    from engine.kernels.w8a8 import scaled_matmul

    g = torch.Generator().manual_seed(4)
    wq, ws = quantize_per_row(torch.randn(40, 200, generator=g), FP8)
    layer = ScaledLinear(wq, ws.flatten(), None, torch.float32)
    x = torch.randn(3, 200, generator=g)
    xq, xs = layer._quantize_input(x)
    out = scaled_matmul(xq.to(DEV), xs.contiguous().to(DEV), layer.weight.to(DEV), layer.weight_scale.to(DEV),
                        torch.float32, config=Tiles(16, 16, 64, 1))  # fmt: skip
    torch.testing.assert_close(out.cpu(), layer._reference(x), atol=1e-5, rtol=1e-5)


def _w8a8_weight(n: int, k: int, qdtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    wq, ws = quantize_per_row(torch.randn(n, k, generator=g), qdtype)
    return wq.to(DEV), ws.reshape(1, -1).contiguous().to(DEV)


def _block_exact_rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """E4M3 values with +-448 every 16 inputs: every block of 16 or more quantizes at scale 1 with nothing to
    round (see _fp8_exact_rows: off the GPU only such values compare closely)."""
    x = (torch.randn(m, k, generator=g) * 60).to(FP8).float()
    x[:, ::16] = 448.0
    x[::2, 8::16] = -448.0
    return x


@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
def test_split_k_scaled_matmul_matches_the_reference(qdtype, m):
    """K split 1 to 5 ways (K 200: a short last step; K 256: whole steps, the unmasked loads), N 40 (a partial
    last slice): int8 bit for bit (int32 partials, the scales applied once after the sum), fp8 within float32
    rounding; the counters left zeroed by every launch, one array shared as a layer shares it."""
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import W8A8Tiles
    from engine.kernels.w8a8 import quantize_rows, scaled_matmul

    g = torch.Generator().manual_seed(m)
    bm = max(16, 1 << (m - 1).bit_length())
    counters = torch.zeros(3, dtype=torch.int32, device=DEV)
    for k in (200, 256):
        wq, ws = _w8a8_weight(40, k, qdtype, g)
        layer = ScaledLinear(wq.cpu(), ws.flatten().cpu(), None, torch.float32)
        x = torch.randn(m, k, generator=g)
        xq, xs = quantize_rows(x.to(DEV), qdtype) if qdtype == torch.int8 else layer._quantize_input(x)
        for split in (1, 2, 5):
            config = W8A8Tiles(bm, 16, 32, split)
            out = scaled_matmul(xq.to(DEV), xs.contiguous().to(DEV), wq, ws, torch.float32, config, counters).cpu()
            if qdtype == torch.int8:
                assert torch.equal(out, layer._reference(x)), (k, split)
            else:
                _assert_fp8_product_close(out, layer._reference(x))
            assert not counters.any()


@pytest.mark.parametrize("m", [33, 64])
def test_wide_64_row_candidates_match_the_reference(m):
    """The 64-row tiles the fp8 sweep tries first (bench.quant_gpu.w8a8_wide_candidates: BLOCK_N 128 / 256 with
    K split 2 and 4 ways, BLOCK_N 32 / 64 unsplit and split in two) at K 1024, N 256 (4 SMs, so the splits the
    8B's shapes take on 132 arise here), fp8 within float32 rounding of the per-row product, counters zeroed."""
    pytest.importorskip("triton")
    from bench.quant_gpu import w8a8_wide_candidates
    from engine.kernels.w8a8 import scaled_matmul

    g = torch.Generator().manual_seed(m)
    k, n = 1024, 256
    wq, ws = _w8a8_weight(n, k, FP8, g)
    layer = ScaledLinear(wq.cpu(), ws.flatten().cpu(), None, torch.float32)
    x = torch.randn(m, k, generator=g)
    xq, xs = layer._quantize_input(x)
    ref = layer._reference(x)
    counters = torch.zeros(n // 16, dtype=torch.int32, device=DEV)
    # Warps and stages do not change what the interpreter computes: one run per BLOCK_N and split.
    configs = {(c.block_n, c.split): c for c in w8a8_wide_candidates(64, n, k, num_sms=4)}
    assert set(configs) == {(128, 2), (128, 4), (256, 2), (256, 4), (32, 1), (32, 2), (64, 1), (64, 2)}
    for config in configs.values():
        out = scaled_matmul(xq.to(DEV), xs.contiguous().to(DEV), wq, ws, torch.float32, config, counters).cpu()
        _assert_fp8_product_close(out, ref)
        assert not counters.any(), config


def _assert_fp8_product_close(out: torch.Tensor, ref: torch.Tensor, atol: float = 1e-5) -> None:
    """An fp8 GEMM against its float32 reference: float32 rounding under the interpreter; on CUDA the MMA adds
    each instruction's products at reduced precision (the kernel promotes to float32 every 128 inputs), so
    within 5e-4 of the largest output there (1.5e-4 at most on an H200)."""
    if CUDA:
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < 5e-4, err
    else:
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
def test_fused_scaled_matmul_matches_its_block_reference(qdtype, m):
    """The activations quantized inside the GEMM per row and BLOCK_K step: block_scaled_matmul at the same
    BLOCK_K, unsplit and split (K 200: a short last block; 256: whole ones); int8 unsplit bit for bit."""
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import W8A8Tiles
    from engine.kernels.w8a8 import fused_scaled_matmul
    from engine.layers.linear import block_scaled_matmul

    g = torch.Generator().manual_seed(10 + m)
    bm = max(16, 1 << (m - 1).bit_length())
    counters = torch.zeros(3, dtype=torch.int32, device=DEV)
    for k in (200, 256):
        wq, ws = _w8a8_weight(40, k, qdtype, g)
        x = torch.randn(m, k, generator=g) * 3 if qdtype == torch.int8 else _block_exact_rows(m, k, g)
        for block_k, split in ((32, 1), (64, 1), (32, 3)):
            ref = block_scaled_matmul(x, wq.cpu(), ws.cpu(), block_k, torch.float32)
            config = W8A8Tiles(bm, 16, block_k, split, fused=True)
            out = fused_scaled_matmul(x.to(DEV), wq, ws, torch.float32, config, counters).cpu()
            if qdtype == torch.int8 and split == 1 and not CUDA:
                assert torch.equal(out, ref), (k, block_k)
            elif qdtype == torch.int8:  # exact int32 steps; CUDA contracts the scaling into FMAs
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
            else:
                _assert_fp8_product_close(out, ref, atol=1e-4)
            assert not counters.any()


def test_block_scales_are_at_least_as_fine_as_per_row():
    """An outlier in one block coarsens only that block's step: the fused kernel's int8 product is closer to
    the float product than per-row quantization's, by half where rows have an outlier, and no farther (summed
    over rows: rounding noise) where they have none."""
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import W8A8Tiles
    from engine.kernels.w8a8 import fused_scaled_matmul

    g = torch.Generator().manual_seed(7)
    wq, ws = _w8a8_weight(48, 256, torch.int8, g)
    layer = ScaledLinear(wq.cpu(), ws.flatten().cpu(), None, torch.float32)
    x = torch.randn(32, 256, generator=g)
    x[::2, 3] = 200.0  # outliers in the first block of every other row
    exact = x @ (wq.cpu().float() * ws.cpu().t()).t()
    fused = fused_scaled_matmul(x.to(DEV), wq, ws, torch.float32, W8A8Tiles(32, 16, 64, 1, fused=True)).cpu()
    per_row = layer._reference(x)
    fused_err, row_err = (fused - exact).norm(dim=1), (per_row - exact).norm(dim=1)
    assert (fused_err[::2] < row_err[::2] / 1.5).all()
    assert fused_err[1::2].sum() <= row_err[1::2].sum()


@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
def test_a_nan_makes_its_row_nan_in_the_fused_gemm(qdtype):
    pytest.importorskip("triton")
    from engine.kernels.quant_tiles import W8A8Tiles
    from engine.kernels.w8a8 import fused_scaled_matmul

    g = torch.Generator().manual_seed(8)
    wq, ws = _w8a8_weight(40, 200, qdtype, g)
    x = torch.randn(3, 200, generator=g)
    x[1, 150] = float("nan")  # in the last, short block
    for split in (1, 2):
        out = fused_scaled_matmul(x.to(DEV), wq, ws, torch.float32, W8A8Tiles(16, 16, 32, split, fused=True))
        assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


def test_w8a8_rule_splits_k_for_decode_batches():
    """1.5 to 3.5 programs per SM stream the 8B's weights at decode sizes (K split where N gives too few), each
    keeping four steps; more rows than one program covers are not split."""
    from engine.kernels.w8a8 import w8a8_rule, w8a8_tiles

    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        for m in (1, 16, 33, 64):
            t = w8a8_rule(max(16, 1 << (m - 1).bit_length()), m, n, k, num_sms=132)
            assert t.block_m >= m and not t.fused and k // (t.block_k * t.split) >= 4
            assert 1.5 * 132 <= -(-n // t.block_n) * t.split <= 3.5 * 132
            assert w8a8_tiles("fp8", m, n, k, num_sms=132).block_m >= m  # the H200 table's entries cover the rows
    assert w8a8_rule(64, 64, 4096, 4096, 132).split == 4  # 64 slices of 64 outputs
    assert w8a8_rule(64, 200, 4096, 4096, 132).split == 1


def test_scaled_linear_takes_the_fused_gemm_its_tiles_name(monkeypatch):
    """A W8A8_TABLE entry with fused=True makes the layer quantize inside the GEMM (block_scaled_matmul's
    numerics, int8: bit for bit), except with a checkpoint's static input scale (quantize_rows, per row);
    an entry for 64 rows serves 33."""
    pytest.importorskip("triton")
    from engine.kernels import quant_tiles
    from engine.kernels.quant_tiles import W8A8Tiles
    from engine.layers.linear import block_scaled_matmul

    g = torch.Generator().manual_seed(9)
    wq, ws = _w8a8_weight(40, 256, torch.int8, g)
    monkeypatch.setitem(quant_tiles.W8A8_TABLE, ("int8", 256, 40, 64), W8A8Tiles(64, 16, 64, 2, fused=True))
    x = torch.randn(33, 256, generator=g) * 2
    dynamic = ScaledLinear(wq, ws.flatten(), None, torch.float32)
    ref = block_scaled_matmul(x, wq.cpu(), ws.cpu(), 64, torch.float32)
    torch.testing.assert_close(dynamic._triton(x.to(DEV)).cpu(), ref, atol=1e-4, rtol=1e-5)
    assert not torch.equal(ref, dynamic.cpu()._reference(x))  # per block is not per row
    static = ScaledLinear(wq, ws.flatten(), None, torch.float32, input_scale=torch.tensor(0.05, device=DEV))
    assert torch.equal(static._triton(x.to(DEV)).cpu(), static.cpu()._reference(x))


def test_sweeps_time_each_launch_on_a_weight_copy_out_of_l2():
    """The sweeps' CUDA-graph timing cycles through weight copies of at least COLD_BYTES (five 50 MB L2s), so the
    8B's qkv fp8 weight (25 MB) and its W4 g128 one (12.6 MB of words, 0.8 MB of scales and zeros, all three
    copied) are read from memory as in a decode step (meta tensors: no memory used)."""
    from bench.quant_gpu import COLD_BYTES, _copies, _cycling

    wq = torch.empty(6144, 4096, dtype=FP8, device="meta")
    copies = _copies(wq)
    assert copies[0][0] is wq and len(copies) == 11 and len(copies) * wq.numel() >= COLD_BYTES
    seen = []
    call = _cycling(lambda w: seen.append(w), copies)
    for _ in range(2 * len(copies)):
        call()
    assert [id(w) for w in seen] == [id(w) for (w,) in copies] * 2
    assert len(_copies(torch.empty(28672, 4096, dtype=FP8, device="meta"))) == 3
    assert len(_copies(torch.empty(4, 4, dtype=FP8))) == 1  # a dry run on the CPU

    weight = (
        torch.empty(512, 6144, dtype=torch.int32, device="meta"),
        torch.empty(32, 6144, dtype=torch.bfloat16, device="meta"),
        torch.empty(32, 6144, dtype=torch.bfloat16, device="meta"),
    )
    copies = _copies(*weight)
    assert copies[0] == weight and len(copies) == 21
    assert len(copies) * sum(t.numel() * t.element_size() for t in weight) >= COLD_BYTES
    seen = []
    call = _cycling(lambda *w: seen.append(w), copies)
    for _ in range(len(copies)):
        call()
    assert [[id(t) for t in w] for w in seen] == [[id(t) for t in c] for c in copies]
    assert len({id(c[1]) for c in copies}) == 21  # scales copied too, not shared


def test_w8a8_sweep_dry_run_prints_table_entries(tmp_path):
    """`bench.quant_gpu --sweep w8a8 --dry-run`: the sweep's whole path at tiny shapes (each candidate, fused
    and unfused, checked against its reference), a JSON row per shape and rows (1 and 16 rows share the
    16-row tiles), a layer total per kind and rows, and W8A8_TABLE entries that are tiles of the kernel."""
    pytest.importorskip("triton")
    from bench.quant_gpu import sweep_w8a8
    from engine.kernels.quant_tiles import W8A8Tiles

    out = tmp_path / "w8a8.jsonl"
    entries = sweep_w8a8(out, dry_run=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shapes = [r for r in rows if "best" in r]
    assert len(entries) == 8 and len(shapes) == 12 and all(r["tried"] == 3 for r in shapes)
    assert {r["m"] for r in shapes} == {1, 16, 64} and sum("layer total" in r["sweep"] for r in rows) == 6
    assert all("fused=True" in r["best_fused"] and "fused=False" in r["best_unfused"] for r in shapes)
    for entry in entries:
        key, tiles = entry.strip().rstrip(",").split(": ", 1)
        kind, k, n, bm = eval(key)
        match = [r for r in shapes if (r["sweep"], r["k"], r["n"], r["m"] > 16) == (f"w8a8-{kind}", k, n, bm > 16)]
        assert match and all(eval(r["best"], {"W8A8Tiles": W8A8Tiles}) == eval(tiles, {"W8A8Tiles": W8A8Tiles})
                             for r in match)  # fmt: skip


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (fp8 and bf16 rounding as the GPU rounds)")
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
@pytest.mark.parametrize("static", [False, True])
def test_w8a8_cuda_kernels_are_the_reference_bit_for_bit(qdtype, static):
    from engine.kernels.w8a8 import quantize_rows, scaled_matmul

    k = 14336
    w = torch.randn(512, k, device="cuda")
    q, scale = quantize_per_row(w, qdtype)
    layer = ScaledLinear(q, scale.flatten(), None, torch.bfloat16,
                         input_scale=torch.tensor(0.02, device="cuda") if static else None)  # fmt: skip
    for m in (1, 3, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 2
        xq, xs = quantize_rows(x, qdtype, layer.input_scale)
        ref_q, ref_s = layer._quantize_input(x)
        assert torch.equal(xq.view(torch.int8), ref_q.view(torch.int8)) and torch.equal(xs, ref_s)
        if qdtype == torch.int8:  # against int64 products on the CPU (float32 sums of 14336 are not exact)
            acc = (xq.cpu().long() @ layer.weight.cpu().long().t()).float()
            ref = (acc * xs.cpu() * layer.weight_scale.cpu()).to(torch.bfloat16)
            assert torch.equal(scaled_matmul(xq, xs, layer.weight, layer.weight_scale, torch.bfloat16).cpu(), ref)
        else:  # float32 sums in another order than _scaled_mm's (whose row-wise scaling gives bf16 only)
            w, ws = layer.weight, layer.weight_scale
            ref = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16).float()
            got = scaled_matmul(xq, xs, w, ws, torch.bfloat16).float()
            assert (got - ref).norm() / ref.norm() < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the 8-bit GEMM at Llama-3-8B shapes, fp8 as the GPU rounds)")
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_w8a8_gemm_full_shapes_split_and_fused_on_cuda(qdtype):
    """The 8B's four decode matmuls at 1 / 16 / 33 / 64 rows: the rule's tiles and candidates of the sweep's
    grid (and of its wide / deep 64-row tiles), unfused against the per-row product (int8: int64 sums, bit for
    bit) and fused against block_scaled_matmul, one counter array shared by all launches as a layer shares it."""
    from bench.quant_gpu import SHAPES, w8a8_candidates, w8a8_wide_candidates
    from engine.kernels.w8a8 import fused_scaled_matmul, quantize_rows, scaled_matmul, w8a8_tiles
    from engine.layers.linear import block_scaled_matmul

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for k, n in SHAPES:
        wq, ws = quantize_per_row(torch.randn(n, k, device="cuda") * 0.02, qdtype)
        ws = ws.reshape(1, -1).contiguous()
        counters = torch.zeros(n // 16, dtype=torch.int32, device="cuda")
        for m in (1, 16, 33, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x, qdtype)
            if qdtype == torch.int8:  # float64 sums of int8 products are exact (< 2**53)
                ref = ((xq.double() @ wq.double().t()).float() * xs * ws).to(torch.bfloat16)
            else:
                ref = (xq.float() @ wq.float().t()) * xs * ws
            bm = max(16, 1 << (m - 1).bit_length())
            kind = "int8" if qdtype == torch.int8 else "fp8"
            wide = w8a8_wide_candidates(bm, n, k, sms)[::3] if bm == 64 else []
            for config in [w8a8_tiles(kind, m, n, k, sms), *w8a8_candidates(bm, n, k, sms)[::17], *wide]:
                if config.fused:
                    fref = block_scaled_matmul(x.float(), wq, ws, config.block_k, torch.float32)
                    got = fused_scaled_matmul(x, wq, ws, torch.bfloat16, config, counters).float()
                    assert (got - fref).norm() / fref.norm() < 1e-2, (k, n, m, config)
                else:
                    got = scaled_matmul(xq, xs, wq, ws, torch.bfloat16, config, counters)
                    if qdtype == torch.int8:
                        assert torch.equal(got, ref), (k, n, m, config)
                    else:
                        assert (got.float() - ref).norm() / ref.norm() < 1e-2, (k, n, m, config)
                assert not counters.any(), config


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("fused", [False, True])
def test_scaled_linear_split_gemm_replays_in_a_cuda_graph(monkeypatch, fused):
    """FP8 decode through the split Triton GEMM captured once and replayed on new inputs, as the engine's
    decode graphs run it: each replay equals an eager call (the counters are zero again after every launch)."""
    from engine.kernels import quant_tiles
    from engine.kernels.quant_tiles import W8A8Tiles

    k, n = 4096, 4096
    monkeypatch.setattr(quant_tiles, "FP8_TRITON_MAX_M", 64)
    monkeypatch.setitem(quant_tiles.W8A8_TABLE, ("fp8", k, n, 16), W8A8Tiles(16, 64, 128, 4, fused=fused))
    q, scale = quantize_per_row(torch.randn(n, k, device="cuda") * 0.02, FP8)
    layer = ScaledLinear(q, scale.flatten(), None, torch.bfloat16)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer(x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
    torch.cuda.synchronize()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer(x)) and not layer.counters.any()


# ----- activations quantized by the kernel that produces them (the RMSNorm / SwiGLU before a W8A8 linear) -----


@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
def test_scaled_linear_takes_a_quantized_activation_and_names_when(qdtype):
    """A QuantizedActivation goes straight to the product: the output equals the layer's on the plain rows it
    was quantized from, bit for bit. fused_input_quant asks for one only from the Triton kernels, only for a
    W8A8 linear with dynamic input scales."""
    from engine.layers.linear import QuantizedActivation, fused_input_quant
    from engine.ops import TORCH_OPS, Ops

    g = torch.Generator().manual_seed(20)
    wq, ws = quantize_per_row(torch.randn(40, 96, generator=g), qdtype)
    layer = ScaledLinear(wq, ws.flatten(), torch.randn(40, generator=g), torch.float32)
    x = torch.randn(5, 96, generator=g)
    out = layer(QuantizedActivation(*quantize_per_row(x, qdtype)))
    assert out.shape == (5, 40) and torch.equal(out, layer(x))
    triton_ops = Ops("triton", TORCH_OPS.rms_norm, TORCH_OPS.silu_and_mul)  # the table's name is what counts
    static = ScaledLinear(wq, ws.flatten(), None, torch.float32, input_scale=torch.tensor(0.05))
    assert fused_input_quant(triton_ops, layer, 5) == qdtype
    assert fused_input_quant(TORCH_OPS, layer, 5) is None
    assert fused_input_quant(triton_ops, static, 5) is None
    assert fused_input_quant(triton_ops, torch.nn.Linear(96, 40), 5) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the tiles pick the GEMM on CUDA only)")
def test_tiles_that_quantize_inside_the_gemm_keep_the_plain_input(monkeypatch):
    """Where the 8-bit GEMM's tiles quantize the activations per K step (fused=True), the layer asks for the
    plain rows (block scales are not per-row ones); rows beyond the Triton GEMM's limit take quantized ones."""
    from engine.kernels import quant_tiles
    from engine.kernels.quant_tiles import W8A8Tiles

    wq, ws = _w8a8_weight(40, 256, FP8, torch.Generator().manual_seed(21))
    layer = ScaledLinear(wq, ws.flatten(), None, torch.bfloat16)
    monkeypatch.setitem(quant_tiles.W8A8_TABLE, ("fp8", 256, 40, 16), W8A8Tiles(16, 16, 64, 2, fused=True))
    monkeypatch.setitem(quant_tiles.W8A8_TABLE, ("fp8", 256, 40, 64), W8A8Tiles(64, 16, 64, 2, fused=False))
    assert layer.input_quant(8) is None and layer.input_quant(40) == FP8
    assert layer.input_quant(quant_tiles.FP8_TRITON_MAX_M + 1) == FP8


def _quantized_inputs(model) -> dict[str, list[bool]]:
    """Forward pre-hooks recording, per projection name, whether each call's input came quantized."""
    from engine.layers.linear import QuantizedActivation

    seen: dict[str, list[bool]] = {}
    for name, module in model.named_modules():
        if isinstance(module, ScaledLinear):
            key = name.rpartition(".")[2]
            module.register_forward_pre_hook(lambda m, a, k=key: seen.setdefault(k, []).append(
                isinstance(a[0], QuantizedActivation)))  # fmt: skip
    return seen


@pytest.mark.parametrize("source", ["fp8", "ct-w8a8-int8", "ct-w8a8-fp8-static"])
def test_fused_activation_quantization_gives_the_unfused_logits(tiny_model_dir, quantized_dirs, monkeypatch, source):
    """W8A8 models on the Triton backend (the interpreter without a GPU): a tiny Llama with --quantization fp8,
    a tiny Qwen2 (qkv bias) from an int8 compressed-tensors checkpoint. The norms hand qkv_proj and
    gate_up_proj their input quantized, SwiGLU hands down_proj its input, o_proj quantizes its own, and the
    prompt logits (prefill, then decode-sized steps over the cache) are those of the unfused path, bit for bit.
    Static input scales (a checkpoint's calibrated ones) keep every linear quantizing its own input."""
    pytest.importorskip("triton")
    from bench.quant_ppl import prompt_logits
    from engine.kernels.w8a8 import quantize_rows
    from engine.llm import LLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # The unfused path as CUDA runs it: quantize_rows, not the torch reference, before the product. Under
        # the interpreter the two differ for fp8 (its cast rounds 127.x down to 64: no carry into the exponent),
        # while the kernels that fuse the quantization round as quantize_rows does.
        def quantize_input(self, x):
            return quantize_rows(x.contiguous(), self.weight.dtype, self.input_scale)

        monkeypatch.setattr(ScaledLinear, "_quantize_input", quantize_input)
    ids = [1, 17, 42, 99, 7, 300, 12, 5, 6, 7, 250, 3]
    if source == "fp8":
        model, kwargs = tiny_model_dir("llama"), {"quantization": "fp8"}
    else:
        model, kwargs = quantized_dirs(source), {}
    # bfloat16 on CUDA: a float32 norm may differ from the plain kernel's in the last bit there (see
    # test_rms_norm_quantized_is_the_norm_then_quantize_rows); 16-bit rows are rounded before they are quantized
    dtype = "float32" if device == "cpu" else "bfloat16"
    llm = LLM(str(model), dtype=dtype, device=device, attention_backend="triton", max_model_len=64,
              num_gpu_blocks_override=16, **kwargs)  # fmt: skip
    seen = _quantized_inputs(llm.engine.runner.model)
    fused = [prompt_logits(llm, ids), prompt_logits(llm, ids, chunk=1)]
    static = source.endswith("static")
    fusing = {not static}
    expected = {"qkv_proj": fusing, "o_proj": {False}, "gate_up_proj": fusing, "down_proj": fusing}
    assert {k: set(v) for k, v in seen.items()} == expected
    monkeypatch.setattr(ScaledLinear, "input_quant", lambda self, rows: None)  # each linear quantizes its input
    seen.clear()
    unfused = [prompt_logits(llm, ids), prompt_logits(llm, ids, chunk=1)]
    assert set(sum(seen.values(), [])) == {False}
    for got, ref in zip(fused, unfused):
        assert torch.equal(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16, fp8 as the GPU rounds, 8B shapes)")
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_cuda_norm_and_swiglu_quantized_inputs_give_the_layer_output_at_8b_shapes(qdtype):
    """qkv_proj after the quantizing RMSNorm and down_proj after the quantizing SwiGLU, Llama-3-8B sizes, bf16,
    decode and prompt row counts: wherever the layer takes a quantized input (input_quant), its output is the
    one it gives on the plain rows, bit for bit (the Triton GEMM, torch._scaled_mm / _int_mm past its limit)."""
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.norm import rms_norm
    from engine.layers.linear import QuantizedActivation

    g = torch.Generator(device="cuda").manual_seed(22)
    norm_w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=g)).bfloat16()
    wq, ws = _w8a8_weight(6144, 4096, qdtype, torch.Generator().manual_seed(23))
    qkv = ScaledLinear(wq, ws.flatten(), None, torch.bfloat16)
    wq, ws = _w8a8_weight(4096, 14336, qdtype, torch.Generator().manual_seed(24))
    down = ScaledLinear(wq, ws.flatten(), None, torch.bfloat16)
    taken = set()
    for m in (1, 16, 33, 64, 200):
        x = torch.randn(m, 4096, device="cuda", generator=g).bfloat16()
        gate_up = (torch.randn(m, 2 * 14336, device="cuda", generator=g) * 3).bfloat16()
        for layer, plain, quantized in (
            (qkv, rms_norm(x, norm_w, 1e-5), rms_norm(x, norm_w, 1e-5, quant=qdtype)),
            (down, silu_and_mul(gate_up), silu_and_mul(gate_up, quant=qdtype)),
        ):
            if layer.input_quant(m) is not None:
                taken.add((layer.in_features, m))
                assert torch.equal(layer(QuantizedActivation(*quantized)), layer(plain)), (m, layer.in_features)
    # Tiles that quantize inside the GEMM (the table's choice at few rows) take the plain rows; 64 rows (the
    # Triton GEMM) and 200 (torch's) always take the quantized ones, for both layers.
    assert {(k, m) for k in (4096, 14336) for m in (64, 200)} <= taken, taken


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (decode CUDA graphs)")
def test_cuda_fused_activation_quantization_replays_in_the_decode_graphs(tiny_model_dir):
    """A tiny Llama with --quantization fp8 on the Triton backend: the decode graphs, captured with the norms and
    SwiGLU quantizing for their linears, give the greedy tokens of eager steps, batch 1 to 5."""
    from engine import LLM, SamplingParams

    prompts = [[1, 17, 42, 99, 7], [5, 6, 7], list(range(40, 60)), [300, 2], [9] * 11]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for eager in (False, True):
        llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", device="cuda", attention_backend="triton",
                  quantization="fp8", max_model_len=64, num_gpu_blocks_override=32, enforce_eager=eager)  # fmt: skip
        assert (llm.engine.runner.graphs is None) == eager
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert tokens[0] == tokens[1]


def test_apply_tiles_l2_ahead_rewrites_the_gemv_entries(tmp_path, monkeypatch):
    """bench.apply_tiles --l2-ahead (the tree gpu_check.sh l2-ab times): GEMV_TABLE's entries prefetch that
    many steps into L2, unpipelined, the rest of each entry and the other tables as committed."""
    import dataclasses
    import importlib.util
    import sys
    from pathlib import Path

    from bench.apply_tiles import apply, l2_tables
    from engine.kernels import quant_tiles

    path = tmp_path / "quant_tiles.py"
    path.write_text(apply(Path(quant_tiles.__file__).read_text(), l2_tables(4)))
    spec = importlib.util.spec_from_file_location("l2_tiles", path)
    l2 = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "l2_tiles", l2)
    spec.loader.exec_module(l2)
    assert set(l2.GEMV_TABLE) == set(quant_tiles.GEMV_TABLE)
    for key, tiles in quant_tiles.GEMV_TABLE.items():
        assert vars(l2.GEMV_TABLE[key]) == vars(dataclasses.replace(tiles, num_stages=1, l2_ahead=4)), key
    assert {k: vars(v) for k, v in l2.MID_TABLE.items()} == {k: vars(v) for k, v in quant_tiles.MID_TABLE.items()}


def test_apply_tiles_writes_sweep_winners_into_a_copy_of_the_tables(tmp_path, monkeypatch):
    """bench.apply_tiles rewrites GEMV_TABLE / MID_TABLE of a quant_tiles.py copy from sweep rows: a shape's
    winner replaces its entry or adds one, MID_TABLE takes the fastest tiles, a fragment layout's too
    (WeightOnlyLinear keeps a copy of the weight in each layout the table names), other rows and the rest of the
    module are left alone."""
    import importlib.util
    import sys
    from pathlib import Path

    from bench.apply_tiles import apply, winners
    from engine.kernels import quant_tiles
    from engine.kernels.quant_tiles import GemvTiles, MidTiles

    gemv = GemvTiles(block_n=128, block_kw=16, split=2, num_warps=8, prefetch=0, num_stages=3)
    frag = MidTiles(block_m=16, block_n=64, block_k=128, split=8, num_warps=4, num_stages=3, masked=True, fragment=2)
    plain = MidTiles(block_m=16, block_n=128, block_k=64, split=4, num_warps=8, num_stages=4, trans=True)
    h200 = Path(__file__).parent.parent / "bench/results/2026-12-03-h200-7b91949-mid-sweep-do-bench.jsonl"
    h200_rows = [json.loads(line) for line in h200.read_text().splitlines()]
    rows = h200_rows + [
        {"sweep": "gemv-w4", "k": 4096, "n": 6144, "best": repr(gemv)},
        {"sweep": "gemv-w8", "k": 256, "n": 96, "best": repr(gemv)},
        {"sweep": "gemv-vs-dot-w4", "k": 4096, "n": 6144, "m": 2, "gemv_us": 1.0, "dot_us": 2.0},
        {"sweep": "gemv-w4 layer total (4 matmuls), batch 1", "best_us": 1.0},
        {"sweep": "mid-w4", "k": 4096, "n": 4096, "m": 16, "best": repr(frag), "best_plain": repr(plain)},
        {"sweep": "w8a8-fp8", "k": 4096, "n": 4096, "block_m": 64, "best": "W8A8Tiles()"},
    ]
    tables = winners(rows)
    path = tmp_path / "quant_tiles.py"
    path.write_text(apply(Path(quant_tiles.__file__).read_text(), tables))
    spec = importlib.util.spec_from_file_location("swept_tiles", path)
    swept = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "swept_tiles", swept)  # its dataclasses resolve their module
    spec.loader.exec_module(swept)

    assert swept.GEMV_TABLE[(4, 4096, 6144)] == swept.GemvTiles(**vars(gemv))
    assert swept.GEMV_TABLE[(8, 256, 96)] == swept.GemvTiles(**vars(gemv))
    assert {k: vars(v) for k, v in swept.GEMV_TABLE.items() if k not in ((4, 4096, 6144), (8, 256, 96))} == {
        k: vars(v) for k, v in quant_tiles.GEMV_TABLE.items() if k != (4, 4096, 6144)
    }
    mid = {k: vars(v) for k, v in swept.MID_TABLE.items()}
    assert set(mid) == set(quant_tiles.MID_TABLE)
    assert mid[(4, 4096, 4096, 16)] == vars(frag)
    for row in (r for r in h200_rows if "best" in r):
        key = (int(row["sweep"][-1]), row["k"], row["n"], row["m"])
        if key != (4, 4096, 4096, 16):
            assert mid[key] == vars(eval(row["best"], {"MidTiles": MidTiles})), key
    assert any(v["fragment"] for v in mid.values())
    assert {k: vars(v) for k, v in swept.W8A8_TABLE.items()} == {k: vars(v) for k, v in quant_tiles.W8A8_TABLE.items()}
    assert swept.GEMV_MAX_M == quant_tiles.GEMV_MAX_M
