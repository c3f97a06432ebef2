"""Shared fixtures: tiny random Hugging Face checkpoints of each supported architecture, the default model,
and one `pagoda serve` process for the modules that need a plain server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Idle OpenMP workers (torch's libgomp) spin some tens of microseconds (3,000 rounds, not libgomp's 300,000)
# before they sleep. libgomp reads this when torch loads it, so it is set before the import below; the
# server processes the tests start inherit it. When another process shares the two cores, spinning
# workers take the core that a worker of the same parallel op still has to run on, and every small op
# of the engine waits out scheduler time slices: the engine tests ran 4.4x slower next to a busy torch
# process than on an idle machine, 2x with this setting. On an idle machine it costs nothing measurable.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import torch  # noqa: E402

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU the Triton kernels run in Triton's interpreter (numpy), at small shapes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def fa4_on_hopper() -> bool:
    """Whether flash-attn-4 takes long prompt steps on this machine (a Hopper GPU with it installed)."""
    if not torch.cuda.is_available():
        return False
    from engine.attention.flash_attn import fa4_prefill_applies

    return fa4_prefill_applies(torch.device("cuda"), torch.bfloat16, 128)


NEEDS_FA4 = "needs flash-attn-4 on a Hopper GPU (bench/fa4_h100.sh carries it there)"

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _tiny_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        # Llama 3 style: llama3 rope scaling, untied head, sharded checkpoint.
        "llama": LlamaConfig(
            **TINY,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
        "mistral": MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=None, head_dim=16),
        "qwen2": Qwen2Config(**TINY, tie_word_embeddings=True, use_sliding_window=False),
        "qwen3": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True, use_sliding_window=False),
    }


ARCHS = ["llama", "mistral", "qwen2", "qwen3"]

# The KV pool budget (EngineConfig.cpu_kv_cache_bytes) for CPU engines whose requests need a few thousand
# tokens of cache at most. The default, 2 GiB, is zeroed at start: 0.4 s to 3 s an engine on a 2-core VM,
# and the suite starts dozens. This still sizes the pool from bytes, as the default does, and still holds
# the default model's whole 8192-token context (728 blocks, 11,648 tokens; the tiny models get far more).
KV_BYTES = 512 << 20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function arch -> HF directory of a tiny randomly initialised model (float32, safetensors)."""
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}
    configs = _tiny_configs()

    def make(arch: str) -> Path:
        if arch not in made:
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(configs[arch], dtype=torch.float32)
            # Random init leaves logits nearly flat; widen them so greedy ties are implausible.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" not in name:
                        p.normal_(0.0, 0.08)
            path = tmp_path_factory.mktemp(arch)
            model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
            made[arch] = path
        return made[arch]

    return make


@pytest.fixture(scope="session")
def default_model_dir():
    from engine.default_model import default_model_dir as locate

    return locate()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """`pagoda serve` of the default model with tests/test_server.py's SERVER_FLAGS, started once for the
    modules that need a plain server (test_server, test_bench_latency, test_docker); SIGTERM exits 0 at the end."""
    from tests.test_server import SERVER_FLAGS, start_server

    srv = start_server(tmp_path_factory.mktemp("server"), *SERVER_FLAGS)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
