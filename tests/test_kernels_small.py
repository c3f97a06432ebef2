"""The small Triton kernels (RMSNorm, q/k norm + rotary + KV store, SwiGLU) against their torch references.

Without a GPU they run under the Triton interpreter, in float32 and float16 only
(the interpreter of triton 3.9 gets bfloat16 wrong); bf16 and larger shapes run on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must be set before triton is imported (the kernels read it when they are defined).
    os.environ["TRITON_INTERPRET"] = "1"

from engine.attention.torch_ref import store_kv as ref_store_kv
from engine.kernels.activation import silu_and_mul
from engine.kernels.norm import rms_norm
from engine.kernels.qkv_store import prepare_and_store
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.ops import torch_silu_and_mul

DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bf16 and large shapes)")
CPU_DTYPES = [torch.float32, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype=dtype, device=DEV)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    atol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


def _mostly_equal(out: torch.Tensor, ref: torch.Tensor, frac: float = 0.99) -> None:
    """Half-precision outputs round like the reference's; only a rare element may be one ulp off
    (the float32 reduction order differs from torch's). Float32 outputs are only close."""
    if out.dtype == torch.float32:
        return
    same = (out == ref).float().mean().item()
    assert same >= frac, f"only {same:.4f} of elements bit-equal"


def _fused_qkv(t: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int):
    """q, k, v as strided views of one fused projection output, as engine/models/llama.py makes them."""
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=seed, scale=2.0)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return qkv, q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, d)


# ---------------------------------------------------------------- RMSNorm


def _ref_norm(hidden: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(hidden, generator=_gen(seed)))
    return norm.to(device=DEV, dtype=dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,hidden", [(1, 64), (7, 576), (5, 1024), (3, 100)])
def test_rms_norm(dtype, t, hidden):
    ref = _ref_norm(hidden, dtype, seed=hidden)
    x = _randn(t, hidden, dtype=dtype, seed=1, scale=3.0)
    x_before = x.clone()
    with torch.no_grad():
        expected = ref(x)
    out = rms_norm(x, ref.weight.data, ref.eps)  # fresh output
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(x, x_before)
    _close(out, expected, dtype)
    _mostly_equal(out, expected)
    poisoned = torch.full_like(x, float("nan"))
    assert rms_norm(x, ref.weight.data, ref.eps, out=poisoned) is poisoned
    assert torch.equal(poisoned, out)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,hidden", [(1, 64), (9, 576), (3, 1024)])
def test_rms_norm_residual_in_place(dtype, t, hidden):
    ref = _ref_norm(hidden, dtype, seed=hidden)
    x = _randn(t, hidden, dtype=dtype, seed=2, scale=3.0)
    residual = _randn(t, hidden, dtype=dtype, seed=3, scale=3.0)
    with torch.no_grad():
        expected, expected_sum = ref(x, residual)
    out_buf = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    out, new_residual = rms_norm(x, ref.weight.data, ref.eps, residual=residual, out=out_buf)
    assert out is out_buf and new_residual is residual
    assert torch.equal(residual, expected_sum)  # the sum is rounded exactly like the reference's
    _close(out, expected, dtype)
    _mostly_equal(out, expected)
    # Output written over x itself: each row is read before it is written.
    x2 = _randn(t, hidden, dtype=dtype, seed=2, scale=3.0)
    res2 = _randn(t, hidden, dtype=dtype, seed=3, scale=3.0)
    out2, _ = rms_norm(x2, ref.weight.data, ref.eps, residual=res2, out=x2)
    assert out2 is x2 and torch.equal(out2, out) and torch.equal(res2, expected_sum)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (3, 3, 128)])
def test_rms_norm_strided_heads(dtype, hq, hk, d):
    """q/k norm (Qwen3) on [T, H, D] views of the fused qkv output, no copy."""
    ref = _ref_norm(d, dtype, seed=d)
    _, q, k, _ = _fused_qkv(5, hq, hk, d, dtype, seed=4)
    for x in (q, k):
        with torch.no_grad():
            expected = ref(x)
        out = rms_norm(x, ref.weight.data, ref.eps, out=torch.full(x.shape, float("nan"), dtype=dtype, device=DEV))
        _close(out, expected, dtype)
        _mostly_equal(out, expected)


# ---------------------------------------------------------------- rotary

