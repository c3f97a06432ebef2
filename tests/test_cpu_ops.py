"""The C kernels of engine/cpu_ops.py against the torch reference, and the cpu backend in the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams, cpu_ops
from engine.attention import Attention, AttentionMetadata, select_backend
from engine.attention.torch_ref import store_kv
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.ops import torch_silu_and_mul as silu_and_mul
from tests.attention_reference import assert_close, make_batch, poisoned_like, reference
from tests.conftest import KV_BYTES

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler here to build engine/csrc/cpu_ops.c")
DTYPES = [torch.float32, torch.bfloat16]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_rounds_like(out: torch.Tensor, ref: torch.Tensor, frac: float = 0.99) -> None:
    """float32: equal within float32 rounding. bfloat16: rounded at the same points as the reference, so
    bit-equal except where a float32 sum taken in another order lands on the other side of a bf16 step."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-2)
    same = (out == ref).float().mean().item()
    assert same >= frac, f"only {same:.4f} of elements bit-equal"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 576), (16, 1024), (3, 100)])
def test_rms_norm(dtype, tokens, hidden):
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=gen(1)))
    norm = norm.to(dtype)
    x = (torch.randn(tokens, hidden, generator=gen(2)) * 3).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen(3)).to(dtype)
    assert_rounds_like(cpu_ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, summed = cpu_ops.rms_norm(x, norm.weight, norm.eps, residual)
    ref_out, ref_summed = norm(x, residual)
    assert torch.equal(summed, ref_summed)  # one rounded add: exact
    assert_rounds_like(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,k_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_rotary_on_slices_of_the_fused_projection(dtype, q_heads, k_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    tokens = 11
    qkv = (torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen(4)) * 2).to(dtype)
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, k_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 3, 3, 512, 9, 1000])
    before = qkv.clone()
    q_out, k_out = cpu_ops.apply_rotary(positions, q, k, rope.cos, rope.sin)
    q_ref, k_ref = rope(positions, q, k)
    assert torch.equal(qkv, before)  # inputs untouched
    # The same products, rounded where the reference rounds them: bit-equal in bf16.
    frac = 1.0 if dtype == torch.bfloat16 else 0.0
    assert_rounds_like(q_out, q_ref, frac)
    assert_rounds_like(k_out, k_ref, frac)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 1536), (16, 100)])
def test_silu_and_mul(dtype, tokens, inter):
    # Wide inputs: the exponential's clamp and the far tails (silu(x) -> 0 and -> x) are exercised.
    gate_up = (torch.randn(tokens, 2 * inter, generator=gen(5)) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, -88.0, 88.0, 100.0]).to(dtype)
    assert_rounds_like(cpu_ops.silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_store_kv_skips_padding_slots_and_reads_strided_rows():
    cache_k = torch.zeros(4, 8, 2, 16)
    cache_v = torch.zeros(4, 8, 2, 16)
    kv = torch.randn(5, 2 * 2 * 16, generator=gen(6))
    k, v = (part.view(5, 2, 16) for part in kv.split([32, 32], dim=-1))
    slots = torch.tensor([3, 17, -1, 31, 0])
    cpu_ops.store_kv(k, v, cache_k, cache_v, slots)
    ref_k, ref_v = torch.zeros_like(cache_k), torch.zeros_like(cache_v)
    keep = slots >= 0
    store_kv(k[keep], v[keep], ref_k, ref_v, slots[keep])
    assert torch.equal(cache_k, ref_k) and torch.equal(cache_v, ref_v)


# A mixed batch: a fresh prompt, decodes, a chunk after cached context, a one-token sequence.
CTX = [0, 37, 70, 5, 0, 200]
QLEN = [20, 1, 13, 30, 1, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 32), (8, 1, 80, 8), (6, 2, 64, 1)],
)
def test_paged_attention_matches_the_reference(dtype, heads, kv_heads, head_dim, block_size):
    batch = make_batch(CTX, QLEN, heads, kv_heads, head_dim, block_size, dtype, device="cpu")
    out = poisoned_like(batch["q"])
    seqs = torch.arange(len(CTX), dtype=torch.int32)
    cpu_ops.paged_attention(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["block_tables"],
        batch["query_start"],
        batch["seq_lens"],
        seqs,
        batch["scale"],
        out,
    )
    assert_close(out, reference(**batch), dtype)


