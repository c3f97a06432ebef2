"""Per-request pooling parameters: what an embedding request asks instead of sampling."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.sampling_params import InvalidParameter

# last: the final hidden state of the prompt's last token; mean: the average over every prompt token.
POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the prompt's final hidden states (after the model's final norm) pooled into
    one vector; nothing is sampled or generated. None takes the engine's default (EngineConfig)."""

    pooling_type: str | None = None
    normalize: bool | None = None  # L2, so a dot product of two embeddings is their cosine similarity

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidParameter(
                "pooling_type", f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )

    def resolved(self, pooling_type: str, normalize: bool) -> PoolingParams:
        """These params with every unset field taken from the given defaults."""
        return replace(
            self,
            pooling_type=self.pooling_type or pooling_type,
            normalize=normalize if self.normalize is None else self.normalize,
        )
