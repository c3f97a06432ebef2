"""The fp8 KV cache (EngineConfig.kv_cache_dtype): the quantizing store and the dequantizing attention
kernels against the torch reference (Triton under the interpreter on the CPU, at small shapes), and the
engine end to end with the default model: greedy match rate and perplexity against a full-precision
cache, preemption and prefix caching, the server, and the flags.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must be set before triton is imported (the kernels read it when they are defined).
    os.environ["TRITON_INTERPRET"] = "1"

from engine import kv_fp8  # noqa: E402
from engine.attention.torch_ref import store_kv as ref_store_kv  # noqa: E402
from tests.attention_reference import make_batch, reference, verify_case  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (fp8 kernels at full shapes, CUDA graphs)")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# The interpreter of triton 3.9 gets bfloat16 wrong; float32 and float16 run on the CPU, bf16 on CUDA.
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]


def _scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=DEV)


def _quantized_batch(ctx_lens, q_lens, heads, kv_heads, head_dim, dtype, fp8, seed=0):
    """make_batch's random case with its caches stored in fp8 at scales that put the values well inside
    the format, plus the dequantized caches the float32 reference reads."""
    case = make_batch(ctx_lens, q_lens, heads, kv_heads, head_dim, 16, dtype, seed=seed)
    k_scale, v_scale = _scale(0.02), _scale(0.03)
    k8 = kv_fp8.quantize(case["k_cache"], k_scale, fp8)
    v8 = kv_fp8.quantize(case["v_cache"], v_scale, fp8)
    deq = (kv_fp8.dequantize(k8, k_scale, torch.float32), kv_fp8.dequantize(v8, v_scale, torch.float32))
    return case, (k8, v8), (k_scale, v_scale), deq


# ---------------------------------------------------------------- the torch arithmetic


def test_quantize_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -3.5, 1000.0, -1e6])
    scale = torch.tensor([0.5])
    q = kv_fp8.quantize(x, scale, torch.float8_e4m3fn)
    back = kv_fp8.dequantize(q, scale, torch.float32)
    assert torch.equal(back[:3], x[:3])  # exact in e4m3 after / 0.5
    assert back[3] == back[4].neg() == 448 * 0.5  # saturated, never NaN
    s = kv_fp8.amax_scale(torch.tensor([[-896.0, 3.0]]), torch.float8_e4m3fn)
    assert (
        s.item() == 2.0 * kv_fp8.KV_SCALE_HEADROOM and kv_fp8.amax_scale(torch.zeros(3), torch.float8_e4m3fn).item() > 0
    )


# ---------------------------------------------------------------- Triton: the store


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_quantizes_like_the_reference(fp8, dtype):
    """prepare_and_store (norm + rotary + store, fused) into an fp8 cache: the bytes the torch
    reference writes for the same prepared k and v, with saturation at a scale too small for some."""
    from engine.kernels.qkv_store import prepare_and_store
    from engine.layers.norm import RMSNorm
    from engine.layers.rotary import RotaryEmbedding

    t, hq, hk, d, nb, bs = 9, 4, 2, 64, 4, 16
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(DEV, dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    rotary = RotaryEmbedding(d, 256, {"rope_theta": 10000.0, "rope_type": "default"}).to(DEV)
    positions = torch.randint(0, 256, (t,), generator=gen).to(DEV)
    norm_q, norm_k = RMSNorm(d, 1e-6).to(DEV, dtype), RMSNorm(d, 1e-6).to(DEV, dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(DEV)
    # k after its norm reaches about 3: the elements above 2 saturate.
    k_scale, v_scale = _scale(2.0 / torch.finfo(fp8).max), _scale(0.02)
    with torch.no_grad():
        exp_q, exp_k = rotary(positions, norm_q(q.clone()), norm_k(k.clone()))
    caches = [torch.zeros(nb, bs, hk, d, dtype=fp8, device=DEV) for _ in range(2)]
    expected = [c.clone() for c in caches]
    ref_store_kv(exp_k, v, *expected, slots, k_scale, v_scale)
    prepare_and_store(
        q, k, v, *caches, slots, positions, rotary.cos, rotary.sin, norm_q.weight, norm_k.weight, 1e-6,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    # On CUDA the kernel's norm sums in another order than torch's: a rare element lands one fp8 step
    # away. The interpreter's own fp8 cast (triton 3.9 runtime/interpreter.py, _convert_float) rounds
    # ties up and drops the carry when a mantissa rounds up into the exponent (127.75 -> 64 in e4m3),
    # so there a rare element is off by up to a factor of 2; the GPU converts in hardware.
    rtol = 2.0 ** -(2 if fp8 == torch.float8_e5m2 else 3) if CUDA else 0.5
    for out, ref in zip(caches, expected):
        assert not out.float().isnan().any()
        same = (out.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
        assert same > 0.97, same
        torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=rtol)
    assert caches[0].float().abs().max() == torch.finfo(fp8).max  # saturated, not inf/NaN
    torch.testing.assert_close(q.float(), exp_q.float(), atol=2e-3, rtol=2e-3)


def _fused_qkv(t, hq, hk, d, dtype, gen):
    """q [t, hq, d], k and v [t, hk, d] as views of one fused projection output, as the model makes them."""
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(DEV, dtype)
    return tuple(x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_back_the_values_the_cache_holds(fp8, dtype):
    """With write_back the store rewrites k and v in place as dequantize(quantize(x)) of the prepared
    values, element for element the cache's values read back; a negative slot stores nothing in the
    cache but its k and v are still rounded."""
    from engine.kernels.qkv_store import prepare_and_store
    from engine.layers.rotary import RotaryEmbedding

    t, hq, hk, d, nb, bs = 9, 4, 2, 64, 4, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v = _fused_qkv(t, hq, hk, d, dtype, gen)
    rotary = RotaryEmbedding(d, 256, {"rope_theta": 10000.0, "rope_type": "default"}).to(DEV)
    positions = torch.randint(0, 256, (t,), generator=gen).to(DEV)
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(DEV)
    slots[4] = -1
    # k reaches about 9 after rotary: the elements above 4 saturate.
    k_scale, v_scale = _scale(4.0 / torch.finfo(fp8).max), _scale(0.03)
    # The prepared, unrounded k: the same store without write_back (it leaves k prepared in place).
    plain = [x.clone() for x in (q, k, v)]
    scratch = [torch.zeros(nb, bs, hk, d, dtype=fp8, device=DEV) for _ in range(2)]
    prepare_and_store(*plain, *scratch, slots, positions, rotary.cos, rotary.sin, k_scale=k_scale, v_scale=v_scale)
    caches = [torch.zeros(nb, bs, hk, d, dtype=fp8, device=DEV) for _ in range(2)]
    prepare_and_store(
        q, k, v, *caches, slots, positions, rotary.cos, rotary.sin, k_scale=k_scale, v_scale=v_scale, write_back=True
    )
    assert torch.equal(q, plain[0])  # q as without write_back
    kept = slots >= 0
    for x, x_plain, cache, cache_plain, scale in zip((k, v), plain[1:], caches, scratch, (k_scale, v_scale)):
        # The cache holds what it holds without write_back, and k / v are its values read back, exactly.
        assert torch.equal(cache.view(torch.uint8), cache_plain.view(torch.uint8))
        stored = cache.view(-1, hk, d)[slots[kept]]
        assert torch.equal(x[kept], kv_fp8.dequantize(stored, scale, dtype))
        # Against the torch arithmetic on the prepared values, element for element. The kernel divides by
        # the scale with the GPU's approximate division (Triton's `/`: div.full.f32, within 2 ulp), so on
        # CUDA a value next to an fp8 rounding tie may land one step from torch's. The interpreter's fp8
        # cast (see test_store_quantizes_like_the_reference) rounds ties up (a float16 value often lands on
        # one: 0.1875 / (4 / 448) = 21 -> 22 where torch gives 20) and drops the carry when a mantissa
        # rounds up into the exponent (31.7 -> 16 where torch gives 32): exactly half.
        expected = kv_fp8.dequantize(kv_fp8.quantize(x_plain, scale, fp8), scale, dtype)
        same = x == expected
        step = 2.0 ** -(2 if fp8 == torch.float8_e5m2 else 3)
        one_step = (x.float() - expected.float()).abs() <= step * expected.float().abs()
        if CUDA:
            assert one_step.all() and same.float().mean().item() > 0.99
        else:
            assert (same | one_step | (2 * x == expected)).all() and same.float().mean().item() > 0.9
    assert not torch.equal(k, plain[1]) and not torch.equal(v, plain[2])  # rounding changed them
    assert k.float().abs().max().item() == pytest.approx(torch.finfo(fp8).max * k_scale.item())  # saturated
    assert scratch[0].view(-1, hk, d)[slots[~kept]].float().abs().sum() == 0


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.03)])
def test_prefill_fresh_over_written_back_kv_matches_the_paged_fp8_prefill(fp8, dtype, scales):
    """Whole fresh prompts: prefill_fresh over the step's own k/v, rounded back by the store, against the
    paged prefill reading the fp8 cache the same store wrote. At scale 1.0 both see the same values and
    differ only in summation order; at other scales the paged kernel multiplies by the scale in float32
    (folded into the softmax scale and the output) where the written-back k/v were rounded to `dtype`."""
    from engine.kernels.attention import paged_prefill
    from engine.kernels.prefill_fresh import fresh_prefill_fits, prefill_fresh
    from engine.kernels.qkv_store import prepare_and_store
    from engine.layers.rotary import RotaryEmbedding

    lens, hq, hk, d, bs = [5, 70, 17], 4, 2, 64, 16
    case = make_batch([0] * len(lens), lens, hq, hk, d, bs, dtype, seed=7)
    table, query_start, seq_lens = case["block_tables"], case["query_start"], case["seq_lens"]
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(DEV)
    slots = table[seq, positions // bs].long() * bs + positions % bs
    gen = torch.Generator().manual_seed(8)
    q, k, v = _fused_qkv(sum(lens), hq, hk, d, dtype, gen)
    rotary = RotaryEmbedding(d, 256, {"rope_theta": 10000.0, "rope_type": "default"}).to(DEV)
    k_scale, v_scale = _scale(scales[0]), _scale(scales[1])
    k8, v8 = (torch.zeros_like(case["k_cache"], dtype=fp8) for _ in range(2))
    prepare_and_store(
        q, k, v, k8, v8, slots, positions, rotary.cos, rotary.sin, k_scale=k_scale, v_scale=v_scale, write_back=True
    )
    assert fresh_prefill_fits(q, k, v)
    fresh = prefill_fresh(q, k, v, query_start, case["scale"], max(lens))
    paged = paged_prefill(
        q, k8, v8, table, query_start, seq_lens, case["scale"], max(lens), k_scale=k_scale, v_scale=v_scale
    )
    err = ((fresh.float() - paged.float()).abs().max() / paged.float().abs().max()).item()
    # Measured under the interpreter: 0 at scale 1.0 (the same tiles in the same order), 2.4e-6 (float32)
    # and 1.6e-3 (float16) at the other scales; bfloat16 (CUDA) keeps 3 mantissa bits fewer than float16.
    tol = 1e-5 if dtype == torch.float32 else (2e-3 if scales == (1.0, 1.0) else 1e-2)
    assert err < tol * (8 if dtype == torch.bfloat16 else 1), err


# ---------------------------------------------------------------- Triton: attention


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_reads_fp8(fp8, dtype, splits):
    from engine.kernels.decode import paged_decode

    case, (k8, v8), (ks, vs), (kd, vd) = _quantized_batch([40, 7, 70], [1, 1, 1], 4, 2, 64, dtype, fp8, seed=1)
    out = paged_decode(
        case["q"], k8, v8, case["block_tables"], case["seq_lens"], case["scale"], num_splits=splits, k_scale=ks,
        v_scale=vs,
    )  # fmt: skip
    ref = reference(case["q"], kd, vd, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"])
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-4 if dtype == torch.float32 else 1e-2), err
    # The scales are applied: against the unquantized cache the error is the fp8 rounding's, no more.
    full = reference(
        case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["query_start"], case["seq_lens"],
        case["scale"],
    )  # fmt: skip
    assert ((out.float() - full).abs().max() / full.abs().max()).item() < 0.15


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reads_fp8(fp8, dtype):
    from engine.kernels.attention import paged_prefill

    case, (k8, v8), (ks, vs), (kd, vd) = _quantized_batch([0, 20, 33], [17, 5, 1], 4, 1, 32, dtype, fp8, seed=2)
    out = paged_prefill(
        case["q"], k8, v8, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"], 17,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    ref = reference(case["q"], kd, vd, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"])
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-4 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16])
def test_widen_bits_give_every_fp8_value(fp8, target):
    """The bits / asm widening (attention.fp8_widen): every fp8 code with its sign / exponent / mantissa moved
    into the 16-bit lane, times PRESCALE x UNBIAS (what the kernels multiply scores and outputs by), is the
    code's value exactly (zero, subnormals and the largest values included)."""
    from engine.kernels.attention import fp8_widen

    codes = torch.arange(256, dtype=torch.int32)
    values = codes.to(torch.uint8).view(fp8).float()
    finite = values.isfinite()
    w = fp8_widen(fp8, target, "bits", on_gpu=False)
    lane = codes << 8
    bits = (lane & 0x8000) | ((lane >> w.WIDEN_SHIFT) & (0x7F00 >> w.WIDEN_SHIFT))
    widened = bits.to(torch.int16).view(target).float()  # int16 wraps the sign bit into place
    assert torch.equal(widened[finite] * (w.PRESCALE * w.UNBIAS), values[finite])
    # The asm variant is the same bits (GPU only); a float32 q keeps triton's cast.
    assert fp8_widen(fp8, target, "asm", on_gpu=True).WIDEN_SHIFT == w.WIDEN_SHIFT
    assert fp8_widen(fp8, torch.float32, "asm", on_gpu=True).WIDEN == 0