ROPES = {
    "default": {"rope_theta": 10000.0, "rope_type": "default"},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _prep_case(t, hq, hk, d, rope, norm, dtype, seed, num_blocks=4, block_size=16, max_pos=512):
    """Fused q/k/v views, slots, caches and the reference modules for one prepare_and_store call."""
    rotary = RotaryEmbedding(d, max_pos, ROPES[rope]).to(DEV)
    positions = torch.randint(0, max_pos, (t,), generator=_gen(seed)).to(DEV)
    qkv, q, k, v = _fused_qkv(t, hq, hk, d, dtype, seed=seed + 1)
    norms = (_ref_norm(d, dtype, seed + 2), _ref_norm(d, dtype, seed + 3)) if norm else (None, None)
    slots = torch.randperm(num_blocks * block_size, generator=_gen(seed + 4))[:t].to(DEV)
    return rotary, positions, qkv, q, k, v, norms, slots, _caches(num_blocks, block_size, hk, d, dtype)


def _expected(rotary, positions, q, k, v, norms, slots, caches):
    """The unfused reference: RMSNorm modules, the torch rotary, the torch store (valid slots)."""
    with torch.no_grad():
        exp_q, exp_k = q.clone(), k.clone()
        if norms[0] is not None:
            exp_q, exp_k = norms[0](exp_q), norms[1](exp_k)
        exp_q, exp_k = rotary(positions, exp_q, exp_k)
    exp_kc, exp_vc = caches[0].clone(), caches[1].clone()
    valid = slots >= 0
    ref_store_kv(exp_k[valid], v[valid], exp_kc, exp_vc, slots[valid])
    return exp_q, exp_k, exp_kc, exp_vc


def _run_prep(rotary, positions, q, k, v, norms, slots, caches):
    kw = {}
    if norms[0] is not None:
        kw = dict(q_norm=norms[0].weight.data, k_norm=norms[1].weight.data, eps=norms[0].eps)
    prepare_and_store(q, k, v, *caches, slots, positions=positions, cos=rotary.cos, sin=rotary.sin, **kw)


def _check_prep(q, k, caches, expected, dtype, norm):
    exp_q, exp_k, exp_kc, exp_vc = expected
    assert torch.equal(caches[1], exp_vc)
    pairs = [(q, exp_q), (k, exp_k), (caches[0], exp_kc)]
    if dtype == torch.float32:  # float32 may differ by fma contraction and the sum's order
        for out, ref in pairs:
            _close(out, ref, dtype)
    elif norm:  # the norm's float32 sum runs in another order: a rare element one ulp off
        for out, ref in pairs:
            _close(out, ref, dtype)
            _mostly_equal(out, ref)
    else:  # each rounding of the rotary reference is reproduced
        assert all(torch.equal(out, ref) for out, ref in pairs)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(
    "t,hq,hk,d,rope", [(7, 4, 2, 64, "default"), (5, 8, 1, 128, "llama3"), (1, 2, 2, 64, "llama3")]
)
def test_prepare_and_store_matches_norm_rotary_store(dtype, norm, t, hq, hk, d, rope):
    case = _prep_case(t, hq, hk, d, rope, norm, dtype, seed=5)
    rotary, positions, qkv, q, k, v, norms, slots, caches = case
    v_before = v.clone()
    expected = _expected(rotary, positions, q, k, v, norms, slots, caches)
    _run_prep(*case[:2], *case[3:])
    _check_prep(q, k, caches, expected, dtype, norm)
    assert torch.equal(v, v_before)  # v is only read


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_prepare_and_store_reads_the_first_t_positions(dtype):
    """A caller may hand a longer positions buffer (a captured one): only the first T entries count."""
    case = _prep_case(6, 4, 2, 64, "default", True, dtype, seed=31)
    rotary, positions, qkv, q, k, v, norms, slots, caches = case
    expected = _expected(rotary, positions, q, k, v, norms, slots, caches)
    longer = torch.cat([positions, torch.full((10,), 500, device=DEV)])
    _run_prep(rotary, longer, q, k, v, norms, slots, caches)
    _check_prep(q, k, caches, expected, dtype, norm=True)


# ---------------------------------------------------------------- KV store


def _caches(num_blocks: int, block_size: int, kvh: int, d: int, dtype: torch.dtype):
    shape = (num_blocks, block_size, kvh, d)
    return _randn(*shape, dtype=dtype, seed=7), _randn(*shape, dtype=dtype, seed=8)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", [(7, 4, 2, 64), (13, 2, 1, 128)])
def test_store_only_permuted_slots(dtype, t, hq, hk, d):
    """Without norms or positions the kernel is a plain KV store and leaves q and k as they are."""
    num_blocks, block_size = 4, 16
    kc, vc = _caches(num_blocks, block_size, hk, d, dtype)
    _, q, k, v = _fused_qkv(t, hq, hk, d, dtype, seed=9)
    q_before, ref_k_before = q.clone(), k.clone()
    slots = torch.randperm(num_blocks * block_size, generator=_gen(10))[:t].to(DEV)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref_store_kv(k, v, ref_kc, ref_vc, slots)
    prepare_and_store(q, k, v, kc, vc, slots)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    assert torch.equal(q, q_before) and torch.equal(k, ref_k_before)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_negative_slots_store_nothing(dtype):
    t, hk, d = 9, 2, 64
    case = _prep_case(t, 4, hk, d, "default", True, dtype, seed=11, num_blocks=3)
    rotary, positions, qkv, q, k, v, norms, _, caches = case
    slots = torch.tensor([5, -1, 40, -1, 17, 0, -1, 47, -1], device=DEV)
    expected = _expected(rotary, positions, q, k, v, norms, slots, caches)
    _run_prep(rotary, positions, q, k, v, norms, slots, caches)
    _check_prep(q, k, caches, expected, dtype, norm=True)
    # All padding: the cache does not change at all (q is still prepared).
    before = [c.clone() for c in caches]
    prepare_and_store(q, k, v, *caches, torch.full((t,), -1, device=DEV))
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


# ---------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 64), (7, 576), (3, 1376)])
def test_silu_and_mul(dtype, t, inter):
    x = _randn(t, 2 * inter, dtype=dtype, seed=12, scale=4.0)
    expected = torch_silu_and_mul(x)
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEV)
    assert silu_and_mul(x, out=out) is out
    _close(out, expected, dtype)
    _mostly_equal(out, expected, frac=0.98)
    fresh = silu_and_mul(x.view(1, t, 2 * inter))  # leading dims kept
    assert fresh.shape == (1, t, inter) and torch.equal(fresh[0], out)


