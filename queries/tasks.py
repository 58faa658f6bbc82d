"""Celery tasks of the GPU workers: answer bulk chunks in turn, purge expired jobs.

The worker process's wiring (sweeper, fork guard, broker watch, warm-up) is queries/worker.py."""

from __future__ import annotations

import time

from celery import Task, shared_task

from queries import bulk, bulk_files
from queries.bulk_runner import TRANSIENT, answer_claimed

# Seconds one task goes on taking the next chunk in turn after its first (answer_chunk): a
# chunk is a fraction of a second of GPU work, a broker delivery can take as long.
CHAIN_SECONDS = 10.0
PURGE_TASK = "queries.purge_expired_jobs"


class ChunkTask(Task):
    """Late ack, requeued if the worker process dies, retried with backoff on transient failures."""

    acks_late = True
    reject_on_worker_lost = True
    autoretry_for = TRANSIENT
    max_retries = 10
    retry_backoff = 2
    retry_backoff_max = 60
    retry_jitter = True

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        # Retries spent, or a bug: fail the job with the reason rather than leave it running.
        # The chunk is the one this task claimed, not args[0]: a task answers whichever chunk
        # was next in turn (bulk.claim_chunk).
        bulk.fail_held(task_id, f"{type(exc).__name__}: {exc}")


@shared_task(base=ChunkTask, bind=True, name=bulk.ANSWER_CHUNK_TASK)
def answer_chunk(self, chunk_id: int) -> str:
    """Claim the next chunk in turn (chunk_id is a hint: bulk.claim_chunk), answer it on this
    worker's engine (bulk lane), store its answers once; then the next in turn, for up to
    CHAIN_SECONDS. The broker's delivery of a message (the filesystem transport polls) then
    costs once per task rather than once per chunk; the messages of chunks taken this way find
    nothing left and end at once. Returns each chunk's outcome in order ("failed,stored"), or
    "skipped" when no chunk was waiting."""
    worker = self.request.hostname or "worker"
    task_id = self.request.id or ""
    deadline = time.monotonic() + CHAIN_SECONDS
    outcomes = []
    chunk = bulk.claim_chunk(chunk_id, worker, task_id=task_id)
    while chunk is not None:
        outcomes.append(answer_claimed(chunk, worker))
        if time.monotonic() >= deadline:
            break
        chunk = bulk.claim_chunk(chunk_id, worker, task_id=task_id)
    # none: no chunk is waiting (done, held by live workers, or their jobs ended)
    return ",".join(outcomes) or "skipped"


@shared_task(name=PURGE_TASK)
def purge_expired_jobs() -> int:
    """Delete the bulk jobs past their retention, with their files (sent by Celery beat)."""
    return bulk_files.purge_expired()
