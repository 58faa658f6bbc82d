"""Answer a claimed chunk on this worker's engine (bulk lane, policy-sized requests, one epoch) and
store its answers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from django.conf import settings
from django.db import DatabaseError

from morpho_pir.dpf import KeyBatch, KeyFormatError, key_length
from gpu_engine.engine import EngineBusy, EngineOverloaded
from morpho_pir.protocol import KEYS_PER_QUERY, MAX_BATCH_QUERIES, query_key_counts
from morpho_pir.state import ServedState
from gpu_engine.scheduler import LanePolicy
from engine.holder import get_engine
from queries import bulk, bulk_files
from queries.models import BulkChunk, JobStatus

log = logging.getLogger(__name__)

LANE = "bulk"
# Full launches' worth of queries kept in the engine's bulk queue at once: one launching, one
# waiting, so the device never idles between launches and no request waits long enough to pass
# the lane's deadline.
LAUNCHES_IN_FLIGHT = 2
# a bulk request's size makes whole requests fill at least this fraction of a launch: requests
# of 20 for launches of 41 (40 of them), never requests of 1 because 41 is prime
MIN_LAUNCH_FILL = 0.9
# Failures that pass: the engine is busy or (re)starting (EngineStartFailed is an EngineBusy), the
# database is briefly unreachable.
TRANSIENT = (EngineBusy, DatabaseError)
# Seconds between writes of a running chunk's progress: launch by launch, but at most this often
# (a GPU resolves hundreds of launches a second; each write is a database round trip).
PROGRESS_WRITE_S = 0.25
EPOCH_ATTEMPTS = 3  # an epoch switch mid-chunk: answer the whole chunk again, this many times


class ChunkRejected(Exception):
    """This chunk can never be answered here (keys do not fit the served epoch): fail the job."""


class EpochChanged(EngineBusy):
    """The epoch switched under every attempt at a chunk; retried later like an engine refusal."""


def bulk_policy(engine) -> LanePolicy:
    """The bulk lane's batching policy in force in this engine."""
    return engine.policies()[LANE]