def test_silu_and_mul_strided_rows():
    wide = _randn(5, 300, dtype=torch.float32, seed=13)
    x = wide[:, :256]  # rows not contiguous with each other
    _close(silu_and_mul(x), torch_silu_and_mul(x), torch.float32)


# ---------------------------------------------------------------- quantized outputs (a W8A8 linear's input)

FP8 = torch.float8_e4m3fn
QDTYPES = [torch.int8, FP8]


def _same_quantized(
    got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor], exact: bool = True
) -> None:
    """Bit for bit: the 8-bit values (compared as bytes) and the float32 scales (NaN where expected is). Not
    `exact`: the scales within a float32 ulp or two and at most 1% of the values one code apart."""
    (q, s), (eq, es) = got, expected
    assert q.dtype == eq.dtype and q.shape == eq.shape and q.is_contiguous() and s.shape == es.shape
    assert torch.equal(s.isnan(), es.isnan())
    if exact:
        assert torch.equal(q.view(torch.int8), eq.view(torch.int8))
        assert torch.equal(s.nan_to_num(), es.nan_to_num())
        return
    torch.testing.assert_close(s.nan_to_num(), es.nan_to_num(), rtol=3e-7, atol=0)
    # fp8 E4M3 codes of one sign are ordered as their bytes: a byte apart is a code apart
    apart = (q.view(torch.int8).int() - eq.view(torch.int8).int()).abs()
    assert apart.max() <= 1 and (apart > 0).float().mean() <= 0.01