def _tilings(kernel, kind):
    """The shipped tiling of a kernel ("decode", "prefill") for a cache kind and the H100 sweep's candidates,
    as pytest params."""
    from bench.gpu_check import DECODE_TILE_CANDIDATES, PREFILL_TILE_CANDIDATES
    from engine.kernels.attention import PREFILL_TILES, PrefillTiles
    from engine.kernels.decode import DECODE_TILES, DecodeTiles

    shipped, candidates, cls = {
        "decode": (DECODE_TILES, DECODE_TILE_CANDIDATES, DecodeTiles),
        "prefill": (PREFILL_TILES, PREFILL_TILE_CANDIDATES, PrefillTiles),
    }[kernel]
    # Under the interpreter the shipped tilings run in the default tier, the sweep's other candidates in the
    # slow one (the sweep checks each against a reference before timing it anyway); on CUDA all run.
    slow = () if CUDA else pytest.mark.slow
    tilings = sorted({shipped[kind], *(cls(*c) for c in candidates[kind])}, key=str)
    return [pytest.param(t, marks=() if t in shipped.values() else slow, id=str(t)) for t in tilings]


@pytest.mark.parametrize("tiles", _tilings("decode", "fp8"))
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_tilings_read_fp8(tiles, fp8, dtype):
    """Every fp8 decode tiling the table ships or the H100 sweep (bench/gpu_check.py decode-tiles) times, each
    widening (asm runs as bits under the interpreter), against the reference over the dequantized cache; one
    and three splits, a context that ends inside a tile."""
    from engine.kernels.decode import paged_decode

    case, (k8, v8), (ks, vs), (kd, vd) = _quantized_batch([300, 7, 130], [1, 1, 1], 4, 2, 64, dtype, fp8, seed=4)
    ref = reference(case["q"], kd, vd, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"])
    for splits in (1, 3):
        out = paged_decode(
            case["q"], k8, v8, case["block_tables"], case["seq_lens"], case["scale"], num_splits=splits,
            k_scale=ks, v_scale=vs, tiles=tiles,
        )  # fmt: skip
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < (1e-4 if dtype == torch.float32 else 1e-2), (splits, err)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_of_several_queries_a_sequence_reads_fp8(fp8, dtype):
    """A verify step's layout (5 query rows a sequence, some padding; tests/test_kernels_attention.py) over an
    fp8 cache, the shipped tiling's widening, one and three splits, against the reference over the dequantized
    cache."""
    ctx, q_lens = [61, 3, 130], [5, 2, 1]
    case, (k8, v8), (ks, vs), deq = _quantized_batch(ctx, [5] * 3, 4, 2, 64, dtype, fp8, seed=8)
    for splits in (1, 3):
        got, ref, out = verify_case(case, q_lens, splits, k8, v8, deq, k_scale=ks, v_scale=vs)
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < (1e-4 if dtype == torch.float32 else 1e-2), (splits, err)
        assert out.isfinite().all()


@pytest.mark.parametrize("tiles", _tilings("decode", "16bit"))
def test_decode_tilings_read_a_16bit_cache(tiles):
    """The 16-bit tilings the sweep times, against the reference."""
    from engine.kernels.decode import paged_decode

    dtype = DTYPES[-1]
    case = make_batch([300, 7, 130], [1, 1, 1], 4, 2, 64, 16, dtype, seed=5)
    ref = reference(
        case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["query_start"], case["seq_lens"],
        case["scale"],
    )  # fmt: skip
    out = paged_decode(
        case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], case["scale"],
        num_splits=3, tiles=tiles,
    )  # fmt: skip
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("tiles", _tilings("prefill", "fp8") + _tilings("prefill", "16bit"))
@pytest.mark.parametrize("fp8", FP8)
def test_prefill_tilings_read_fp8(tiles, fp8):
    """Every paged-prefill tiling shipped or swept, over an fp8 cache (each widening; asm as bits under the
    interpreter), against the reference over the dequantized cache: a prompt with nothing cached, a chunk
    after context, a one-token row."""
    from engine.kernels.attention import paged_prefill

    dtype = DTYPES[-1]
    case, (k8, v8), (ks, vs), (kd, vd) = _quantized_batch([0, 150, 33], [70, 5, 1], 4, 1, 64, dtype, fp8, seed=6)
    out = paged_prefill(
        case["q"], k8, v8, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"], 70,
        k_scale=ks, v_scale=vs, tiles=tiles,
    )  # fmt: skip
    ref = reference(case["q"], kd, vd, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"])
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_widenings_agree(fp8, dtype):
    """Widening by bits / asm scales K, V, q and the softmax weights by powers of two that the scales undo,
    so decode and prefill give cast's output: bit for bit under the interpreter (float32 products of
    16-bit values are exact, the sums run in the same order); on CUDA within 1e-3, for an MMA that may
    flush the subnormal 16-bit lanes fp8 subnormals become."""
    from engine.kernels.attention import PrefillTiles, paged_prefill
    from engine.kernels.decode import DecodeTiles, paged_decode

    case, (k8, v8), (ks, vs), (kd, vd) = _quantized_batch([300, 7, 130], [1, 1, 1], 4, 2, 64, dtype, fp8, seed=7)
    args = (case["q"], k8, v8, case["block_tables"])
    outs = {}
    for widen in ("cast", "bits", "asm", "f16", "words"):
        decode = paged_decode(*args, case["seq_lens"], case["scale"], num_splits=3, k_scale=ks, v_scale=vs,
                              tiles=DecodeTiles(128, widen=widen))  # fmt: skip
        prefill = paged_prefill(*args, case["query_start"], case["seq_lens"], case["scale"], 1, k_scale=ks, v_scale=vs,
                                tiles=PrefillTiles(widen=widen))  # fmt: skip
        outs[widen] = torch.stack([decode, prefill]).float()
    for widen in ("bits", "asm"):
        diff = ((outs[widen] - outs["cast"]).abs().max() / outs["cast"].abs().max()).item()
        assert diff == 0.0 or (CUDA and diff < 1e-3), (widen, diff)
    # f16 rounds q and the softmax weights to float16 instead of q's dtype: not cast's bits, but as close to
    # the float32 attention over the same fp8 cache (closer for bf16, whose mantissa is shorter).
    ref = reference(case["q"], kd, vd, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"])
    # words is f16 with K and V read as 32-bit words: f16's arithmetic, so its outputs.
    errs = {w: ((outs[w][0] - ref).abs().max() / ref.abs().max()).item() for w in ("cast", "f16")}
    if dtype == torch.float32:  # no 16-bit lane to fill: all of them are cast
        for widen in ("f16", "words"):
            assert torch.equal(outs[widen], outs["cast"]), widen
    else:
        assert errs["f16"] <= errs["cast"] * 1.5 + 1e-4, errs
        diff = ((outs["words"] - outs["f16"]).abs().max() / outs["f16"].abs().max()).item()
        assert diff == 0.0 or (CUDA and diff < 1e-3), diff


def test_kernels_refuse_fp8_without_scales():
    from engine.kernels.decode import paged_decode

    case, (k8, v8), _, _ = _quantized_batch([8], [1], 2, 1, 32, DTYPES[0], FP8[0])
    with pytest.raises(AssertionError, match="needs k_scale and v_scale"):
        paged_decode(case["q"], k8, v8, case["block_tables"], case["seq_lens"], case["scale"])


# ---------------------------------------------------------------- the engine, the model, the server

# Prompts of the greedy comparison: the default model's own chat, a fixed set.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci.",
    "Give me a synonym for 'happy'.",
    "What is the boiling point of water in Celsius?",
]
GREEDY_TOKENS = 32


def _llm(model_dir, **kwargs):
    from engine import LLM

    kwargs.setdefault("cpu_kv_cache_bytes", 64 << 20)
    kwargs.setdefault("max_model_len", 512)
    return LLM(str(model_dir), dtype="float32", device="cpu", **kwargs)


def _greedy(llm, prompts, tokens=GREEDY_TOKENS, ignore_eos=False):
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=ignore_eos)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _chat(llm, prompt: str) -> str:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])


