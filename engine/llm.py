"""The offline API, shaped like vLLM's `LLM`: generate or chat over a batch of prompts."""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Sequence as Seq
from dataclasses import replace

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput


@contextlib.contextmanager
def frozen_heap():
    """Keep the objects that exist now out of Python's cyclic garbage collections while the block runs.

    A collection of the oldest generation walks every object, torch's and the model's among them
    (~170,000 with a tiny model on the CPU): a stall of 0.1-0.2 s in whatever step it lands in, about
    once a W2 run. The objects the block makes are still collected as usual, and those frozen go back
    to the oldest generation after it. Nothing is done when the caller froze objects itself, since
    unfreezing would undo that too."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _prompt_list(prompts: str | list[str] | list[list[int]] | list[int]) -> list[str] | list[list[int]]:
    """One prompt (text or token ids) or a list of them, as a list."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts


class LLM:
    """Offline batch generation and embedding, shaped like vLLM's `LLM`."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | list[int],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in the order of `prompts`."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        # Offline, only the finished outputs are read.
        sampling_params = [replace(p, output_kind="final_only") for p in sampling_params]
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, params, priority=priority[i] if priority else 0)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: str | list[str] | list[list[int]] | list[int],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Embed every prompt (text or token ids): each output's `embedding`, in the order of `prompts`.
        Unset pooling params take the engine's --pooling-type and --normalize."""
        params = pooling_params or PoolingParams()
        ids = []
        for prompt in _prompt_list(prompts):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, params)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar, frozen_heap():
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