def _quant_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows that exercise the quantizer: an all-zero row (the scale's floor) and an outlier."""
    x = x.clone()
    x[0] = 0
    x[-1, 3] = 40.0
    return x


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,hidden", [(2, 64), (7, 576), (3, 100)])
def test_rms_norm_quantized_is_the_norm_then_quantize_rows(qdtype, dtype, t, hidden):
    """With `quant`, the norm hands over what quantize_rows makes of its output, bit for bit, and the residual
    sum is stored as without it."""
    from engine.kernels.w8a8 import quantize_rows

    ref = _ref_norm(hidden, dtype, seed=hidden)
    x = _randn(t, hidden, dtype=dtype, seed=30, scale=3.0)
    residual = _quant_rows(_randn(t, hidden, dtype=dtype, seed=31, scale=3.0))
    w = ref.weight.data
    # A float32 norm is quantized unrounded, and on CUDA the compiler may order the fused kernel's arithmetic
    # otherwise than the plain one's: a last-bit difference in a row's maximum moves its scale by an ulp (seen
    # on an H200 at hidden 576). 16-bit rows are rounded first, and the interpreter computes in numpy.
    exact = dtype != torch.float32 or DEV != "cuda"
    expected = quantize_rows(rms_norm(_quant_rows(x), w, ref.eps), qdtype)
    _same_quantized(rms_norm(_quant_rows(x), w, ref.eps, quant=qdtype), expected, exact)
    expected_out, expected_sum = rms_norm(x, w, ref.eps, residual=residual.clone())
    got, got_sum = rms_norm(x, w, ref.eps, residual=residual, quant=qdtype)
    _same_quantized(got, quantize_rows(expected_out, qdtype), exact)
    assert torch.equal(got_sum, expected_sum)
    if qdtype == torch.int8:  # and so the torch reference's rounding (quantize_rows int8 is bit for bit it)
        from engine.layers.linear import quantize_per_row

        _same_quantized(got, quantize_per_row(expected_out, qdtype), exact)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,inter", [(2, 64), (5, 576), (3, 2100)])
@pytest.mark.parametrize("whole_row_max,whole_row_max_rows", [(16384, 256), (256, 256), (16384, 3)])
def test_silu_and_mul_quantized_is_the_product_then_quantize_rows(
    monkeypatch, qdtype, dtype, t, inter, whole_row_max, whole_row_max_rows
):
    """With `quant`, SwiGLU hands over what quantize_rows makes of its product, bit for bit, its rows in
    registers whole or (rows longer than WHOLE_ROW_MAX, or more rows than WHOLE_ROW_MAX_ROWS: t = 5 of 3) in
    steps of 2048 columns (inter 2100: two, the second partial); rows of any stride."""
    from engine.kernels import activation
    from engine.kernels.w8a8 import quantize_rows

    monkeypatch.setattr(activation, "WHOLE_ROW_MAX", whole_row_max)
    monkeypatch.setattr(activation, "WHOLE_ROW_MAX_ROWS", whole_row_max_rows)
    x = _quant_rows(_randn(t, 2 * inter, dtype=dtype, seed=32, scale=4.0))
    _same_quantized(silu_and_mul(x, quant=qdtype), quantize_rows(silu_and_mul(x), qdtype))
    wide = _randn(t, 2 * inter + 30, dtype=dtype, seed=33, scale=4.0)[:, : 2 * inter]
    _same_quantized(silu_and_mul(wide, quant=qdtype), quantize_rows(silu_and_mul(wide), qdtype))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("whole_row_max", [16384, 32])
def test_a_nan_makes_its_row_scale_nan_in_the_quantizing_norm_and_swiglu(monkeypatch, qdtype, whole_row_max):
    """As in quantize_rows: a NaN row's scale is NaN (so its linear's output row), the other rows untouched."""
    from engine.kernels import activation
    from engine.kernels.w8a8 import quantize_rows

    monkeypatch.setattr(activation, "WHOLE_ROW_MAX", whole_row_max)

    ref = _ref_norm(64, torch.float32, seed=64)
    x = _randn(3, 64, dtype=torch.float32, seed=34, scale=3.0)
    x[1, 17] = float("nan")
    gate_up = _randn(3, 128, dtype=torch.float32, seed=35, scale=3.0)
    gate_up[1, 70] = float("nan")  # an up value
    for (q, s), plain in ((rms_norm(x, ref.weight.data, ref.eps, quant=qdtype), rms_norm(x, ref.weight.data, ref.eps)),
                          (silu_and_mul(gate_up, quant=qdtype), silu_and_mul(gate_up))):  # fmt: skip
        assert s[1].isnan().all() and s[[0, 2]].isfinite().all()
        clean_q, clean_s = quantize_rows(plain[[0, 2]], qdtype)
        assert torch.equal(s[[0, 2]], clean_s) and torch.equal(q[[0, 2]].view(torch.int8), clean_q.view(torch.int8))


_COMPILE_QUANTIZING = """
import os, subprocess, sys, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.activation import _silu_and_mul_quant_kernel
from engine.kernels.norm import _rms_norm_kernel

def compiled(kernel, sig, constexprs, warps):
    sig = sig | dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(kernel, sig, constexprs)
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]
    path = tempfile.mktemp(suffix=".cubin")
    open(path, "wb").write(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout

for int8 in (False, True):
    q, qmax = ("*i8", 127.0) if int8 else ("*fp8e4nv", 448.0)
    strides = dict.fromkeys([f"{t}_s{i}" for t in "xro" for i in range(3)], "i32")
    sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": q, **strides, "scale_ptr": "*fp32",
           "n_cols": "i32", "eps": "fp32"}
    norm = {"HAS_RESIDUAL": True, "BLOCK": 4096, "QUANT": True, "QMAX": qmax, "INT8": int8,
            "NORM_DTYPE": tl.bfloat16, "PDL": 0}
    print("norm", int8, compiled(_rms_norm_kernel, sig, norm, 8).split("REG:")[1].split()[:4])
    sig = {"x_ptr": "*bf16", "q_ptr": q, "scale_ptr": "*fp32", "x_s0": "i32", "x_s1": "i32", "inter": "i32"}
    for whole, block, warps in ((True, 16384, 16), (False, 2048, 4)):
        silu = {"QMAX": qmax, "INT8": int8, "BLOCK": block, "WHOLE_ROW": whole, "PDL": 0}
        print("silu", int8, compiled(_silu_and_mul_quant_kernel, sig, silu, warps).split("REG:")[1].split()[:4])
"""


@pytest.mark.slow
def test_quantizing_norm_and_swiglu_compile_for_sm90_without_spills():
    """The quantizing RMSNorm (hidden 4096) and SwiGLU (Llama-3-8B's 14336 columns in registers, and the stepped
    variant for longer rows), int8 and fp8 on bf16 input, compile for sm_90 without a GPU (Triton and the tools
    of its wheel), nothing spilled to local memory (the whole-row SwiGLU: 128 registers a thread at 16 warps)."""
    import subprocess
    import sys

    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend to compile for sm_90 with")
    # A process of its own: the kernels of this one are the interpreter's (TRITON_INTERPRET=1).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_QUANTIZING], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and all("'LOCAL:0'" in line for line in lines), lines


# ---------------------------------------------------------------- CUDA: bf16, large shapes, graphs


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_cuda_rms_norm_large(dtype, hidden):
    ref = _ref_norm(hidden, dtype, seed=hidden)
    x = _randn(257, hidden, dtype=dtype, seed=14, scale=3.0)
    residual = _randn(257, hidden, dtype=dtype, seed=15, scale=3.0)
    with torch.no_grad():
        expected_plain = ref(x)
        expected, expected_sum = ref(x, residual)
    out = rms_norm(x, ref.weight.data, ref.eps)
    _close(out, expected_plain, dtype)
    _mostly_equal(out, expected_plain)
    poisoned = torch.full_like(x, float("nan"))
    out, residual = rms_norm(x, ref.weight.data, ref.eps, residual=residual, out=poisoned)
    assert torch.equal(residual, expected_sum)
    _close(out, expected, dtype)
    _mostly_equal(out, expected)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (14, 2, 64), (16, 16, 80)])