@pytest.fixture(scope="module")
def fp32_and_fp8_outputs(default_model_dir):
    """Greedy outputs of the default model on PROMPTS with a float32 cache and an fp8 (e4m3) one."""
    out = {}
    for kv in ("auto", "fp8"):
        llm = _llm(default_model_dir, kv_cache_dtype=kv)
        out[kv] = (_greedy(llm, [_chat(llm, p) for p in PROMPTS]), llm)
    return out


def test_fp8_cache_holds_about_twice_the_tokens(fp32_and_fp8_outputs):
    """Same byte budget: a float32 cache against an e4m3 one is 4x; the pool sizes follow bytes per element."""
    (_, auto), (_, fp8) = fp32_and_fp8_outputs["auto"], fp32_and_fp8_outputs["fp8"]
    assert auto.engine.runner.kv_cache.dtype == torch.float32
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.block_manager.num_blocks == 4 * auto.engine.block_manager.num_blocks
    assert fp8.engine.runner.backend.name.startswith("cpu")  # the C kernels still do norms, rotary, SwiGLU


def test_greedy_generation_matches_the_full_precision_cache(fp32_and_fp8_outputs):
    """Greedy tokens with an fp8 (e4m3, scale 1.0) cache against a float32 one on a fixed prompt set.
    Measured on the CPU (SmolLM2-135M, 32 tokens): 2 of 8 prompts give the same tokens throughout, 7 of
    8 the same first token, the others part after 2..18 tokens (e4m3 keeps 3 mantissa bits, and this
    small model's greedy choice often sits on a near tie); the text stays on topic and the answer to the
    first is still "The capital of France is Paris." The floors below are those measurements."""
    auto, fp8 = fp32_and_fp8_outputs["auto"][0], fp32_and_fp8_outputs["fp8"][0]
    same = sum(a.token_ids == b.token_ids for a, b in zip(auto, fp8))
    first = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(auto, fp8))
    print(f"fp8 KV greedy match: {same}/{len(PROMPTS)} prompts whole, {first}/{len(PROMPTS)} first tokens")
    assert same >= 2 and first >= 7
    assert fp8[0].text == "The capital of France is Paris."
    assert all(len(o.token_ids) >= 8 and o.text.isascii() for o in fp8)