def test_paged_attention_writes_only_the_listed_sequences():
    batch = make_batch(CTX, QLEN, 4, 2, 64, 16, torch.float32, device="cpu")
    out = poisoned_like(batch["q"])
    seqs = torch.tensor([1, 3], dtype=torch.int32)
    cpu_ops.paged_attention(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["block_tables"],
        batch["query_start"],
        batch["seq_lens"],
        seqs,
        batch["scale"],
        out,
    )
    starts = batch["query_start"].tolist()
    listed = torch.zeros(out.shape[0], dtype=torch.bool)
    for s in (1, 3):
        listed[starts[s] : starts[s + 1]] = True
    assert out[~listed].isnan().all()
    assert_close(out[listed], reference(**batch)[listed], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_layer_cpu_backend_equals_the_torch_backend(dtype):
    """The whole layer (store, then attend) on a batch with prompts longer and shorter than the C kernel's
    limit, so both of the cpu backend's paths run."""
    ctx, qlen = [0, 0, 40, 0, 9], [90, 7, 1, 1, 100]
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    batch = make_batch(ctx, qlen, heads, kv_heads, head_dim, block_size, dtype, device="cpu")
    tokens = sum(qlen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen(7)).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen(8)).to(dtype)
    slots, starts = [], batch["query_start"].tolist()
    for s, seq_len in enumerate(batch["seq_lens"].tolist()):
        for pos in range(seq_len - qlen[s], seq_len):
            slots.append(int(batch["block_tables"][s, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start=starts,
        seq_lens=batch["seq_lens"].tolist(),
        block_tables=batch["block_tables"],
        seq_lens_tensor=batch["seq_lens"],
        query_start_tensor=batch["query_start"],
        max_query_len=max(qlen),
        max_seq_len=max(batch["seq_lens"].tolist()),
    )
    outs, caches = {}, {}
    for backend in ("torch", "cpu"):
        layer = Attention(heads, kv_heads, head_dim, select_backend(backend, torch.device("cpu"), dtype, 16))
        layer.backend.plan(meta)  # the runner's part, once per step
        layer.k_cache, layer.v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
        outs[backend] = layer(batch["q"], k, v, meta)
        caches[backend] = (layer.k_cache, layer.v_cache)
    assert torch.equal(caches["cpu"][0], caches["torch"][0]) and torch.equal(caches["cpu"][1], caches["torch"][1])
    torch.testing.assert_close(
        outs["cpu"].float(),
        outs["torch"].float(),
        rtol=1e-5 if dtype == torch.float32 else 2e-2,
        atol=1e-5 if dtype == torch.float32 else 2e-2,
    )


def test_engine_cpu_backend_greedy_equals_the_torch_backend(default_model_dir):
    """float32, the default model: the cpu backend (the CPU default) and the torch reference produce the same
    tokens, through prefill, decode and a mixed batch (requests of different lengths)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 9, 17)]
    tokens = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            str(default_model_dir),
            dtype="float32",
            device="cpu",
            attention_backend=backend,
            max_model_len=256,
            cpu_kv_cache_bytes=KV_BYTES,
        )
        assert llm.engine.runner.backend.name == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["cpu"] == tokens["torch"]


def test_without_a_compiler_the_cpu_falls_back_to_torch(tmp_path):
    code = (
        "import json, torch\n"
        "from engine import cpu_ops\n"
        "from engine.attention import select_backend\n"
        "auto = select_backend('auto', torch.device('cpu'), torch.float32, 16).name\n"
        "try:\n"
        "    select_backend('cpu', torch.device('cpu'), torch.float32, 16)\n"
        "    forced = 'accepted'\n"
        "except ValueError as exc:\n"
        "    forced = str(exc)\n"
        "print(json.dumps([cpu_ops.available(), auto, forced]))\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "PAGODA_CACHE": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    available, auto, forced = json.loads(run.stdout.strip().splitlines()[-1])
    assert (available, auto) == (False, "torch")
    assert "C compiler" in forced


def test_openmp_threads_released_and_rebuilt_on_demand():
    """The server's main thread gives its OpenMP workers back before the engine thread computes; a parallel
    operator afterwards (on any thread) still runs and gets the right answer."""
    a = torch.randn(300, 400, generator=gen(9))
    expected = a @ a.T
    assert cpu_ops.release_openmp_threads()
    torch.testing.assert_close(a @ a.T, expected)
