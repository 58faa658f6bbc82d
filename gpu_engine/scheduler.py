"""Batching decisions as pure functions: queue snapshot + policy + now -> launch or wait."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple, Union

LANES = ("interactive", "bulk")  # in priority order


@dataclass(frozen=True)
class BatchingPolicy:
    """How one lane batches; an immutable snapshot read at every decision."""

    name: str = "default"
    max_batch: int = 32  # queries per launch (1..32)

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 32:
            raise ValueError(f"max_batch must be in 1..32, got {self.max_batch}")


@dataclass(frozen=True)
class LaneQueue:
    """What one lane holds at the moment of a decision."""

    lane: str
    request_sizes: Tuple[int, ...]  # queries per queued request, oldest first
    oldest_arrival: Optional[float]  # monotonic seconds, None when empty

    @property
    def depth(self) -> int:
        return sum(self.request_sizes)


@dataclass(frozen=True)
class Launch:
    """Launch the first `requests` requests of `lane` now, as one batch."""

    lane: str
    requests: int
    queries: int
    reason: str = "latency"


@dataclass(frozen=True)
class Wait:
    """Launch nothing; look again after `seconds` (None: until something arrives)."""

    seconds: Optional[float] = None


Decision = Union[Launch, Wait]


def take_requests(sizes: Sequence[int], max_batch: int) -> Tuple[int, int]:
    """How many head requests fit in max_batch queries (at least one, never split): (requests, queries)."""
    taken = queries = 0
    for size in sizes:
        if taken and queries + size > max_batch:
            break
        taken += 1
        queries += size
    return taken, queries


def decide(
    queues: Sequence[LaneQueue], policies: Mapping[str, BatchingPolicy], now: float
) -> Decision:
    """Launch whatever the highest-priority non-empty lane holds, up to its batch cap."""
    for queue in queues:
        if queue.request_sizes:
            requests, queries = take_requests(queue.request_sizes, policies[queue.lane].max_batch)
            return Launch(queue.lane, requests, queries)
    return Wait(None)
