"""Bulk job records: a job, its chunks (the unit of work and retry), one result row per chunk.

The rows hold state; a chunk's keys and answers are files (queries/bulk_files.py)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

from morpho_pir.dpf import key_length
from morpho_pir.protocol import KEYS_PER_QUERY


class JobStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    DONE = "done", "done"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


# States a job or chunk can still leave; the others are final.
ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)


class BulkJob(models.Model):
    """A user's offline job: many queries, answered in chunks by the GPU workers."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="bulk_jobs"
    )
    status = models.CharField(
        max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True
    )
    total = models.PositiveIntegerField(help_text="queries in the job")
    answered = models.PositiveIntegerField(default=0, help_text="queries whose answers are stored")
    domain_bits = models.PositiveSmallIntegerField(
        help_text="DPF depth the keys were validated against"
    )
    chunk_size = models.PositiveIntegerField(
        help_text="queries per chunk (one task, one result write)"
    )
    error = models.TextField(blank=True, help_text="why the job failed, if it did")
    created = models.DateTimeField(auto_now_add=True, db_index=True)
    started = models.DateTimeField(
        null=True, blank=True, help_text="when a worker took its first chunk"
    )
    finished = models.DateTimeField(null=True, blank=True, help_text="done, failed or cancelled at")
    # Set when the job finishes (MORPHO_BULK_RETENTION_SECONDS later); the purge deletes the job,
    # its chunks and their files past it (queries/bulk_files.py, purge_expired).
    expires = models.DateTimeField(
        null=True, blank=True, db_index=True,
        help_text="when the job and its answers are deleted; set once it is done, failed or cancelled",
    )
    # Round-robin over jobs (queries/bulk.py, claim_chunk): the job with the oldest turn gets the
    # next chunk a worker claims, and its turn becomes that moment.
    turn = models.DateTimeField(
        default=timezone.now,
        db_index=True,
        help_text="when the job was created or last had a chunk claimed; the oldest goes next",
    )

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"bulk job {self.id} ({self.status}, {self.answered}/{self.total})"

    def clean(self) -> None:
        errors = {}
        if self.total is not None and self.total < 1:
            errors["total"] = f"expected at least 1 query, got {self.total}"
        if self.chunk_size is not None and self.chunk_size < 1:
            errors["chunk_size"] = f"expected at least 1 query per chunk, got {self.chunk_size}"
        if self.total is not None and self.answered is not None and self.answered > self.total:
            errors["answered"] = f"expected at most total ({self.total}), got {self.answered}"
        if self.domain_bits is not None and not 1 <= self.domain_bits <= 32:
            errors["domain_bits"] = f"expected 1..32, got {self.domain_bits}"
        if errors:
            raise ValidationError(errors)

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE

    @property
    def key_bytes(self) -> int:
        return key_length(self.domain_bits)

    @property
    def progress(self) -> float:
        return self.answered / self.total if self.total else 0.0

    def answered_so_far(self) -> int:
        """Queries answered: those stored plus those of running chunks answered launch by launch."""
        running = self.chunks.filter(status=JobStatus.RUNNING).aggregate(n=models.Sum("answered"))
        return min(self.total, self.answered + (running["n"] or 0))

    def epoch_ids(self) -> list[int]:
        """The epochs this job's stored answers were computed against, ascending."""
        return sorted(set(self.results.values_list("epoch_id", flat=True)))


class BulkChunk(models.Model):
    """A contiguous run of a job's queries: one Celery task, answered within one epoch."""

    job = models.ForeignKey(BulkJob, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField(help_text="chunk number within the job, from 0")
    first = models.PositiveIntegerField(help_text="job index of the chunk's first query")
    count = models.PositiveIntegerField(help_text="queries in the chunk")
    # The storage name of the validated keys as raw bytes, 3 per query in order (bulk_files): the
    # worker needs nothing from the broker but the chunk's id. Emptied once its answers are stored.
    keys_file = models.CharField(max_length=255, blank=True, help_text="file of the chunk's keys")
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED)
    attempts = models.PositiveIntegerField(default=0, help_text="times a worker claimed it")
    # Written by the worker as the engine's launches resolve (at most every PROGRESS_WRITE_S), so
    # a job's progress moves within a chunk; its answers count only once stored.
    answered = models.PositiveIntegerField(
        default=0, help_text="queries of the running attempt answered so far"
    )
    worker = models.CharField(max_length=200, blank=True, help_text="node that claimed it last")
    claimed = models.DateTimeField(null=True, blank=True, help_text="when a worker last took it")
    # The Celery task id of the attempt that claimed it last: a message redelivered after its
    # worker process died carries the same id, and takes its chunk back at once.
    task = models.CharField(max_length=64, blank=True, help_text="task that claimed it last")
    # A running chunk whose lease ran out belongs to a dead worker; the sweeper queues it again.
    lease_expires = models.DateTimeField(null=True, blank=True)
    # When its task was last sent; queued chunks are sent again when no worker has taken any chunk
    # for a while (the broker lost the messages).
    dispatched = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, help_text="last error while answering it")

    class Meta:
        ordering = ["job", "index"]
        constraints = [
            models.UniqueConstraint(fields=["job", "index"], name="bulk_chunk_unique_index"),
        ]
        indexes = [
            models.Index(fields=["status", "lease_expires"]),
            models.Index(fields=["status", "dispatched"]),
            models.Index(fields=["claimed"]),
        ]

    def __str__(self) -> str:
        last = self.first + self.count - 1
        return f"chunk {self.index} of {self.job_id} (queries {self.first}..{last})"

    def clean(self) -> None:
        if self.count is not None and self.count < 1:
            raise ValidationError({"count": f"expected at least 1 query, got {self.count}"})

    @property
    def key_bytes(self) -> int:
        """Bytes of the chunk's keys file: three keys per query."""
        return self.count * KEYS_PER_QUERY * self.job.key_bytes


class BulkResult(models.Model):
    """A chunk's answers, written once: unique per (job, chunk), so retries cannot duplicate."""

    job = models.ForeignKey(BulkJob, on_delete=models.CASCADE, related_name="results")
    index = models.PositiveIntegerField(help_text="chunk number")
    first = models.PositiveIntegerField(help_text="job index of the first query")
    count = models.PositiveIntegerField()
    epoch_id = models.BigIntegerField(
        help_text="the epoch every answer of the chunk was computed against"
    )
    # The served state every answer of the chunk comes from (docs/PROTOCOL.md section 6): a
    # client XORs two parties' answers only where these agree. Null where it was not recorded.
    state_updates = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="rows written over the epoch's matrix when answered"
    )
    state_digest = models.CharField(
        max_length=66, blank=True, help_text="their digest, 0x and 64 hex digits"
    )
    # The storage name of count x 3 answers of 4096 bytes, in query order then key order.
    answers_file = models.CharField(max_length=255, help_text="file of the chunk's answers")
    worker = models.CharField(max_length=200, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [
            models.UniqueConstraint(fields=["job", "index"], name="bulk_result_unique_chunk"),
        ]

    def __str__(self) -> str:
        return f"answers of chunk {self.index} of {self.job_id} (epoch {self.epoch_id})"
