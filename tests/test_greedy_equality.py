"""Greedy tokens equal Hugging Face transformers', token for token, in every scheduling mode."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import ARCHS, KV_BYTES

NEW_TOKENS = 64
PROMPT_LENGTHS = [3, 17, 40, 64, 100]


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int, device: str = "cpu") -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    # Like pagoda's ignore_eos: EOS neither stops nor is suppressed.
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


MODES = {
    # (engine kwargs, run prompts one at a time)
    "alone": ({}, True),
    "batch": ({}, False),
    "chunked": ({"max_num_batched_tokens": 32}, False),
    "preempt": ({"num_gpu_blocks_override": 12, "max_model_len": 192}, False),
    "swap": (
        {"num_gpu_blocks_override": 12, "max_model_len": 192, "preemption_mode": "swap", "swap_space": 0.01},
        False,
    ),
    # Step N+1 scheduled while step N runs: chunked prefill and preemption with tokens in flight.
    "async": (
        {"async_scheduling": True, "max_num_batched_tokens": 32, "num_gpu_blocks_override": 12, "max_model_len": 192},
        False,
    ),
}


def pagoda_greedy(model_dir, prompts, new_tokens, kwargs: dict, alone: bool) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    if alone:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_architectures_match_transformers(arch, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    for mode, (kwargs, alone) in MODES.items():
        got, llm = pagoda_greedy(model_dir, prompts, NEW_TOKENS, kwargs, alone)
        assert got == expected, f"{arch}: mode {mode!r} diverges from transformers"
        if mode in ("preempt", "swap"):
            kind = "swap" if mode == "swap" else "recompute"
            assert llm.engine.scheduler.num_preemptions[kind] > 0, "the tiny pool should have forced preemption"
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


# Without a GPU every kernel runs in Triton's interpreter: about 90 s an architecture, the slow tier's.
# On a GPU the test is quick and stays in the default tier (bench/gpu_check.sh selects it there).
slow_when_interpreted = pytest.mark.slow if not torch.cuda.is_available() else (lambda test: test)


@slow_when_interpreted
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_transformers(arch, tiny_model_dir):
    """The Triton kernels (attention, KV store, RMSNorm, rotary, SwiGLU) give transformers' greedy
    tokens: decode, mixed prefill, chunked prefill over cached context, prefix hits, preemption.
    Without a GPU they run in Triton's interpreter, hence the small sizes."""
    pytest.importorskip("triton")
    model_dir = tiny_model_dir(arch)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (3, 21, 40)]
    prompts.append(prompts[2][:36] + [7, 8])  # shares two full blocks with the previous prompt
    expected = hf_greedy(model_dir, prompts, 12)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A fixed pool: sizing from free GPU memory would see the other tests' engines.
    modes = {
        "batch": {"num_gpu_blocks_override": 64},
        "chunked": {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 64},
        "preempt": {"num_gpu_blocks_override": 7, "max_model_len": 64},
    }
    for mode, kwargs in modes.items():
        llm = LLM(str(model_dir), dtype="float32", device=device, attention_backend="triton", **kwargs)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, f"{arch}: triton backend, mode {mode!r} diverges from transformers"
        if mode == "preempt":
            assert llm.engine.scheduler.num_preemptions["recompute"] > 0
        else:
            assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        if mode == "batch":
            # Again, alone: its first two blocks come from the prefix cache, so this prompt step
            # has cached context (the paged kernel) where the first had none (prefill_fresh).
            hits = llm.engine.block_manager.prefix_hit_tokens
            again = llm.generate([prompts[3]], params, use_tqdm=False)[0].outputs[0].token_ids
            assert llm.engine.block_manager.prefix_hit_tokens - hits == 32 and again == expected[3]


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, as if to a child who asks many questions.",
    "List three prime numbers and then count backwards from ten to one, spelling each number out in words, please.",
]


@pytest.fixture(scope="module")
def default_model_expected(default_model_dir):
    """The chat prompts and transformers' greedy tokens for them, computed once for every mode."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    expected = hf_greedy(default_model_dir, prompts, NEW_TOKENS)
    return prompts, expected


# The real model under preemption (recompute, swap, and with tokens in flight) is the slow tier's:
# about 10 s a mode on two cores. The tiny architectures above run every mode in the default tier.
SLOW_DEFAULT_MODEL_MODES = ("preempt", "swap", "async")


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_DEFAULT_MODEL_MODES else m for m in MODES]
)
def test_default_model_matches_transformers(default_model_dir, default_model_expected, mode):
    prompts, expected = default_model_expected
    kwargs, alone = MODES[mode]
    if mode in ("preempt", "swap"):  # the chat prompts are longer: a pool of 256 tokens still preempts
        kwargs = {**kwargs, "num_gpu_blocks_override": 16, "max_model_len": 256}
    got, llm = pagoda_greedy(default_model_dir, prompts, NEW_TOKENS, kwargs, alone)
    assert got == expected, f"default model: mode {mode!r} diverges from transformers"
    if mode in ("preempt", "swap"):
        assert llm.engine.scheduler.num_preemptions["swap" if mode == "swap" else "recompute"] > 0


def test_default_model_answers_paris():
    llm = LLM(dtype="float32", device="cpu")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text.startswith("The capital of France is Paris.")
    assert out.outputs[0].finish_reason in ("stop", "length")