def test_perplexity_within_one_percent_of_the_full_precision_cache(default_model_dir):
    """bench/fp8kv_ppl.py's measurement as WRITEUP.md gives it: 2,048 tokens of held-out text in 4 windows,
    the fp8 cache read by every chunk after a window's first (+0.78% with torch's AVX2 kernels, +0.80% with
    its AVX-512 ones). One 512-token window is too small a sample for a 1% bound: it read +0.95% and +1.36%
    with the same two."""
    from bench.fp8kv_ppl import make_llm, perplexity, text_windows

    windows = text_windows(str(default_model_dir), 2048, 512)
    ppl = {kv: perplexity(make_llm(str(default_model_dir), kv, False, 512), windows, 64) for kv in ("auto", "fp8")}
    print(f"perplexity: {ppl}")
    assert ppl["auto"] < 100  # the model reads the text: a broken cache gives thousands
    assert abs(ppl["fp8"] / ppl["auto"] - 1) < 0.01, ppl


def test_preemption_and_prefix_caching_do_not_change_fp8_outputs(tiny_model_dir):
    """With an fp8 cache, greedy tokens are the same with a big pool, with preemption by recompute and by
    swap, with chunked prefill, and with prefix-cache hits (every prompt token reads the same rounded K/V),
    and on the torch reference backend as on the cpu one."""
    from tests.conftest import ARCHS

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 100)]
    prompts.append(prompts[4][:96] + [5, 6, 7])  # shares six full blocks with the one before
    for arch in ARCHS[:1] + ARCHS[3:]:  # llama, qwen3 (q/k norms)
        model_dir = tiny_model_dir(arch)

        def fp8_llm(model_dir=model_dir, **kwargs):
            return _llm(model_dir, kv_cache_dtype="fp8", **{"max_model_len": 192, **kwargs})

        base = [o.token_ids for o in _greedy(fp8_llm(), prompts, 48, True)]
        modes = {
            "recompute": dict(num_gpu_blocks_override=12),
            "swap": dict(num_gpu_blocks_override=12, preemption_mode="swap", swap_space=0.01),
            "chunked": dict(max_num_batched_tokens=32),
            "no prefix caching": dict(enable_prefix_caching=False),
            "torch backend": dict(attention_backend="torch"),  # the reference; the others run CpuFp8Backend
        }
        for mode, kwargs in modes.items():
            llm = fp8_llm(**kwargs)
            got = [o.token_ids for o in _greedy(llm, prompts, 48, True)]
            assert got == base, f"{arch}: {mode} changes the fp8-cache output"
            if mode in ("recompute", "swap"):
                assert llm.engine.scheduler.num_preemptions[mode] > 0, "the tiny pool should have forced preemption"
        # Prefix caching: the same prompts again hit the blocks the first run left.
        llm = fp8_llm()
        _greedy(llm, prompts, 48, True)
        before = llm.engine.block_manager.prefix_hit_tokens
        assert [o.token_ids for o in _greedy(llm, prompts, 48, True)] == base, f"{arch}: prefix hits change it"
        assert llm.engine.block_manager.prefix_hit_tokens - before >= 96 + 64 + 32


