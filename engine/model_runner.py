"""Turns a scheduled batch into flat tensors, runs the model on them and samples.

Owns the model, the paged KV cache (sized here from the memory budget) and the sampler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.loader import load_model
from engine.paged_attention import AttentionMetadata
from engine.sampler import Sampler, SamplerRow
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, TokenLogprobs

log = logging.getLogger("pagoda.runner")


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, eos_token_ids: frozenset[int]):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model, self.hf_config = load_model(
            model_dir, self.dtype, self.device, config.load_format, config.seed
        )
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.block_size = config.block_size
        self.sampler = Sampler(mc.vocab_size, eos_token_ids, self.device)
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ----- KV cache -----

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across every layer."""
        mc = self.model.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def allocate_kv_cache(self) -> int:
        """Size the block pool from the memory budget, allocate it, bind it to the layers."""
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        elif self.device.type == "cuda":
            num_blocks = self._blocks_that_fit_on_gpu()
        else:
            num_blocks = self.config.cpu_kv_cache_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise RuntimeError("no memory is left for the KV cache; lower max_num_batched_tokens or raise the budget")
        mc = self.model.config
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = []
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append((attn.k_cache, attn.v_cache))
        self.num_blocks = num_blocks
        return num_blocks

    def _blocks_that_fit_on_gpu(self) -> int:
        """gpu_memory_utilization of the card, minus what is in use now (weights), minus the
        activation peak of a forward at max_num_batched_tokens measured by running one."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        self._profile_forward()
        peak = torch.cuda.max_memory_allocated(self.device)
        # Memory other processes (and the CUDA context) hold counts against our budget too.
        used_elsewhere = total - free_before - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - used_elsewhere - peak
        torch.cuda.empty_cache()
        log.info(
            "memory: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB",
            total / 2**30, baseline / 2**30, (peak - baseline) / 2**30,
        )
        return int(budget // self.bytes_per_block)

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """One forward + sampling over max_num_batched_tokens dummy tokens, with a throwaway cache."""
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        blocks_per_seq = -(-max(lens) // self.block_size)
        mc = self.model.config
        shape = (blocks_per_seq * num_seqs, self.block_size, mc.num_kv_heads, mc.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        meta = self._metadata(lens, [0] * num_seqs, tables)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[: num_seqs])
        # The sampler's worst case too: every row filtered, penalized and asking for logprobs.
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                frequency_penalty=0.5, logprobs=MAX_LOGPROBS)
        self.sampler(logits, [SamplerRow(params, i, [0] * 8, [1] * 8) for i in range(num_seqs)])
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        torch.cuda.synchronize(self.device)

    # ----- one step -----

    def _metadata(self, num_new: list[int], num_computed: list[int], tables: list[list[int]]) -> AttentionMetadata:
        bs = self.block_size
        query_start = [0]
        for n in num_new:
            query_start.append(query_start[-1] + n)
        seq_lens = [c + n for c, n in zip(num_computed, num_new)]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        # Slot of each new token: block_table[seq, pos // bs] * bs + pos % bs, computed on the host
        # tensor in one vectorized gather.
        seq_index = torch.repeat_interleave(torch.arange(len(num_new)), torch.tensor(num_new))
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(num_computed, num_new)])
        slots = block_tables[seq_index, positions // bs].long() * bs + positions % bs
        return AttentionMetadata(
            slot_mapping=slots.to(self.device, non_blocking=True),
            query_start=query_start,
            seq_lens=seq_lens,
            block_tables=block_tables.to(self.device, non_blocking=True),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32).to(self.device, non_blocking=True),
        )

    def allocate_swap_space(self, gib: float) -> int:
        """CPU copies of the KV layout for swapped-out blocks (pinned when the cache is on a GPU)."""
        num_blocks = int(gib * 2**30 // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError("swap_space is too small to hold one KV block")
        mc = self.model.config
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        pin = self.device.type == "cuda"
        self.swap_caches = [
            (torch.zeros(shape, dtype=self.dtype, pin_memory=pin), torch.zeros(shape, dtype=self.dtype, pin_memory=pin))
            for _ in self.kv_caches
        ]
        return num_blocks

    def swap_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks (all layers) device -> CPU pool (to_cpu) or back, as (src, dst) pairs."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for (k, v), (cpu_k, cpu_v) in zip(self.kv_caches, self.swap_caches):
            if to_cpu:
                cpu_k.index_copy_(0, dst, k.index_select(0, src.to(self.device)).cpu())
                cpu_v.index_copy_(0, dst, v.index_select(0, src.to(self.device)).cpu())
            else:
                k.index_copy_(0, dst.to(self.device), cpu_k.index_select(0, src).to(self.device))
                v.index_copy_(0, dst.to(self.device), cpu_v.index_select(0, src).to(self.device))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers) before a shared one is written."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSeq], sampling: list[tuple[Sequence, int]]
    ) -> list[SampledToken]:
        """Run one forward over `scheduled`; sample for each (sequence, index into `scheduled` whose
        last token's logits it reads). Children of n > 1 read their parent's row."""
        seqs = [s.seq for s in scheduled]
        num_new = [s.num_new_tokens for s in scheduled]
        num_computed = [s.num_computed_tokens for s in seqs]
        input_ids = torch.tensor(
            [t for s, c, n in zip(seqs, num_computed, num_new) for t in s.token_ids[c : c + n]], dtype=torch.long
        ).to(self.device, non_blocking=True)
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(num_computed, num_new)]).to(
            self.device, non_blocking=True
        )
        meta = self._metadata(num_new, num_computed, [s.block_table for s in seqs])
        hidden = self.model(input_ids, positions, meta)
        if not sampling:
            return []
        last_token = torch.tensor(meta.query_start[1:], device=self.device) - 1
        rows = torch.tensor([row for _, row in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[last_token[rows]])
        sampler_rows = [
            SamplerRow(seq.request.params, seq.seed, seq.request.prompt_token_ids, seq.output_token_ids)
            for seq, _ in sampling
        ]
        out = self.sampler(logits, sampler_rows)
        return self._to_host(out, sampling)

    def _to_host(self, out, sampling: list[tuple[Sequence, int]]) -> list[SampledToken]:
        # The step's one device->host sync: the sampled tokens (and logprobs when asked).
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return [SampledToken(t, None) for t in token_ids]
        logprobs = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result = []
        for i, ((seq, _), token) in enumerate(zip(sampling, token_ids)):
            k = seq.request.params.logprobs
            if k is None:
                result.append(SampledToken(token, None))
                continue
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if top_ids is not None and k > 0 else []
            result.append(SampledToken(token, TokenLogprobs(token, logprobs[i], top)))
        return result
