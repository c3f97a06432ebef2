"""The CUDA path: greedy equal to transformers on the GPU, and the KV pool sized from GPU memory."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import ARCHS, NEEDS_FA4, fa4_on_hopper
from tests.test_greedy_equality import MODES, PROMPT_LENGTHS, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "configs"


def _hf_greedy_on_cuda(model_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls as float32, as pagoda's
    return hf_greedy(model_dir, prompts, new_tokens, device="cuda")


BACKENDS = {  # engine kwargs of each CUDA configuration
    "torch": {"attention_backend": "torch"},
    "triton-eager": {"attention_backend": "triton", "enforce_eager": True},
    "triton-graphs": {"attention_backend": "triton"},
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_architectures_match_transformers_on_cuda(arch, backend, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = _hf_greedy_on_cuda(model_dir, prompts, 64)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for mode, (kwargs, alone) in MODES.items():
        kwargs = {"num_gpu_blocks_override": 256, **BACKENDS[backend], **kwargs}  # small pool: engines share the GPU
        llm = LLM(str(model_dir), dtype="float32", device="cuda", **kwargs)
        outs = (
            [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            if alone
            else llm.generate(prompts, params, use_tqdm=False)
        )
        assert [o.outputs[0].token_ids for o in outs] == expected, f"{arch} on cuda ({backend}): {mode!r} diverges"
        runner = llm.engine.runner
        assert (runner.graphs is not None) == (backend == "triton-graphs")
        # Every prompt step here fits the prompt-step graphs (at most 224 tokens): they ran them all.
        assert (runner.prefill_graphs is not None and runner.prefill_graphs.replays > 0) == (backend == "triton-graphs")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_step_graphs_and_eager_steps_mixed(arch, tiny_model_dir):
    """Graphs only up to 64 tokens: prompts of 3..100 tokens with chunks of up to 96 take both paths
    (and paddings to 16..64), decodes join the prompt steps, and greedy still equals transformers."""
    model_dir = tiny_model_dir(arch)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 100, 33, 5)]
    expected = _hf_greedy_on_cuda(model_dir, prompts, 24)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        num_gpu_blocks_override=256,
        max_prefill_graph_tokens=64,
        max_num_batched_tokens=96,
    )
    graphs = llm.engine.runner.prefill_graphs
    assert graphs.sizes == [16, 32, 48, 64]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    alone = [
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
        for p in prompts
    ]
    assert [o.outputs[0].token_ids for o in alone] == expected
    assert graphs.replays >= 5  # the short prompts alone, at least


def test_dummy_qwen3_bf16_sizes_the_pool_from_gpu_memory():
    gc.collect()  # engines of earlier tests hold GPU memory until collected
    torch.cuda.empty_cache()
    llm = LLM(
        str(CONFIGS / "qwen3-0.6b"),
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        gpu_memory_utilization=0.5,
        max_model_len=4096,
    )
    engine = llm.engine
    free, total = torch.cuda.mem_get_info()
    kv_bytes = engine.runner.kv_cache.num_blocks * engine.runner.kv_cache.bytes_per_block
    assert kv_bytes > 0.2 * total, "half the GPU minus weights and activations should mostly go to the KV cache"
    assert torch.cuda.memory_allocated() < 0.5 * total
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150000, (n,), generator=gen).tolist() for n in (5, 300, 1000, 64)]
    params = [SamplingParams(temperature=t, max_tokens=32, ignore_eos=True, seed=1) for t in (0.0, 0.8, 1.0, 0.0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


_NO_COMPILE_SCRIPT = """
import json, sys, torch
from bench.compiles import count_compiles
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", device="cuda", load_format="dummy", num_gpu_blocks_override=1024,
          max_model_len=2048, max_num_batched_tokens=512, max_prefill_graph_tokens=64,
          enforce_eager=sys.argv[2] == "eager", fa4_prefill_min_tokens=int(sys.argv[3]), kv_cache_dtype=sys.argv[4])
gen = torch.Generator().manual_seed(3)
prompts = [torch.randint(100, 150000, (n,), generator=gen).tolist() for n in (5, 17, 300, 1000, 64, 33, 700, 2)]
params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
with count_compiles() as compiled:
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate([prompts[2]], params, use_tqdm=False)  # alone: a whole prompt of 300 tokens in its step
    llm.generate([prompts[3][:500] + [7] * 37], params, use_tqdm=False)  # a prefix-cache hit: cached context