def test_triton_fp8_whole_chunked_cached_and_preempted_prompts_agree(tiny_model_dir):
    """The Triton backend over an fp8 cache (the interpreter on the CPU): whole fresh prompts attend through
    prefill_fresh to the k/v the store rounded back, chunks and prefix hits through the paged prefill over
    the cache, and recomputed prompts after preemption through either; all give the same greedy tokens,
    and logprobs that differ by summation order only: measured up to 1e-6, and 6.7e-2 when whole prompts
    attend to unrounded k/v (the store without its write-back)."""
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (3, 21, 40)]
    prompts.append(prompts[2][:36] + [7, 8])  # shares two full blocks with the previous prompt
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    modes = {
        "batch": {"num_gpu_blocks_override": 64},
        "chunked": {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 64},
        "preempt": {"num_gpu_blocks_override": 7, "max_model_len": 64},
    }
    outs, logprobs = {}, {}
    for mode, kwargs in modes.items():
        llm = LLM(
            str(tiny_model_dir("qwen3")), dtype="float32", device=DEV, attention_backend="triton",
            kv_cache_dtype="fp8", **kwargs,
        )  # fmt: skip
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        outs[mode] = [o.token_ids for o in outputs]
        logprobs[mode] = torch.tensor([[t.logprob for t in o.logprobs] for o in outputs])
        if mode == "preempt":
            assert llm.engine.scheduler.num_preemptions["recompute"] > 0
        if mode == "batch":
            # Alone again: its first two blocks come from the prefix cache (the paged prefill this time).
            hits = llm.engine.block_manager.prefix_hit_tokens
            again = llm.generate([prompts[3]], params, use_tqdm=False)[0].outputs[0].token_ids
            assert llm.engine.block_manager.prefix_hit_tokens - hits == 32 and again == outs["batch"][3]
    assert outs["chunked"] == outs["batch"] and outs["preempt"] == outs["batch"]
    for mode in ("chunked", "preempt"):
        diff = (logprobs[mode] - logprobs["batch"]).abs().max().item()
        print(f"fp8 triton {mode}: logprobs differ from whole prompts' by up to {diff:.2e}")
        assert diff < 1e-4, (mode, diff)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_calculated_scales_are_set_by_the_first_prompt_then_kept(tiny_model_dir, backend):
    from engine import SamplingParams

    kw = dict(kv_cache_dtype="fp8", max_model_len=192, attention_backend=backend)
    llm = _llm(tiny_model_dir("qwen3"), calculate_kv_scales=True, **kw)
    layers = llm.engine.runner.model.attention_layers()
    assert all(a.k_scale.item() == 1.0 and a.calibrate_kv_scales for a in layers)
    prompt = [[5, 9, 200, 31, 7, 8, 100, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    scales = [(a.k_scale.item(), a.v_scale.item()) for a in layers]
    assert all(0 < s != 1.0 for pair in scales for s in pair) and not any(a.calibrate_kv_scales for a in layers)
    _greedy(llm, [[300, 301, 302, 303] * 10], 8, True)
    assert scales == [(a.k_scale.item(), a.v_scale.item()) for a in layers]  # frozen
    # The scale maps the first prompt's largest |k| (after its norm and rotary) onto the fp8 maximum: a
    # rerun of that prompt through a fresh engine with these scales gives the same tokens and logprobs
    # (the calibrating step attends to its k/v rounded once, with the new scales, as the rerun does).
    again = _llm(tiny_model_dir("qwen3"), **kw)
    for a, (ks, vs) in zip(again.engine.runner.model.attention_layers(), scales):
        a.k_scale.fill_(ks)
        a.v_scale.fill_(vs)
    rerun = again.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert rerun.token_ids == first.token_ids
    assert [t.logprob for t in rerun.logprobs] == [t.logprob for t in first.logprobs]


def test_checkpoint_kv_scales_load(tiny_model_dir, tmp_path):
    """A compressed-tensors checkpoint's kv_cache_scheme (fp8, per tensor): self_attn.k_scale / v_scale
    load into the attention layers; another KV scheme is refused by name."""
    import json
    import shutil

    from safetensors.torch import save_file

    from engine.quant import UnsupportedQuantization
    from engine.quant.compressed_tensors import from_config

    src = tiny_model_dir("llama")
    model_dir = tmp_path / "llama-kv-scales"
    shutil.copytree(src, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    scales = {}
    for i in range(config["num_hidden_layers"]):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02 * (i + 1)])
    save_file(scales, model_dir / "kv_scales.safetensors")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "kv_scales.safetensors" for name in scales})
        index.write_text(json.dumps(data))
    llm = _llm(model_dir, kv_cache_dtype="fp8", max_model_len=192)
    for i, a in enumerate(llm.engine.runner.model.attention_layers()):
        assert a.k_scale.item() == pytest.approx(0.01 * (i + 1)) and a.v_scale.item() == pytest.approx(0.02 * (i + 1))
    assert len(_greedy(llm, [[1, 2, 3, 4]], 4, True)[0].token_ids) == 4

    group = {"weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
             "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True,
                                   "symmetric": True}, "targets": ["Linear"]}  # fmt: skip
    qc = {"config_groups": {"group_0": group}, "format": "float-quantized"}
    from_config({**qc, "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor"}})
    with pytest.raises(UnsupportedQuantization, match="KV cache int8"):
        from_config({**qc, "kv_cache_scheme": {"type": "int", "num_bits": 8, "strategy": "tensor"}})


