"""Per-client rate limits: token buckets for requests and tokens per minute."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

_PRUNE_EVERY = 1024  # acquire() calls between sweeps of the refilled buckets


@dataclass
class TokenBucket:
    """Holds up to `capacity`; refills continuously at capacity per minute."""

    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now); a refilled bucket must be passed."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * 60.0 / self.capacity


@dataclass
class RateLimiter:
    """Requests per minute and tokens per minute (prompt + max_tokens) per client key.

    A request is admitted only if both buckets can pay for it; then both are charged. A request
    larger than a whole bucket is charged what the bucket holds when it is full, so it is slowed
    down rather than refused forever.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    _buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    _calls: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)

    def acquire(self, client: str, tokens: int, now: float | None = None) -> tuple[float, str | None]:
        """Charge `client` for one request of `tokens`: (0, None), or (seconds to wait, "requests" or
        "tokens": the limit that refused it), in which case nothing is charged."""
        now = time.monotonic() if now is None else now
        self._calls += 1
        if self._calls % _PRUNE_EVERY == 0:
            self._prune(now)
        charges = []
        for kind, per_minute, amount in (
            ("requests", self.requests_per_minute, 1),
            ("tokens", self.tokens_per_minute, tokens),
        ):
            if not per_minute:
                continue
            bucket = self._buckets.get((client, kind))
            if bucket is None:
                bucket = self._buckets[(client, kind)] = TokenBucket(per_minute, per_minute, now)
            bucket.refill(now)
            charges.append((kind, bucket, min(amount, bucket.capacity)))
        waits = [(bucket.wait_for(amount), kind) for kind, bucket, amount in charges]
        wait, kind = max(waits, default=(0.0, None))
        if wait > 0:
            return wait, kind
        for _, bucket, amount in charges:
            bucket.level -= amount
        return 0.0, None

    def _prune(self, now: float) -> None:
        """Forget the buckets that have refilled: a new one is the same full bucket, and without this every
        address that ever called would keep its buckets for the life of the process."""
        for key, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.level >= bucket.capacity:
                del self._buckets[key]