print(json.dumps({"backend": llm.engine.runner.backend.name, "compiled": dict(compiled)}))
"""


@pytest.mark.parametrize("mode", ["graphs", "eager", "fa4", "fp8"])
def test_no_triton_kernel_compiles_after_start_up(mode):
    """Serving steps of every kind (fresh prompts of odd and even token counts, chunked prompts,
    prompt steps beside decodes, a prefix-cache hit; graph and eager steps, or eager only) compile
    nothing: the start-up did it. Without graphs the decode kernels are the exception: their split
    count is a compile-time constant that follows the batch size, and eager decode meets those
    as it goes (with graphs, the captures compile one per captured size). A fresh process each,
    so that no earlier test compiled a kernel for it; a fixed pool, so that the start-up
    profiling forward (which calls the fresh-prompt kernel too) does not run. With flash-attn-4
    taking prompt chunks of 256+ tokens (`fa4`: the 300-token prompt alone, the 512-token chunks
    of the 1,000-token prompt, after its cached first chunk), its two kernels compile at start-up too.
    `fp8`: graphs over an fp8 KV cache (the store's write-back variant, the fp8 paged kernels)."""
    if mode == "fa4" and not fa4_on_hopper():
        pytest.skip(NEEDS_FA4)
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    args = [
        str(CONFIGS / "qwen3-0.6b"),
        "graphs" if mode in ("fa4", "fp8") else mode,
        "256" if mode == "fa4" else "0",
        "fp8" if mode == "fp8" else "auto",
    ]
    result = subprocess.run(
        [sys.executable, "-c", _NO_COMPILE_SCRIPT, *args], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    compiled = report["compiled"]
    assert report["backend"] == ("triton+fa4" if mode == "fa4" else "triton")
    if mode == "eager":
        compiled = {k: n for k, n in compiled.items() if not k.endswith(("._decode_kernel", "._decode_reduce_kernel"))}
    assert compiled == {}


@pytest.fixture(scope="module")
def json_model_dir(tmp_path_factory):
    """A tiny random Llama with a small byte-level BPE tokenizer (every byte a token, so any JSON can be
    spelled) and an end-of-sequence token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from tests.conftest import TINY

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(['{"name": "Ada", "age": 36, "tags": ["x", "yz"]}', "hello world"] * 50, trainer)
    path = tmp_path_factory.mktemp("json-llama")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    config = LlamaConfig(**{**TINY, "vocab_size": tok.get_vocab_size()}, eos_token_id=tok.token_to_id("<eos>"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_constrained_rows_with_async_scheduling_and_graphs_match_masked_transformers(json_model_dir):
    """JSON-schema rows beside free rows, under async scheduling with the decode graphs (their sampling
    deferred, the next step staged before it): each constrained output equals transformers' greedy
    with the same grammar's mask applied token by token, and each free one transformers' plain greedy."""
    import json

    from transformers import AutoModelForCausalLM

    from engine.sampling_params import Constraint
    from engine.structured import apply_mask

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
    }
    constraint = Constraint("json", json.dumps(schema))
    llm = LLM(str(json_model_dir), dtype="float32", device="cuda", attention_backend="triton", async_scheduling=True)
    assert llm.engine.runner.graphs is not None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 250, (n,), generator=gen).tolist() for n in (5, 12, 30, 7, 18, 3, 25, 9)]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, constraint=constraint)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [constrained if i % 2 == 0 else free for i in range(len(prompts))]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(json_model_dir, dtype=torch.float32).to("cuda").eval()
    grammars = llm.engine.grammars
    compiled = grammars.compile(constraint)
    eos = llm.engine.eos_token_ids
    for prompt, p, out in zip(prompts, params, outs):
        matcher = grammars.matcher(compiled) if p.constraint is not None else None
        ids, expected = list(prompt), []
        for _ in range(40):
            with torch.no_grad():
                logits = model(torch.tensor([ids], device="cuda")).logits[:, -1].float().cpu()
            if matcher is not None:
                apply_mask(logits, grammars.fill([(0, matcher)]))
            token = int(logits.argmax())
            if matcher is not None:
                assert matcher.accept_token(token)
                if token in eos:
                    matcher = None  # the grammar has ended; ignore_eos runs on unconstrained
            expected.append(token)
            ids.append(token)
        assert out == expected
    assert any(token in eos for out in outs[::2] for token in out)  # some grammar ran to its end


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_embeddings_on_cuda_equal_transformers_beside_graph_decodes(arch, tiny_model_dir):
    """Embedding prompts (a one-token one among them, and one long enough for several chunks) pooled on the
    GPU with the decode and prompt-step graphs on, while greedy requests decode beside them: every
    vector equals transformers' last hidden state (last token and mean), and the greedy outputs equal
    transformers' greedy."""
    from engine.pooling_params import PoolingParams
    from tests.test_embeddings import assert_close, hf_hidden

    model_dir = tiny_model_dir(arch)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (1, 7, 40, 150)]
    generating = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (9, 30)]
    torch.backends.cuda.matmul.allow_tf32 = False
    hidden = [h.to("cpu") for h in hf_hidden(model_dir, prompts)]
    expected = _hf_greedy_on_cuda(model_dir, generating, 24)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        num_gpu_blocks_override=256,
        max_num_batched_tokens=64,
    )
    assert llm.engine.runner.graphs is not None and llm.engine.runner.prefill_graphs is not None
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(generating):
        engine.add_request(f"gen-{i}", prompt, greedy)
    for kind in ("last", "mean"):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{kind}-{i}", prompt, PoolingParams(pooling_type=kind, normalize=False))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for i, h in enumerate(hidden):
        assert_close(done[f"last-{i}"].embedding, h[-1])
        assert_close(done[f"mean-{i}"].embedding, h.mean(0))
    assert [done[f"gen-{i}"].outputs[0].token_ids for i in range(len(generating))] == expected