def test_bad_kv_cache_settings_are_refused_in_one_line(capsys):
    from engine.attention import select_backend
    from engine.config import EngineConfig
    from server.cli import build_parser

    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--kv-cache-dtype" in err[-1] and "int4" in err[-1]
    with pytest.raises(ValueError, match="^kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2; got 'fp4'$"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="^calculate_kv_scales needs an fp8 kv_cache_dtype"):
        EngineConfig(calculate_kv_scales=True)
    with pytest.raises(ValueError, match="^attention_backend flash_attn does not read an fp8 KV cache"):
        select_backend("flash_attn", torch.device("cpu"), torch.float32, 16, kv_cache_dtype=torch.float8_e4m3fn)


def test_server_serves_an_fp8_cache(tmp_path):
    """`pagoda serve --kv-cache-dtype fp8` answers the openai SDK, and /metrics shows the cache's dtype
    and size in tokens."""
    from openai import OpenAI

    from tests.test_server import scrape, start_server

    srv = start_server(
        tmp_path, "--kv-cache-dtype", "fp8", "--max-model-len", "1024", "--num-gpu-blocks-override", "64"
    )
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="x")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in chat.choices[0].message.content
        (labels,) = [dict(labels) for name, labels in scrape(srv.url) if name == "pagoda:cache_config_info"]
        assert labels["cache_dtype"] == "float8_e4m3fn" and labels["kv_cache_size_tokens"] == str(64 * 16)
        assert "float8_e4m3fn cache" in srv.log()
    finally:
        assert srv.stop() == 0


