"""A model ready to run: loaded behind its attention backend, with its sampler, its paged KV cache, and the
start-up pieces that go with them (an eager forward over dummy prompts against a throwaway cache, the
kernels' warm-up compile, the decode CUDA graphs). The model runner (engine/runner/model_runner.py) is one;
a draft model of speculative decoding (engine/spec_decode/draft_model.py) is another, beside it."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.attention import select_backend
from engine.config import EngineConfig
from engine.layers.linear import WeightOnlyLinear, can_prepack, prepack_linears
from engine.loader import head_dim_of, load_model, read_hf_config
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.kv_cache import KVCache
from engine.runner.step_inputs import attention_metadata, upload
from engine.sampler import Sampler
from engine.sampling_params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger("pagoda.runner")

# The memory profile's sampling rows: the sampler's worst case, every row filtered, penalized and asking for
# logprobs.
PROFILE_PARAMS = SamplingParams(
    temperature=1.0,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    frequency_penalty=0.5,
    logprobs=MAX_LOGPROBS,
)


class LoadedModel:
    """`model_dir`'s model on config.device, its backend, sampler and (unbound) KV cache of `kv_dtype`.

    `what` names it in the logs ("the model" or "the draft model"); `fa4_prefill_min_tokens`, `load_format`
    and `quantization` are the engine's for the served model, while a draft model takes its checkpoint as
    it is."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        eos_token_ids: frozenset[int],
        *,
        what: str,
        kv_dtype: torch.dtype,
        fa4_prefill_min_tokens: int = 0,
        load_format: str = "auto",
        quantization: str | None = None,
    ):
        self.config = config
        self.what = what
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.backend = select_backend(
            config.attention_backend,
            self.device,
            self.dtype,
            config.block_size,
            head_dim_of(read_hf_config(model_dir)),
            fa4_prefill_min_tokens,
            config.max_num_batched_tokens,
            kv_dtype,
        )
        start = time.perf_counter()
        source = "dummy weights" if load_format == "dummy" else f"the weights of {model_dir}"
        role = "" if what == "the model" else f", {what}"
        log.info("loading %s (%s on %s%s)", source, config.dtype, config.device, role)
        self.model, self.hf_config = load_model(
            model_dir,
            self.dtype,
            self.device,
            load_format,
            config.seed,
            self.backend,
            quantization,
            config.quant_fragment_copies,
        )
        # The state dict holds quantized layers' buffers beside the parameters (and a tied head twice).
        weights = {t.data_ptr(): t for t in self.model.state_dict().values() if t is not None}
        self.weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        # Fragment-layout copies (EngineConfig.quant_fragment_copies) are buffers outside the state dict.
        copies = sum(
            t.numel() * t.element_size()
            for m in self.model.modules()
            if isinstance(m, WeightOnlyLinear)
            for t in m.fragments().values()
        )
        extra = f", and {copies / 2**30:.2f} GiB of fragment-layout copies" if copies else ""
        log.info(
            "weights loaded in %.1f s (%.2f GiB%s%s)",
            time.perf_counter() - start,
            self.weight_bytes / 2**30,
            extra,
            role,
        )
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.sampler = Sampler(mc.vocab_size, eos_token_ids, self.device)
        self.kv_cache = KVCache(
            self.model.attention_layers(), config.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype, self.device
        )
        if can_prepack(self.dtype, self.device):
            prepack_linears(self.model)
        self.graphs: DecodeGraphs | None = None

    def graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and self.backend.supports_graphs

    def why_no_graphs(self) -> str:
        if self.device.type != "cuda":
            return f"the device is {self.device.type}"
        if self.config.enforce_eager:
            return "--enforce-eager"
        return f"the {self.backend.name} attention backend does not support them"

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """The decode graphs (forward + lm_head of one-token queries) for batches of up to `max_batch`."""
        self.graphs = DecodeGraphs(self, max_batch, -(-max_model_len // self.block_size), max_model_len)

    def compile_kernels(self) -> None:
        """Compile, before serving, the attention kernels a prompt step can take (the backend's
        warm-up prompt lengths, with and without cached context): a kernel compiles the first time
        a step calls it, seconds of stall in the middle of serving otherwise."""
        start = time.perf_counter()
        log.info("compiling the %s attention kernels", self.backend.name)
        for lens in self.backend.warmup_prompt_lens:
            for cached in (0, 16):
                self.dummy_forward(list(lens), cached)
        torch.cuda.synchronize(self.device)
        log.info("attention kernels compiled in %.1f s", time.perf_counter() - start)

    @torch.inference_mode()
    def dummy_forward(self, lens: list[int], cached: int = 0) -> torch.Tensor:
        """An eager forward over dummy prompts of `lens` new tokens after `cached` tokens of (zero)
        context each, against a throwaway cache."""
        blocks_per_seq = -(-(cached + max(lens)) // self.block_size)
        self.kv_cache.bind(blocks_per_seq * len(lens))
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(lens))]
        positions = np.concatenate([np.arange(cached, cached + n) for n in lens])
        meta = attention_metadata(self.backend, self.block_size, self.device, lens, positions, tables)
        input_ids = torch.zeros(sum(lens), dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, upload(positions, self.device), meta)
        self.kv_cache.bind(0)
        return hidden
