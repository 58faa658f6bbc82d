"""Bulk job lifecycle: create and dispatch, claim and store a chunk, requeue lost chunks, cancel."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Max, Q
from django.template.defaultfilters import pluralize
from django.utils import timezone

from queries.models import ACTIVE, KEYS_PER_QUERY, BulkChunk, BulkJob, BulkResult, JobStatus

log = logging.getLogger(__name__)


class JobFinished(Exception):
    """The job is already done, failed or cancelled: it cannot be cancelled."""

    def __init__(self, job: BulkJob) -> None:
        super().__init__(
            f"job {job.id} is already {job.status}; only queued or running jobs can be cancelled"
        )
        self.job = job


def chunk_size_for(max_batch: int) -> int:
    """Queries per chunk: MORPHO_BULK_CHUNK, rounded down to whole launches of the bulk policy."""
    wanted = settings.MORPHO_BULK_CHUNK
    return wanted if wanted < max_batch else wanted // max_batch * max_batch


# --- creating a job (web process) -----------------------------------------------------------------


def _chunk_runs(queries: Iterable[bytes], chunk_size: int):
    """(first query index, query count, concatenated key bytes) for each run of chunk_size queries."""
    buffer = bytearray()
    first = count = 0
    for raw in queries:
        buffer += raw
        count += 1
        if count == chunk_size:
            yield first, count, bytes(buffer)
            first, count, buffer = first + count, 0, bytearray()
    if count:
        yield first, count, bytes(buffer)


def create_job(
    owner, queries: Iterable[bytes], total: int, domain_bits: int, chunk_size: int
) -> BulkJob:
    """Store a job and its chunks in one transaction, then send one task per chunk after commit.

    `queries` yields each query's three keys as raw bytes, concatenated, already validated."""
    with transaction.atomic():
        job = BulkJob(owner=owner, total=total, domain_bits=domain_bits, chunk_size=chunk_size)
        job.full_clean(exclude=["owner"])
        job.save()
        now = timezone.now()
        pending: list[BulkChunk] = []
        stored = 0
        for index, (first, count, keys) in enumerate(_chunk_runs(queries, chunk_size)):
            pending.append(BulkChunk(job=job, index=index, first=first, count=count, keys=keys,
                                     dispatched=now))
            stored = first + count
            if len(pending) >= 16:  # bounded memory: chunks go to the database as they fill
                BulkChunk.objects.bulk_create(pending)
                pending = []
        BulkChunk.objects.bulk_create(pending)
        if stored != total:
            raise ValueError(f"job declared {total} queries but {stored} were given")
        transaction.on_commit(lambda: dispatch_job(job.pk))
    chunks = index + (1 if count else 0)
    log.info(
        "bulk job %s: %d quer%s in %d chunk%s of %d",
        job.pk,
        total,
        pluralize(total, "y,ies"),
        chunks,
        pluralize(chunks),
        chunk_size,
    )
    return job


def send_chunk(chunk_id: int) -> bool:
    """Send one chunk's task to the GPU workers' queue; False when the broker cannot take it now."""
    from queries.tasks import answer_chunk  # the task module imports this one

    try:
        answer_chunk.apply_async(
            (chunk_id,),
            queue=settings.MORPHO_BULK_QUEUE,
            retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5},
        )
    except Exception as exc:  # noqa: BLE001 - any broker failure: the sweeper sends it later
        log.warning(
            "could not send chunk %s to the broker (%s); a worker's sweep will resend it",
            chunk_id,
            exc,
        )
        BulkChunk.objects.filter(pk=chunk_id, status=JobStatus.QUEUED).update(dispatched=None)
        return False
    return True


