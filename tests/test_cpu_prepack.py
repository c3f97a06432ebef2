"""oneDNN-prepacked linear layers (bfloat16 on the CPU): same numbers as nn.Linear, same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers.linear import PackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.bfloat16, torch.device("cpu")), reason="this CPU has no native bfloat16 for oneDNN"
)


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen) / 10)
        if bias:
            linear.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    packed = PackedLinear(linear)
    ref = linear(x)
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # Both accumulate in float32 and round once; allow one bf16 step where the sums' order differs.
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-2)


def test_prepack_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False))).to(torch.bfloat16)
    assert prepack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model(torch.ones(2, 8, dtype=torch.bfloat16)).shape == (2, 4)


def test_bf16_greedy_is_the_same_with_and_without_prepacking(tiny_model_dir, monkeypatch):
    from engine import LLM, SamplingParams

    prompts = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def greedy():
        llm = LLM(model=str(tiny_model_dir("llama")), dtype="bfloat16", device="cpu", num_gpu_blocks_override=64)
        packed = any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())
        return packed, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    packed, with_packing = greedy()
    assert packed
    monkeypatch.setattr("engine.runner.loaded_model.can_prepack", lambda dtype, device: False)
    packed, without = greedy()
    assert not packed
    assert with_packing == without
