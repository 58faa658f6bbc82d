"""QueryEngine: the interface an Engine and a RemoteEngine share, which web and Celery code uses."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

from gpu_engine.engine import BatchAnswer
from gpu_engine.matrix import ServedEpoch
from gpu_engine.scheduler import LanePolicy
from morpho_pir.dpf import DpfKey, KeyBatch
from morpho_pir.state import ServedState


@runtime_checkable
class QueryEngine(Protocol):
    """A process's engine as engine.holder.get_engine() gives it: the Engine built in this process
    (gpu_engine.engine) or the client of the engine server's (gpu_engine.remote).

    Keys reach it checked: submit_keys takes a KeyBatch that a boundary made (the web tier's
    serializers, the engine server's socket), whose arrays it does not check again; the engine
    checks only that the keys fit the epoch it serves now (domain_bits, key format), which may have
    changed since they were checked, with a ValueError that names both."""

    key_formats: Tuple[int, ...]  # the key formats it answers (morpho_pir.dpf.KEY_FORMAT_*)

    @property
    def epoch(self) -> ServedEpoch:
        """The epoch it serves (EngineUnavailable where a remote one is away)."""

    @property
    def state(self) -> ServedState:
        """The epoch and the rows written over it that answers come from now."""

    @property
    def running(self) -> bool:
        """Whether it takes work."""

    @property
    def held(self) -> Optional[str]:
        """Why it refuses every query while it runs on (Engine.hold), else None."""

    @property
    def failure(self) -> Optional[str]:
        """Why it cannot answer (a dead scheduler, an engine server away), else None."""

    def policies(self) -> Dict[str, LanePolicy]:
        """Each lane's batching policy, as applied."""

    def launch_cap(self, lane: str) -> int:
        """The most queries a request on `lane` should carry."""

    def submit(self, queries: Sequence[Sequence[DpfKey]],
               lane: str = "interactive") -> "Future[BatchAnswer]":
        """Queue queries (lists of keys) on `lane`; the future holds their answers."""

    def submit_keys(self, keys: KeyBatch, query_keys: Sequence[int],
                    lane: str = "interactive") -> "Future[BatchAnswer]":
        """Queue checked keys on `lane`, query i of query_keys[i] of them."""

    def answer(self, queries: Sequence[Sequence[DpfKey]], lane: str = "interactive",
               timeout: Optional[float] = None) -> BatchAnswer:
        """submit, then wait for the answers."""

    def health(self) -> dict:
        """What /health shows of it."""

    def snapshot(self) -> dict:
        """Its counters and policies as plain data (metrics, the dashboard, the admin)."""

    def stop(self) -> None:
        """Stop taking work; whatever waits fails with EngineUnavailable."""