def dispatch_job(job_id) -> int:
    """Send the tasks of a new job's chunks, in order; returns how many were sent."""
    sent = 0
    for chunk_id in (
        BulkChunk.objects.filter(job_id=job_id, status=JobStatus.QUEUED)
        .order_by("index")
        .values_list("pk", flat=True)
    ):
        if not send_chunk(chunk_id):
            # The broker is down: mark the rest unsent too, so the sweep sends them at once.
            BulkChunk.objects.filter(
                job_id=job_id, status=JobStatus.QUEUED, pk__gt=chunk_id
            ).update(dispatched=None)
            break
        sent += 1
    return sent


# --- cancelling (web process, admin) ----------------------------------------------------------


def cancel_job(job: BulkJob) -> BulkJob:
    """Cancel a queued or running job: no further chunk starts; a running one finishes its chunk."""
    now = timezone.now()
    with transaction.atomic():
        if not BulkJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(
            status=JobStatus.CANCELLED, finished=now
        ):
            job.refresh_from_db()
            raise JobFinished(job)
        BulkChunk.objects.filter(job=job, status=JobStatus.QUEUED).update(
            status=JobStatus.CANCELLED
        )
    job.refresh_from_db()
    log.info("bulk job %s cancelled at %d/%d", job.pk, job.answered, job.total)
    return job


# --- a worker taking, renewing and finishing a chunk -------------------------------------------


def lease_until():
    return timezone.now() + timedelta(seconds=settings.MORPHO_BULK_LEASE_SECONDS)


def claim_chunk(chunk_id: int, worker: str) -> BulkChunk | None:
    """Take a chunk for `worker`; None when it is done, held by a live worker, or its job ended."""
    now = timezone.now()
    # A worker runs one task at a time: if the chunk is marked as running on this very worker,
    # that attempt died (a pool process killed, the task redelivered) and the chunk is free.
    free = (
        Q(status=JobStatus.QUEUED)
        | Q(status=JobStatus.RUNNING, lease_expires__lt=now)
        | Q(status=JobStatus.RUNNING, worker=worker)
    )
    taken = BulkChunk.objects.filter(free, pk=chunk_id, job__status__in=ACTIVE).update(
        status=JobStatus.RUNNING,
        worker=worker,
        lease_expires=lease_until(),
        claimed=now,
        attempts=F("attempts") + 1,
        answered=0,
        error="",
    )
    if not taken:
        return None
    chunk = BulkChunk.objects.select_related("job").get(pk=chunk_id)
    BulkJob.objects.filter(pk=chunk.job_id, status=JobStatus.QUEUED).update(
        status=JobStatus.RUNNING, started=now
    )
    return chunk


def renew_lease(chunk: BulkChunk, worker: str) -> bool:
    """Extend the claim while the chunk computes; False when another worker has it now."""
    return bool(
        BulkChunk.objects.filter(pk=chunk.pk, status=JobStatus.RUNNING, worker=worker).update(
            lease_expires=lease_until()
        )
    )


def release_chunk(chunk: BulkChunk, worker: str, error: str) -> None:
    """Give a claimed chunk back (a transient failure): its retried task can claim it again."""
    BulkChunk.objects.filter(pk=chunk.pk, status=JobStatus.RUNNING, worker=worker).update(
        status=JobStatus.QUEUED, lease_expires=None, error=error[:2000], dispatched=timezone.now()
    )


