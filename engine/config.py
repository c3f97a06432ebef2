"""EngineConfig: every engine knob, with its default and what `pagoda serve --help` says about it.

Each field's metadata holds its help text and, where they apply, its choices and how the command line
takes it; server/cli.py generates the flags (and README.md's flag table) from them:

    help          what the knob does (required)
    choices       the values it takes
    min           the smallest value the flag accepts (checked when the command line is parsed)
    default_help  how --help tells the default when its value alone says too little (e.g. None)
    flags         the flag's spellings, the first the one --help lists first (default: --field-name)
    off_flags     for a bool off by default, the spellings that turn it off again
    parse         a function from the flag's text to the value (raising argparse.ArgumentTypeError with one
                  clear line), for values given as JSON (as vLLM takes them)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from typing import Any

from engine.pooling_params import POOLING_TYPES

# No torch here: `pagoda --help` builds its flags from this module and should not wait for torch to load.

# The dtype names taken, and the torch dtype each stands for.
DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
# The attention backends (engine/attention); `auto` picks one for the device.
BACKENDS = ("torch", "triton", "flash_attn", "cpu")
# The quantization schemes --quantization names, spelled as vllm serve spells them (engine/quant).
QUANTIZATIONS = ("gptq", "awq", "compressed-tensors", "fp8", "int8")
# --kv-cache-dtype, spelled as vllm serve spells it, and the torch dtype of the cache (auto: the model's).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def knob(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its help text and flag metadata (see the module's docstring)."""
    return field(default=default, metadata={"help": help, **metadata})


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config, in vLLM's spelling: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}` or `{"model": PATH, "num_speculative_tokens": k}`
    (a draft model; "method": "draft_model" may be given too). Validated on construction."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix matched; default the other bound, or 5
    prompt_lookup_max: int | None = None  # ngram: the longest suffix matched; default the other bound, or 5
    model: str | None = None  # draft_model: the draft's HF directory
    # No drafts in a step whose decoding sequences are more than this many: a big batch is compute-bound
    # already, and its verify forward (k + 1 tokens a sequence) costs about k + 1 decode steps.
    disable_by_batch_size: int = 16

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
        """From the JSON text of the flag, or a dict (LLM(speculative_config={...})); raises ValueError with one
        line that says what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        value = dict(value)
        if "method" not in value:
            if value.get("model") is None:
                raise ValueError('speculative_config needs a "method" (ngram or draft_model) or a draft "model"')
            value["method"] = "draft_model"
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (the draft tokens per step, k >= 1)")
        return cls(**value)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config: {message}")

        check(self.method in SPEC_METHODS, f"unknown method {self.method!r}; pagoda has {', '.join(SPEC_METHODS)}")
        k = self.num_speculative_tokens
        check(type(k) is int and k >= 1, f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        check(
            type(self.disable_by_batch_size) is int and self.disable_by_batch_size >= 1,
            f"disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}",
        )
        if self.method == "ngram":
            check(self.model is None, 'the ngram method takes no "model"; a draft model is method draft_model')
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: a bound not given equals the other one, and both are 5 when neither is given.
            low, high = (low if low is not None else high or 5), (high if high is not None else low or 5)
            for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                check(type(n) is int and n >= 1, f"{name} must be an integer >= 1, got {n!r}")
            check(low <= high, f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            check(
                isinstance(self.model, str) and self.model != "", 'method draft_model needs the draft "model" (a path)'
            )
            check(
                self.prompt_lookup_min is None and self.prompt_lookup_max is None,
                "prompt_lookup_min/max are for the ngram method",
            )


def _speculative_flag(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class EngineConfig:
    model: str | None = knob(
        None,
        "a Hugging Face model directory (config.json, *.safetensors, tokenizer); pagoda serve also takes the id of "
        "a model in the local Hugging Face cache",
        default_help="the embedded default, SmolLM2-135M-Instruct",
    )
    tokenizer: str | None = knob(
        None,
        "a tokenizer directory (or the id of one in the local Hugging Face cache) to use instead of the model's",
        metavar="TOKENIZER",
        default_help="the model's",
    )
    revision: str | None = knob(
        None,
        "for a model id: the branch, tag or commit of it to take from the local Hugging Face cache",
        default_help="main",
    )
    download_dir: str | None = knob(
        None,
        "for a model or tokenizer id: the Hugging Face cache directory to find it in (pagoda downloads nothing)",
        metavar="DIR",
        default_help="the Hugging Face default, $HF_HUB_CACHE",
    )
    trust_remote_code: bool = knob(
        False,
        "taken for vLLM's command lines and changes nothing: pagoda never runs code from a model repository, it "
        "reads only config.json, weights and tokenizer files, so a model whose architecture pagoda lacks is "
        "refused with or without it",
    )
    tensor_parallel_size: int = knob(
        1,
        "GPUs to shard the model over; pagoda serves a model on one GPU, so only 1 is taken",
        min=1,
        metavar="N",
        flags=("--tensor-parallel-size", "-tp"),
    )
    dtype: str = knob(
        "auto",
        "weight and activation dtype; auto: bfloat16 on CUDA, float32 on the CPU",
        choices=("auto", *DTYPES),
    )
    device: str = knob("auto", "cpu, cuda, cuda:N, or auto: cuda if available")
    load_format: str = knob(
        "auto",
        "auto: the safetensors files; dummy: random weights of the model's architecture (config.json), for benchmarks "
        "(rounded as its quantization_config or --quantization says)",
        choices=("auto", "safetensors", "dummy"),
    )
    quantization: str | None = knob(
        None,
        "the checkpoint's quantization (gptq, awq, compressed-tensors: read from its quantization_config, so this "
        "only confirms it), or fp8 (E4M3 weights with per-channel scales, activations quantized per token) or int8 "
        "(weight-only, per-channel) made at load from a full-precision checkpoint",
        choices=QUANTIZATIONS,
        flags=("--quantization", "-q"),
        default_help="the checkpoint's own, else none",
    )
    quant_fragment_copies: bool = knob(
        True,
        "4-bit weight-only models on CUDA: keep a second copy of each weight in the layout the tensor-core decode "
        "kernel's tiles read at 3-64 rows, for the shapes its tile table names (Llama-3-8B W4A16: 3.5 GB more, "
        "decode steps of 16 sequences 20% faster on an H200); --no-quant-fragment-copies leaves that memory to "
        "the KV cache, the kernel then reading the packed weight",
    )
    seed: int = knob(0, "seeds dummy weights and the sampling of requests that give no seed")
    max_num_seqs: int = knob(256, "sequences decoded together, at most", min=1)
    max_num_batched_tokens: int = knob(
        8192, "tokens computed per engine step, at most: prefill chunks + decodes", min=1
    )
    block_size: int = knob(16, "tokens per KV-cache block, a power of 2", min=1)
    gpu_memory_utilization: float = knob(0.9, "fraction of GPU memory for weights, activations and the KV cache")
    cpu_kv_cache_bytes: int = knob(2 << 30, "on the CPU, the KV cache's byte budget", min=1, default_help="2 GiB")
    num_gpu_blocks_override: int | None = knob(
        None,
        "fix the number of KV-cache blocks instead of sizing the pool from memory (tests, experiments)",
        min=1,
        default_help="sized from memory",
    )
    max_model_len: int | None = knob(
        None, "context length: prompt + output tokens", min=1, default_help="the model's max_position_embeddings"
    )
    enable_chunked_prefill: bool = knob(True, "split long prompts across steps so decodes keep going")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of prompt prefixes seen before")
    preemption_mode: str = knob(
        "recompute",
        "when KV blocks run out, drop a sequence's blocks and recompute them later, or swap them to CPU memory "
        "(--swap-space)",
        choices=("recompute", "swap"),
    )
    queue_timeout: float | None = knob(
        None,
        "seconds a request may wait to be scheduled; beyond it, it finishes with finish_reason 'timeout', which "
        "the server answers 503",
        default_help="no limit",
    )
    kv_cache_dtype: str = knob(
        "auto",
        "the KV cache's storage: auto (the model's dtype) or fp8 / fp8_e4m3 (E4M3) / fp8_e5m2 (E5M2), one byte an "
        "element, so the pool holds about twice the tokens; K and V are divided by a per-layer scale (1.0, the "
        "checkpoint's kv_cache_scheme scales, or --calculate-kv-scales) when stored and multiplied back inside the "
        "attention kernels. Backends: triton and torch; cpu keeps its C kernels for norms and rotary but attends "
        "through torch (the C attention kernel reads no fp8); flash_attn is refused",
        choices=tuple(KV_CACHE_DTYPES),
    )
    calculate_kv_scales: bool = knob(
        False,
        "with an fp8 KV cache: compute each layer's K and V scales from the first prompt step (amax / (the fp8 "
        "maximum / 4), leaving headroom for larger later values) and keep them from then on, instead of 1.0 or "
        "the checkpoint's",
    )
    swap_space: float = knob(4.0, "GiB of CPU memory for swapped-out KV blocks, with --preemption-mode swap")
    attention_backend: str = knob(
        "auto",
        "attention kernels: triton (pagoda's own; auto's choice on CUDA), flash_attn (the flash-attn package or "
        "vLLM's build of it, when installed), cpu (pagoda's C kernels, compiled with the system cc on first use and "
        "cached in $PAGODA_CACHE/kernels; auto's choice on the CPU, which falls back to torch where no compiler "
        "works), torch (plain PyTorch, the reference)",
        choices=("auto", *BACKENDS),
    )
    enforce_eager: bool = knob(False, "never replay CUDA graphs (slower; for debugging)")
    max_graph_batch_size: int = knob(512, "decode batches up to this size replay a captured CUDA graph", min=1)
    max_prefill_graph_tokens: int = knob(
        1024,
        "steps with prompt tokens, up to this many tokens in all, replay a whole-step CUDA graph (triton backend; "
        "0: never)",
    )
    fa4_prefill_min_tokens: int = knob(
        2048,
        "with the triton backend on a Hopper GPU where flash-attn-4 is installed (pip install -e '.[fa4]'; with a "
        "CUDA 13 build of torch, pip install --pre 'flash-attn-4[cu13]', the set bench/fa4_h100.sh carries), "
        "prompt steps whose longest prompt chunk has at least this many tokens attend through it: time to first "
        "token level with pagoda's kernels at 2k tokens, 4-14% faster from 4k to 32k, slower below (0: never)",
    )
    async_scheduling: bool | None = knob(
        None,
        "schedule and launch each step while the previous one still runs on the GPU, so the host's work per step "
        "hides behind the device's (requests with repetition/presence/frequency penalties wait instead); on the "
        "CPU the same cores do both and nothing overlaps",
        default_help="on with CUDA, off on the CPU",
    )
    # 0 by default: on the H100 the thread measured 0.93-0.98x unconstrained W2 against 0.98x inline in one
    # call (bench/results/2026-11-26-h100-cb1e0e2-w2-structured*), the hand-back of the GIL costing what it saves.
    grammar_thread_min_rows: int = knob(
        0,
        "with async scheduling, a step with at least this many structured-output rows advances their grammar "
        "matchers and fills the next step's token mask on a thread of its own while the engine schedules; with "
        "fewer the work is done inline (0: always inline, the default)",
        min=0,
    )
    pooling_type: str = knob(
        "last",
        "how embedding requests (/v1/embeddings, LLM.embed) pool the prompt's final hidden states: last (the "
        "last token's, the usual choice for decoder-only models) or mean (the average over the prompt)",
        choices=POOLING_TYPES,
    )
    normalize: bool = knob(True, "L2-normalize embeddings, so that a dot product is the cosine similarity")
    speculative_config: SpeculativeConfig | None = knob(
        None,
        'speculative decoding, as JSON in vLLM\'s spelling: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_min": A, "prompt_lookup_max": B} proposes the K tokens that followed the latest earlier '
        "match of the sequence's last B..A tokens, and the model verifies them in one forward (the output "
        'distribution is unchanged); "disable_by_batch_size": N (default 16) speculates only in steps with at '
        'most N decoding sequences. {"model": PATH, "num_speculative_tokens": K} instead drafts with a smaller model '
        "of the same tokenizer and vocabulary (its own KV cache, in the same blocks as the model's)",
        parse=_speculative_flag,
        metavar="JSON",
        default_help="off",
    )

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or auto, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.attention_backend not in ("auto", *BACKENDS):
            raise ValueError(
                f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an fp8 kv_cache_dtype (fp8, fp8_e4m3 or fp8_e5m2)")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError(
                "pagoda serves a model on one GPU: tensor_parallel_size (-tp) must be 1, "
                f"got {self.tensor_parallel_size}"
            )
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.fa4_prefill_min_tokens < 0:
            raise ValueError("fa4_prefill_min_tokens must be 0 (never) or more")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError("max_prefill_graph_tokens must be 0 (no graphs) or more")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def kv_torch_dtype(self):
        """The KV cache's torch dtype: the model's (auto) or a float8 type."""
        import torch

        name = KV_CACHE_DTYPES[self.kv_cache_dtype]
        return self.torch_dtype if name is None else getattr(torch, name)