def test_cuda_prepare_and_store(dtype, norm, hq, hk, d):
    t = 333
    case = _prep_case(t, hq, hk, d, "llama3", norm, dtype, seed=16, num_blocks=64, max_pos=4096)
    rotary, positions, qkv, q, k, v, norms, slots, caches = case
    slots[::7] = -1
    expected = _expected(rotary, positions, q, k, v, norms, slots, caches)
    _run_prep(rotary, positions, q, k, v, norms, slots, caches)
    _check_prep(q, k, caches, expected, dtype, norm)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_silu(dtype):
    t = 301
    x = _randn(t, 2 * 14336, dtype=dtype, seed=20, scale=4.0)
    out = silu_and_mul(x, out=torch.full((t, 14336), float("nan"), dtype=dtype, device=DEV))
    expected = torch_silu_and_mul(x)
    _close(out, expected, dtype)
    _mostly_equal(out, expected, frac=0.98)


@needs_cuda
def test_cuda_graph_capture():
    """All three kernels capture into one CUDA graph and replay on new inputs."""
    dtype, t, hq, hk, d, hidden = torch.bfloat16, 8, 8, 2, 64, 512
    norm = _ref_norm(hidden, dtype, seed=21)
    rotary = RotaryEmbedding(d, 256, ROPES["default"]).to(DEV)
    x = torch.zeros(t, hidden, dtype=dtype, device=DEV)
    res = torch.zeros_like(x)
    qkv = torch.zeros(t, (hq + 2 * hk) * d, dtype=dtype, device=DEV)
    q, k, v = (p.view(t, -1, d) for p in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    positions = torch.zeros(t, dtype=torch.int64, device=DEV)
    slots = torch.full((t,), -1, dtype=torch.int64, device=DEV)
    kc = torch.zeros(4, 16, hk, d, dtype=dtype, device=DEV)
    vc = torch.zeros_like(kc)
    gate_up = torch.zeros(t, 2 * hidden, dtype=dtype, device=DEV)

    def step():
        normed, _ = rms_norm(x, norm.weight.data, norm.eps, residual=res)
        prepare_and_store(q, k, v, kc, vc, slots, positions=positions, cos=rotary.cos, sin=rotary.sin)
        return normed, silu_and_mul(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed_out, act_out = step()

    x.copy_(_randn(t, hidden, dtype=dtype, seed=22))
    res.copy_(_randn(t, hidden, dtype=dtype, seed=23))
    qkv.copy_(_randn(t, qkv.shape[1], dtype=dtype, seed=24))
    positions.copy_(torch.arange(t, device=DEV) * 3)
    slots.copy_(torch.tensor([3, 9, -1, 20, 21, -1, 60, 0], device=DEV))
    gate_up.copy_(_randn(t, 2 * hidden, dtype=dtype, seed=25))
    x0, res0, qkv0 = x.clone(), res.clone(), qkv.clone()
    graph.replay()
    torch.cuda.synchronize()

    with torch.no_grad():
        exp_normed, exp_sum = norm(x0, res0)
    assert torch.equal(res, exp_sum)
    _close(normed_out, exp_normed, dtype)
    q0, k0, v0 = (p.view(t, -1, d) for p in qkv0.split([hq * d, hk * d, hk * d], dim=-1))
    exp_q, exp_k = rotary(positions, q0, k0)
    assert torch.equal(q, exp_q) and torch.equal(k, exp_k)
    exp_kc, exp_vc = torch.zeros_like(kc), torch.zeros_like(vc)
    valid = slots >= 0
    ref_store_kv(exp_k[valid], v0[valid], exp_kc, exp_vc, slots[valid])
    assert torch.equal(kc, exp_kc) and torch.equal(vc, exp_vc)
    _close(act_out, torch_silu_and_mul(gate_up), dtype)


@needs_cuda
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_cuda_quantized_norm_and_swiglu_at_llama_8b_shapes(qdtype):
    """bf16 at the 8B's sizes (hidden 4096, intermediate 14336), decode and prompt row counts: the quantizing
    kernels are the unfused kernels then quantize_rows, bit for bit, and replay in a CUDA graph."""
    from engine.kernels.w8a8 import quantize_rows

    dtype = torch.bfloat16
    norm = _ref_norm(4096, dtype, seed=40)
    w = norm.weight.data
    for t in (1, 16, 64, 257):
        x = _randn(t, 4096, dtype=dtype, seed=41, scale=3.0)
        residual = _randn(t, 4096, dtype=dtype, seed=42, scale=3.0)
        plain, plain_sum = rms_norm(x, w, norm.eps, residual=residual.clone())
        got, got_sum = rms_norm(x, w, norm.eps, residual=residual, quant=qdtype)
        _same_quantized(got, quantize_rows(plain, qdtype))
        assert torch.equal(got_sum, plain_sum)
        gate_up = _randn(t, 2 * 14336, dtype=dtype, seed=43, scale=4.0)
        _same_quantized(silu_and_mul(gate_up, quant=qdtype), quantize_rows(silu_and_mul(gate_up), qdtype))
    x = torch.zeros(8, 4096, dtype=dtype, device=DEV)
    res = torch.zeros_like(x)
    gate_up = torch.zeros(8, 2 * 14336, dtype=dtype, device=DEV)

    def step():
        normed, _ = rms_norm(x, w, norm.eps, residual=res, quant=qdtype)
        return normed, silu_and_mul(gate_up, quant=qdtype)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed_out, act_out = step()
    x.copy_(_randn(8, 4096, dtype=dtype, seed=44))
    res.copy_(_randn(8, 4096, dtype=dtype, seed=45))
    gate_up.copy_(_randn(8, 2 * 14336, dtype=dtype, seed=46))
    x0, res0 = x.clone(), res.clone()
    graph.replay()
    torch.cuda.synchronize()
    plain, _ = rms_norm(x0, w, norm.eps, residual=res0)
    _same_quantized(normed_out, quantize_rows(plain, qdtype))
    _same_quantized(act_out, quantize_rows(silu_and_mul(gate_up), qdtype))