# ---------------------------------------------------------------- CUDA only (the lead runs these)


@needs_cuda
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_kernels_at_full_shapes(fp8):
    """bf16 decode (Llama-3-8B heads: 32 q / 8 kv, D 128) and prefill over an fp8 cache against the
    float32 reference of the dequantized cache."""
    from engine.kernels.attention import paged_prefill
    from engine.kernels.decode import paged_decode

    case, (k8, v8), (ks, vs), (kd, vd) = _quantized_batch(
        [4000, 1, 900, 2047], [1, 1, 1, 1], 32, 8, 128, torch.bfloat16, fp8, seed=4
    )
    out = paged_decode(case["q"], k8, v8, case["block_tables"], case["seq_lens"], case["scale"], k_scale=ks, v_scale=vs)
    ref = reference(case["q"], kd, vd, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"])
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    case, (k8, v8), (ks, vs), (kd, vd) = _quantized_batch(
        [0, 300, 1000], [700, 64, 1], 32, 8, 128, torch.bfloat16, fp8, seed=5
    )
    out = paged_prefill(
        case["q"], k8, v8, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"], 700,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    ref = reference(case["q"], kd, vd, case["block_tables"], case["query_start"], case["seq_lens"], case["scale"])
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


@needs_cuda
def test_cuda_graphs_read_scales_calculated_after_capture(tiny_model_dir):
    """Decode graphs are captured at start-up, before --calculate-kv-scales sets the scales: the graphs
    read the scale tensors, so graph replay gives the eager engine's tokens."""
    from engine import LLM, SamplingParams

    prompts = [[5, 9, 200, 31, 7, 8, 100, 3], list(range(40, 90))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(
            str(tiny_model_dir("llama")), dtype="bfloat16", device="cuda", num_gpu_blocks_override=256,
            kv_cache_dtype="fp8", calculate_kv_scales=True, enforce_eager=eager,
        )  # fmt: skip
        assert (llm.engine.runner.graphs is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert all(a.k_scale.item() != 1.0 for a in llm.engine.runner.model.attention_layers())
    assert outs[False] == outs[True]


@needs_cuda
def test_cuda_triton_fp8_engine_matches_the_torch_reference(tiny_model_dir):
    """The Triton fp8 path end to end (fused quantizing store, paged prefill and split-KV decode over fp8,
    CUDA graphs) against the torch backend over the same fp8 cache: float32 model, scale 1.0 (division
    exact), both casting with round-to-nearest-even, so the greedy tokens agree. Whole prompts take
    prefill_fresh over the k/v the store rounded back; with chunked prefill (32-token steps) they take the
    paged prefill over the cache instead, and give the same tokens. (Under the CPU interpreter the Triton
    cast rounds differently: see test_store_quantizes_like_the_reference.)"""
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (3, 21, 40, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for name, backend, kwargs in (
        ("torch", "torch", {}),
        ("triton", "triton", {}),
        ("triton chunked", "triton", dict(max_num_batched_tokens=32)),
    ):
        llm = LLM(
            str(tiny_model_dir("qwen3")), dtype="float32", device="cuda", num_gpu_blocks_override=64,
            kv_cache_dtype="fp8", attention_backend=backend, max_model_len=192, **kwargs,
        )  # fmt: skip
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]
    assert outs["triton chunked"] == outs["triton"]