def store_answers(chunk: BulkChunk, worker: str, epoch_id: int, answers: bytes) -> bool:
    """Write a chunk's answers and count them in one transaction; False if already stored."""
    expected = chunk.count * KEYS_PER_QUERY * 4096
    if len(answers) != expected:
        raise ValueError(f"chunk {chunk.pk}: expected {expected} answer bytes, got {len(answers)}")
    now = timezone.now()
    with transaction.atomic():
        try:
            with transaction.atomic():
                BulkResult.objects.create(
                    job_id=chunk.job_id,
                    index=chunk.index,
                    first=chunk.first,
                    count=chunk.count,
                    epoch_id=epoch_id,
                    answers=answers,
                    worker=worker,
                )
        except IntegrityError:
            # Another copy of this chunk (a redelivered or resent task) stored it first; its
            # answers stand and the job's count already includes them.
            BulkChunk.objects.filter(pk=chunk.pk, status=JobStatus.RUNNING).update(
                status=JobStatus.DONE, lease_expires=None
            )
            return False
        BulkChunk.objects.filter(pk=chunk.pk).update(
            status=JobStatus.DONE, lease_expires=None, worker=worker, keys=b""
        )
        BulkJob.objects.filter(pk=chunk.job_id).update(answered=F("answered") + chunk.count)
        BulkJob.objects.filter(pk=chunk.job_id, status__in=ACTIVE, answered=F("total")).update(
            status=JobStatus.DONE, finished=now
        )
    return True


def fail_chunk(chunk_id: int, reason: str) -> None:
    """A chunk cannot be answered (bad for this epoch, retries spent): fail it and its job."""
    now = timezone.now()
    with transaction.atomic():
        chunk = BulkChunk.objects.filter(pk=chunk_id).exclude(status=JobStatus.DONE).first()
        if chunk is None:
            return
        last = chunk.first + chunk.count - 1
        BulkChunk.objects.filter(pk=chunk_id).update(
            status=JobStatus.FAILED, lease_expires=None, error=reason[:2000]
        )
        BulkJob.objects.filter(pk=chunk.job_id, status__in=ACTIVE).update(
            status=JobStatus.FAILED,
            finished=now,
            error=f"chunk {chunk.index} (queries {chunk.first}..{last}): {reason}"[:2000],
        )
        BulkChunk.objects.filter(job_id=chunk.job_id, status=JobStatus.QUEUED).update(
            status=JobStatus.CANCELLED
        )
    log.error("bulk chunk %s failed: %s", chunk_id, reason)


# --- the sweep: nothing lives only in the broker -------------------------------------------------


def sweep(now=None) -> int:
    """Resend chunks whose worker died (lease ran out) or whose message the broker lost.

    A queued chunk counts as lost once it was sent MORPHO_BULK_REQUEUE_SECONDS ago and no worker
    has taken any chunk since: while workers keep taking chunks the queue is moving and nothing
    is resent. Every worker sweeps; a conditional update picks one sender per chunk. Returns the
    number of chunks resent."""
    now = now or timezone.now()
    requeue_before = now - timedelta(seconds=settings.MORPHO_BULK_REQUEUE_SECONDS)
    lost = Q(status=JobStatus.RUNNING, lease_expires__lt=now) | Q(
        status=JobStatus.QUEUED, dispatched__isnull=True
    )
    last_claim = BulkChunk.objects.aggregate(last=Max("claimed"))["last"]
    if last_claim is None or last_claim < requeue_before:
        lost |= Q(status=JobStatus.QUEUED, dispatched__lt=requeue_before)
    candidates = list(
        BulkChunk.objects.filter(lost, job__status__in=ACTIVE)
        .order_by("job_id", "index")
        .values_list("pk", "status", "dispatched", "lease_expires")[:10_000]
    )
    resent = 0
    for pk, status, dispatched, lease in candidates:
        if status == JobStatus.RUNNING:
            won = BulkChunk.objects.filter(pk=pk, status=status, lease_expires=lease).update(
                status=JobStatus.QUEUED, lease_expires=None, dispatched=now
            )
            reason = "its worker stopped renewing its lease"
        else:
            same = Q(dispatched__isnull=True) if dispatched is None else Q(dispatched=dispatched)
            won = BulkChunk.objects.filter(same, pk=pk, status=status).update(dispatched=now)
            reason = "it was never sent" if dispatched is None else "no worker took it in time"
        if won:
            log.warning("resending bulk chunk %s: %s", pk, reason)
            if not send_chunk(pk):
                break  # the broker is down: the next sweep tries again
            resent += 1
    return resent
