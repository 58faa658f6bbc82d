"""Bulk job files through Django's storage API: each chunk's keys and answers; their retention.

The storage is STORAGES["bulk"] (MORPHO_BULK_STORAGE: a folder of the party's state by default,
an S3-compatible bucket through django-storages in production). Names are `<job id>/...`, so a
job's files go with the job: deleting a BulkJob row (the purge, the admin) deletes them after
the transaction commits.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from datetime import timedelta

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.db import transaction
from django.template.defaultfilters import pluralize
from django.utils import timezone

from queries.models import BulkJob

log = logging.getLogger(__name__)

STORAGE = "bulk"
READ_BYTES = 1 << 20  # read from an answers file at a time when streaming it whole
PURGE_BATCH = 500  # jobs deleted per transaction by the purge


def storage():
    return storages[STORAGE]


def save_keys(job_id, index: int, keys: bytes) -> str:
    """Store a new chunk's key bytes; returns the storage name to keep on the chunk."""
    return storage().save(f"{job_id}/keys-{index:06d}.bin", ContentFile(keys))


def read_keys(name: str) -> bytes:
    with storage().open(name, "rb") as handle:
        return handle.read()


def save_answers(job_id, index: int, answers: bytes) -> str:
    """Store a chunk's answers under a name of this attempt's own: two attempts at one chunk (a
    redelivered task) never write one file; the result row names the one that counts."""
    name = f"{job_id}/answers-{index:06d}-{uuid.uuid4().hex[:12]}.bin"
    return storage().save(name, ContentFile(answers))


def open_answers(name: str):
    return storage().open(name, "rb")


def answer_blocks(name: str) -> Iterator[bytes]:
    """An answers file in READ_BYTES pieces."""
    with open_answers(name) as handle:
        while block := handle.read(READ_BYTES):
            yield block


def delete(name: str) -> None:
    if name:
        storage().delete(name)


def delete_job_files(job_id) -> int:
    """Delete every file of a job (its folder too, on the file system); returns how many."""
    store = storage()
    folder = str(job_id)
    try:
        _, files = store.listdir(folder)
    except FileNotFoundError:
        return 0
    for name in files:
        store.delete(f"{folder}/{name}")
    if hasattr(store, "path"):  # a file system: the emptied folder goes too
        try:
            os.rmdir(store.path(folder))
        except OSError:
            pass  # a straggler wrote into it meanwhile; the next purge of nothing leaves it
    return len(files)


def job_deleted(sender, instance: BulkJob, **kwargs) -> None:
    """post_delete of a BulkJob: its files go once the deletion commits (not if it rolls back)."""
    job_id = instance.pk
    transaction.on_commit(lambda: delete_job_files(job_id))


def expiry(now):
    """When a job finishing at `now` expires (MORPHO_BULK_RETENTION_SECONDS later)."""
    return now + timedelta(seconds=settings.MORPHO_BULK_RETENTION_SECONDS)


def purge_expired(now=None) -> int:
    """Delete the jobs past their `expires`, with their chunks, results and files; returns how
    many. Jobs are deleted a batch at a time, so a purge of many holds no long lock."""
    now = now or timezone.now()
    purged = 0
    while True:
        batch = list(
            BulkJob.objects.filter(expires__lt=now).values_list("pk", flat=True)[:PURGE_BATCH]
        )
        if not batch:
            break
        with transaction.atomic():
            BulkJob.objects.filter(pk__in=batch).delete()
        purged += len(batch)
    if purged:
        log.info("purged %d expired bulk job%s and their files", purged, pluralize(purged))
    return purged
