"""Bulk job lifecycle: create and dispatch, claim and store a chunk, requeue lost chunks, cancel."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from celery import current_app
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, Max, OuterRef, Q
from django.template.defaultfilters import pluralize
from django.utils import timezone

from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES
from morpho_pir.state import ServedState
from queries import bulk_files
from queries.bulk_files import expiry
from queries.models import ACTIVE, BulkChunk, BulkJob, BulkResult, JobStatus

log = logging.getLogger(__name__)

# The Celery task that answers one chunk (queries/tasks.py), sent by name: the task module
# imports this one.
ANSWER_CHUNK_TASK = "queries.answer_chunk"
# Claims one worker tries before giving its task up: each failed try means another worker took
# a chunk or a turn meanwhile, so the work is moving.
CLAIM_TRIES = 100
# Chunks one sweep looks at: bounded memory (a chunk's message is a few hundred bytes).
SWEEP_BATCH = 10_000


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
    """Store a job, its chunks' rows and their key files, then send one task per chunk after
    the transaction commits; a job that fails half-way leaves neither rows nor files.

    `queries` yields each query's three keys as raw bytes, concatenated, already validated."""
    job = BulkJob(owner=owner, total=total, domain_bits=domain_bits, chunk_size=chunk_size)
    job.full_clean(exclude=["owner"])
    index = count = 0
    try:
        with transaction.atomic():
            job.save()
            now = timezone.now()
            pending: list[BulkChunk] = []
            stored = 0
            for index, (first, count, keys) in enumerate(_chunk_runs(queries, chunk_size)):
                pending.append(BulkChunk(job=job, index=index, first=first, count=count,
                                         keys_file=bulk_files.save_keys(job.pk, index, keys),
                                         dispatched=now))
                stored = first + count
                if len(pending) >= 64:  # bounded memory: rows go to the database as they fill
                    BulkChunk.objects.bulk_create(pending)
                    pending = []
            BulkChunk.objects.bulk_create(pending)
            if stored != total:
                raise ValueError(f"job declared {total} queries but {stored} were given")
            # Its first turn: when it becomes visible to workers, not when its chunks began to load.
            BulkJob.objects.filter(pk=job.pk).update(turn=timezone.now())
            transaction.on_commit(lambda: dispatch_job(job.pk))
    except BaseException:
        bulk_files.delete_job_files(job.pk)
        raise
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
    try:
        current_app.send_task(
            ANSWER_CHUNK_TASK,
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
            status=JobStatus.CANCELLED, finished=now, expires=expiry(now)
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


def _free(now) -> Q:
    """Chunks a worker may take: queued, or running on a worker that stopped renewing its lease."""
    return Q(status=JobStatus.QUEUED) | Q(status=JobStatus.RUNNING, lease_expires__lt=now)


def _next_in_turn(now) -> tuple[object, object, int] | None:
    """(job id, job turn, chunk id): the first free chunk of the job whose turn is oldest."""
    waiting = BulkChunk.objects.filter(_free(now), job=OuterRef("pk"))
    job = (
        BulkJob.objects.filter(Exists(waiting), status__in=ACTIVE)
        .order_by("turn", "created", "pk")
        .values_list("pk", "turn")
        .first()
    )
    if job is None:
        return None
    chunk_id = (
        BulkChunk.objects.filter(_free(now), job_id=job[0])
        .order_by("index")
        .values_list("pk", flat=True)
        .first()
    )
    return None if chunk_id is None else (job[0], job[1], chunk_id)


def claim_chunk(chunk_id: int, worker: str, task_id: str = "") -> BulkChunk | None:
    """Take a chunk for `worker`: the next in round-robin order over jobs; None when none is free.

    A task names a chunk, but any task may answer any chunk: a message only says that a chunk
    is waiting, and the chunk is chosen when a worker is free to compute it, so jobs take turns
    whatever order their messages were sent in. The job whose turn is oldest (its creation, then
    its last claim) gives its lowest free chunk, and its turn becomes now; the conditional update
    of the turn lets one worker take each turn, so concurrent workers keep the order strict.
    The exception: a chunk running under this very task id belongs to an attempt that died (a
    pool process killed, its message redelivered), and is taken again first."""
    for _ in range(CLAIM_TRIES):
        now = timezone.now()
        own = None
        if task_id:
            own = (
                BulkChunk.objects.filter(
                    status=JobStatus.RUNNING, task=task_id, job__status__in=ACTIVE
                )
                .values_list("pk", "job_id")
                .first()
            )
        if own is not None:
            target, job_id = own
            free = Q(status=JobStatus.RUNNING, task=task_id)
        else:
            turn = _next_in_turn(now)
            if turn is None:
                return None
            job_id, job_turn, target = turn
            if not BulkJob.objects.filter(pk=job_id, turn=job_turn).update(turn=now):
                continue  # another worker took this job's turn: look again
            free = _free(now)
        taken = BulkChunk.objects.filter(free, pk=target, job__status__in=ACTIVE).update(
            status=JobStatus.RUNNING,
            worker=worker,
            task=task_id,
            lease_expires=lease_until(),
            claimed=now,
            attempts=F("attempts") + 1,
            answered=0,
            error="",
        )
        if taken:
            break
        if own is None:  # the chunk went to an attempt redoing it: give the turn back
            BulkJob.objects.filter(pk=job_id, turn=now).update(turn=job_turn)
    else:
        log.warning("%s: no chunk claimed after %d tries; others took them", worker, CLAIM_TRIES)
        return None
    chunk = BulkChunk.objects.select_related("job").get(pk=target)
    BulkJob.objects.filter(pk=job_id, status=JobStatus.QUEUED).update(
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


def store_answers(chunk: BulkChunk, worker: str, epoch_id: int, answers: bytes,
                  state: ServedState | None = None) -> bool:
    """Write a chunk's answers to a file, then record and count them in one transaction; False
    if another attempt stored them first (this attempt's file is deleted again). `state`: the
    served state all of them come from (its epoch is epoch_id)."""
    expected = chunk.count * KEYS_PER_QUERY * PAGE_BYTES
    if state is not None and state.epoch_id != epoch_id:
        raise ValueError(f"chunk {chunk.pk}: state of epoch {state.epoch_id}, answers of {epoch_id}")
    if len(answers) != expected:
        raise ValueError(f"chunk {chunk.pk}: expected {expected} answer bytes, got {len(answers)}")
    # The file first: a row never names a file that is not all there.
    name = bulk_files.save_answers(chunk.job_id, chunk.index, answers)
    now = timezone.now()
    try:
        with transaction.atomic():
            try:
                with transaction.atomic():
                    BulkResult.objects.create(
                        job_id=chunk.job_id,
                        index=chunk.index,
                        first=chunk.first,
                        count=chunk.count,
                        epoch_id=epoch_id,
                        state_updates=None if state is None else state.updates,
                        state_digest="" if state is None else "0x" + state.digest.hex(),
                        answers_file=name,
                        worker=worker,
                    )
            except IntegrityError:
                # Another copy of this chunk (a redelivered or resent task) stored it first; its
                # answers stand and the job's count already includes them.
                BulkChunk.objects.filter(pk=chunk.pk, status=JobStatus.RUNNING).update(
                    status=JobStatus.DONE, lease_expires=None
                )
                stored = False
            else:
                BulkChunk.objects.filter(pk=chunk.pk).update(
                    status=JobStatus.DONE, lease_expires=None, worker=worker, keys_file=""
                )
                BulkJob.objects.filter(pk=chunk.job_id).update(
                    answered=F("answered") + chunk.count)
                BulkJob.objects.filter(
                    pk=chunk.job_id, status__in=ACTIVE, answered=F("total")
                ).update(status=JobStatus.DONE, finished=now, expires=expiry(now))
                stored = True
    except BaseException:
        bulk_files.delete(name)
        raise
    if stored:
        bulk_files.delete(chunk.keys_file)  # answered for good: its keys are not needed again
    else:
        bulk_files.delete(name)
    return stored


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
            expires=expiry(now),
            error=f"chunk {chunk.index} (queries {chunk.first}..{last}): {reason}"[:2000],
        )
        BulkChunk.objects.filter(job_id=chunk.job_id, status=JobStatus.QUEUED).update(
            status=JobStatus.CANCELLED
        )
    log.error("bulk chunk %s failed: %s", chunk_id, reason)


def fail_held(task_id: str, reason: str) -> int | None:
    """A task gave up (retries spent, or a bug): fail the chunk it claimed last, if no other
    task has claimed that chunk since. Tasks are not bound to chunks (claim_chunk), so the chunk
    is found by the task id it was claimed under. Returns its id, or None when there was none
    (the task failed before claiming)."""
    if not task_id:
        return None
    chunk_id = (
        BulkChunk.objects.filter(task=task_id, status__in=ACTIVE, job__status__in=ACTIVE)
        .values_list("pk", flat=True)
        .first()
    )
    if chunk_id is not None:
        fail_chunk(chunk_id, reason)
    return chunk_id


# --- the sweep: nothing lives only in the broker -------------------------------------------------


def _resend(candidates, now) -> int | None:
    """Send (pk, status, dispatched, lease_expires) candidates again, each by one sweeper only.

    Returns how many this call sent, or None when the broker refused one (it is down)."""
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
            reason = "it was never sent" if dispatched is None else "its message may be lost"
        if won:
            log.info("resending bulk chunk %s: %s", pk, reason)
            if not send_chunk(pk):
                return None  # the broker is down: the next sweep tries again
            resent += 1
    return resent


def _candidates(lost: Q):
    return list(
        BulkChunk.objects.filter(lost, job__status__in=ACTIVE)
        .order_by("job_id", "index")
        .values_list("pk", "status", "dispatched", "lease_expires")[:SWEEP_BATCH]
    )


def sweep(now=None) -> int:
    """Resend chunks whose worker died (lease ran out) or whose message the broker lost.

    A queued chunk counts as lost once it was sent MORPHO_BULK_REQUEUE_SECONDS ago and no worker
    has taken any chunk since: while workers keep taking chunks the queue is moving (and any
    message serves any job, so no job waits on its own lost messages) and nothing is resent.
    Every worker sweeps; a conditional update picks one sender per chunk. Returns the number of
    chunks resent."""
    now = now or timezone.now()
    requeue_before = now - timedelta(seconds=settings.MORPHO_BULK_REQUEUE_SECONDS)
    lost = Q(status=JobStatus.RUNNING, lease_expires__lt=now) | Q(
        status=JobStatus.QUEUED, dispatched__isnull=True
    )
    last_claim = BulkChunk.objects.aggregate(last=Max("claimed"))["last"]
    if last_claim is None or last_claim < requeue_before:
        lost |= Q(status=JobStatus.QUEUED, dispatched__lt=requeue_before)
    resent = _resend(_candidates(lost), now) or 0
    if resent:
        log.warning("bulk sweep resent %d chunk%s", resent, pluralize(resent))
    return resent


def resend_sent_before(moment, now=None) -> int:
    """The broker came back after losing its connection at `moment`: resend what it may have lost.

    Every queued chunk whose message was sent before that moment is sent again at once (a broker
    restarted without persistence holds none of them); one sent since is in the new broker.
    A chunk sent twice is claimed once (claim_chunk), so a broker that kept its messages costs
    only one extra message per queued chunk. Every worker that reconnects calls this; the first
    moves each chunk's `dispatched` past the moment, so the others skip it. Returns the number
    resent."""
    now = now or timezone.now()
    moment = min(moment, now)  # chunks this call resends are past it, so the loop ends
    resent = 0
    while True:
        candidates = _candidates(Q(status=JobStatus.QUEUED, dispatched__lt=moment))
        batch = _resend(candidates, now)
        if batch is None:
            return resent
        resent += batch
        if len(candidates) < SWEEP_BATCH:
            return resent