def request_plan(engine) -> tuple[int, int]:
    """(queries per request, requests kept in flight) on the bulk lane. Requests are no larger
    than the engine's launch cap: a bulk launch shrinks to it while interactive queries come
    (the policy's yield_ms) and takes whole requests only; nor than a request may be (32
    queries), where max_batch is more (up to 74; the engine's policies give it as applied, at
    most the backend's pass_queries). The largest size whose whole requests fill
    MIN_LAUNCH_FILL of max_batch, so that alone the lane merges them into (nearly) full launches
    again: a divisor of max_batch where one fits."""
    max_batch = bulk_policy(engine).max_batch
    cap = max(1, min(max_batch, engine.launch_cap(LANE), MAX_BATCH_QUERIES))
    size = max(s for s in range(1, cap + 1) if max_batch // s * s >= MIN_LAUNCH_FILL * max_batch)
    return size, LAUNCHES_IN_FLIGHT * max_batch // size


def parse_chunk(chunk: BulkChunk) -> KeyBatch:
    """The chunk's stored raw keys (three per query) as one batch, checked in one pass."""
    d = chunk.job.domain_bits
    size = key_length(d)
    try:
        raw = bulk_files.read_keys(chunk.keys_file)
    except FileNotFoundError:
        raise ChunkRejected(f"its keys file {chunk.keys_file!r} is gone") from None
    if len(raw) != chunk.count * KEYS_PER_QUERY * size:
        raise ChunkRejected(
            f"stored keys are {len(raw)} bytes, expected {chunk.count} x 3 x {size}"
        )
    try:
        return KeyBatch.from_bytes(raw, d)
    except KeyFormatError as exc:  # checked when the job was submitted: the file was altered
        raise ChunkRejected(f"stored keys do not parse: {exc}") from None


def _submit(
    engine,
    keys: KeyBatch,
    outstanding: list[Future],
    heartbeat: Callable[[], None],
) -> Future:
    """Submit one request; while the lane is full, wait for our own requests ahead to finish."""
    deadline = time.monotonic() + settings.MORPHO_BULK_LEASE_SECONDS * 4
    query_keys = query_key_counts(len(keys))
    while True:
        try:
            return engine.submit_keys(keys, query_keys, lane=LANE)
        except EngineOverloaded as exc:
            if time.monotonic() > deadline:
                raise
            pending = [f for f in outstanding if not f.done()]
            if pending:
                wait(pending, timeout=exc.retry_after, return_when=FIRST_COMPLETED)
            else:
                time.sleep(min(exc.retry_after, 1.0))
            heartbeat()


def answer_queries(
    engine,
    keys: KeyBatch,
    heartbeat: Callable[[], None],
    heartbeat_every: float,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, bytes, ServedState]:
    """(epoch_id, answers, served state) of the queries whose keys (three each) are `keys`, all
    against one epoch and one served state (docs/PROTOCOL.md section 6: a row update taken
    between two requests of the chunk answers it again); 3 x 4096 answer bytes each.

    `progress(n)` is called from this thread with the queries answered so far whenever a request
    (at most one launch: request_plan) resolves, so a job's progress moves launch by
    launch rather than chunk by chunk."""
    domain_bits = engine.epoch.matrix.domain_bits
    if keys.domain_bits != domain_bits:
        raise ChunkRejected(
            f"the job's keys have domain_bits {keys.domain_bits}, this worker's "
            f"epoch {engine.epoch.epoch_id} has {domain_bits}"
        )
    for attempt in range(EPOCH_ATTEMPTS):
        size, in_flight = request_plan(engine)
        step = size * KEYS_PER_QUERY  # keys of one request
        requests = [keys.keys(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
        futures: list[Future] = []
        last_beat = time.monotonic()
        reported = 0

        def report() -> None:
            nonlocal reported
            if progress is None:
                return
            answered = sum(
                len(r) // KEYS_PER_QUERY
                for r, f in zip(requests, futures)
                if f.done() and not f.cancelled() and f.exception() is None
            )
            if answered != reported:
                reported = answered
                progress(answered)

        def wait_for_one() -> None:
            """Until one of our requests resolves: progress and the lease's heartbeat meanwhile."""
            nonlocal last_beat
            wait([f for f in futures if not f.done()], timeout=heartbeat_every,
                 return_when=FIRST_COMPLETED)
            report()
            if time.monotonic() - last_beat >= heartbeat_every:
                heartbeat()
                last_beat = time.monotonic()

        for request in requests:
            # Keep in_flight requests queued: submit the next as soon as an earlier one resolves.
            while sum(1 for f in futures if not f.done()) >= in_flight:
                wait_for_one()
            futures.append(_submit(engine, request, futures, heartbeat))
        while not all(f.done() for f in futures):
            wait_for_one()
        results = [f.result() for f in futures]  # raises the engine's refusal, if any
        states = {r.state for r in results}
        if len(states) == 1:
            answers = b"".join(r.answers.tobytes() for r in results)
            return results[0].epoch_id, answers, results[0].state
        log.warning(
            "chunk answered across states %s (attempt %d); answering it again",
            sorted((s.epoch_id, s.updates) for s in states),
            attempt + 1,
        )
    raise EpochChanged(f"the epoch or its rows changed during each of {EPOCH_ATTEMPTS} attempts",
                       retry_after=5)


def progress_writer(chunk: BulkChunk, worker: str):
    """progress(n) for answer_queries: store n on the chunk while this worker holds it."""
    last = [-PROGRESS_WRITE_S]

    def write(answered: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_WRITE_S:
            last[0] = now
            BulkChunk.objects.filter(
                pk=chunk.pk, status=JobStatus.RUNNING, worker=worker
            ).update(answered=answered)

    return write


def answer_claimed(chunk: BulkChunk, worker: str) -> str:
    """Answer and store one chunk this worker holds: "stored", "duplicate" or "failed"."""
    try:
        epoch_id, answers, state = answer_queries(
            get_engine(),
            parse_chunk(chunk),
            heartbeat=lambda: bulk.renew_lease(chunk, worker),
            heartbeat_every=settings.MORPHO_BULK_LEASE_SECONDS / 3,
            progress=progress_writer(chunk, worker),
        )
    except ChunkRejected as exc:
        bulk.fail_chunk(chunk.pk, str(exc))
        return "failed"
    except TRANSIENT as exc:
        bulk.release_chunk(chunk, worker, f"{type(exc).__name__}: {exc}")
        raise
    stored = bulk.store_answers(chunk, worker, epoch_id, answers, state)
    return "stored" if stored else "duplicate"
