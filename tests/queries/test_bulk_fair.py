"""Which chunk a worker takes: round-robin over jobs with its bound, redone attempts, resends."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from morpho_pir.dpf import gen_keys
from queries import bulk
from queries.models import BulkChunk, BulkJob, BulkResult, JobStatus
from queries.tasks import answer_chunk

pytestmark = pytest.mark.django_db
KEY = 8  # bytes per fake key: claiming and storing never parse them
ANSWER = 3 * 4096


@pytest.fixture
def owner():
    return User.objects.create_user("alice")


def make_job(owner, queries: int, chunk: int = 1) -> BulkJob:
    return bulk.create_job(owner, (bytes(3 * KEY) for _ in range(queries)), queries, 8, chunk)


def claim_and_store(worker: str = "w@h") -> BulkChunk | None:
    chunk = bulk.claim_chunk(0, worker)
    if chunk is not None:
        assert bulk.store_answers(chunk, worker, 1, bytes(chunk.count * ANSWER))
    return chunk


def test_jobs_take_turns_whatever_their_size_and_a_new_job_waits_its_turn(owner):
    a = make_job(owner, 6)
    b = make_job(owner, 2)
    names = {a.pk: "A", b.pk: "B"}
    order = [names[claim_and_store().job_id] for _ in range(2)]
    c = make_job(owner, 3)  # made after A's and B's turns: behind both of them
    names[c.pk] = "C"
    while (chunk := claim_and_store()) is not None:
        order.append(names[chunk.job_id])
    assert "".join(order) == "ABABCACACAA"
    # Within a job, chunks go in order, and every job is complete and done.
    for job in (a, b, c):
        job.refresh_from_db()
        assert job.status == JobStatus.DONE and job.answered == job.total
        claimed = list(
            BulkChunk.objects.filter(job=job).order_by("claimed").values_list("index", flat=True)
        )
        assert claimed == sorted(claimed)


def test_any_job_waits_at_most_one_claim_per_other_waiting_job(owner):
    """The bound docs/OPERATIONS.md gives, on random arrivals: between a job's creation or claim and its next
    claim, the workers claim at most J - 1 other chunks, J = jobs with chunks waiting then."""
    rng = np.random.default_rng(5)
    events = []  # ("made" | "claim", job id) in order
    made = 0
    while made < 40 or BulkChunk.objects.filter(status=JobStatus.QUEUED).exists():
        if made < 40 and rng.random() < 0.4:
            job = make_job(owner, int(rng.choice([1, 2, 3, 12])))
            events.append(("made", job.pk, waiting_jobs()))
            made += 1
            continue
        chunk = claim_and_store()
        if chunk is not None:
            events.append(("claim", chunk.job_id, waiting_jobs()))
    assert BulkJob.objects.exclude(status=JobStatus.DONE).count() == 0
    checked = 0
    for i, (_, job_id, _) in enumerate(events):
        later = [j for j, event in enumerate(events[i + 1 :], i + 1) if event[1] == job_id]
        if not later or events[later[0]][0] != "claim":
            continue
        # Jobs waiting when this wait began, this one included (it has a chunk left to claim).
        bound = len(events[i][2] | {job_id}) - 1
        others = sum(1 for kind, other, _ in events[i + 1 : later[0]] if kind == "claim")
        assert others <= bound, (i, others, bound)
        checked += 1
    assert checked > 100


def waiting_jobs() -> set:
    return set(
        BulkChunk.objects.filter(status=JobStatus.QUEUED).values_list("job_id", flat=True)
    )


def test_a_redelivered_task_redoes_its_dead_attempt_and_others_are_not_fooled(owner):
    a = make_job(owner, 3)
    b = make_job(owner, 3)
    first = bulk.claim_chunk(0, "w@h", task_id="t1")
    assert first.job_id == a.pk
    # Another process of the same worker node (concurrency 2) takes the next turn, not t1's chunk.
    second = bulk.claim_chunk(first.pk, "w@h", task_id="t2")
    assert second.job_id == b.pk
    # t1's pool process died mid-chunk; its message comes back with the same task id.
    again = bulk.claim_chunk(0, "w@h", task_id="t1")
    assert again.pk == first.pk and again.attempts == 2
    assert BulkChunk.objects.get(pk=second.pk).task == "t2"


def test_an_expired_lease_is_free_to_take_a_live_one_is_not(owner):
    job = make_job(owner, 1)
    held = bulk.claim_chunk(0, "dead@h")
    assert bulk.claim_chunk(held.pk, "live@h") is None
    BulkChunk.objects.filter(pk=held.pk).update(lease_expires=timezone.now() - timedelta(1))
    taken = bulk.claim_chunk(held.pk, "live@h")
    assert taken.pk == held.pk and taken.worker == "live@h"
    assert bulk.store_answers(taken, "live@h", 1, bytes(ANSWER))
    # The dead worker's copy, if it ever finishes, stores nothing twice.
    assert not bulk.store_answers(held, "dead@h", 1, bytes(ANSWER))
    job.refresh_from_db()
    assert job.answered == 1 and BulkResult.objects.filter(job=job).count() == 1


def test_a_task_that_gives_up_fails_the_chunk_it_held_not_the_one_it_named(owner):
    a = make_job(owner, 2)
    b = make_job(owner, 2)
    a_first = BulkChunk.objects.get(job=a, index=0)
    held = bulk.claim_chunk(a_first.pk, "w@h", task_id="t1")  # named A's chunk, took A's turn
    other = bulk.claim_chunk(a_first.pk, "w@h", task_id="t2")  # B's turn, same node
    bulk.release_chunk(held, "w@h", "EngineBusy: overloaded")
    assert bulk.fail_held("t1", "EngineBusy: retries spent") == held.pk
    a.refresh_from_db()
    b.refresh_from_db()
    assert a.status == JobStatus.FAILED and "retries spent" in a.error
    assert b.status == JobStatus.RUNNING and other.job_id == b.pk
    # A task that claimed nothing fails nothing.
    assert bulk.fail_held("t3", "DatabaseError") is None and bulk.fail_held("", "x") is None
    b.refresh_from_db()
    assert b.status == JobStatus.RUNNING


def test_broker_back_resends_what_was_sent_before_it_went_away_once(owner, monkeypatch):
    sent = []
    monkeypatch.setattr(bulk, "send_chunk", lambda pk: sent.append(pk) or True)
    before = make_job(owner, 3)
    lost_at = timezone.now()
    after = make_job(owner, 2)  # sent to the new broker
    claim_and_store()  # one of `before` is done: nothing to resend for it
    expected = set(
        BulkChunk.objects.filter(job=before, status=JobStatus.QUEUED).values_list("pk", flat=True)
    )
    assert len(expected) == 2
    assert bulk.resend_sent_before(lost_at) == 2 and set(sent) == expected
    # A second worker reconnecting after the same loss finds them sent already.
    assert bulk.resend_sent_before(lost_at) == 0 and len(sent) == 2
    assert not set(sent) & set(BulkChunk.objects.filter(job=after).values_list("pk", flat=True))


def test_a_resend_stops_at_the_first_refusal_of_a_broker_down_again(owner, monkeypatch):
    refused = []
    monkeypatch.setattr(bulk, "send_chunk", lambda pk: refused.append(pk) and False)
    make_job(owner, 3)
    assert bulk.resend_sent_before(timezone.now()) == 0 and len(refused) == 1


def test_a_task_fails_the_chunk_it_answered_when_that_one_is_rejected(
    owner, serve_matrix, vector_matrix_path
):
    serve_matrix(vector_matrix_path)  # 200 pages: domain_bits 8
    rng = np.random.default_rng(3)

    def query(d: int) -> bytes:  # three keys of depth d
        keys = [*gen_keys(5, d, rng=rng), gen_keys(6, d, rng=rng)[0]]
        return b"".join(k.to_bytes() for k in keys)

    a = bulk.create_job(owner, [query(9)], 1, 9, 1)  # keys of another domain
    b = bulk.create_job(owner, [query(8)], 1, 8, 1)
    # The message names B's chunk, but it is A's turn: A's chunk is answered, rejected, failed;
    # the same task then takes the next in turn, B's, and stores it.
    assert answer_chunk.apply((BulkChunk.objects.get(job=b).pk,)).get() == "failed,stored"
    a.refresh_from_db()
    b.refresh_from_db()
    assert a.status == JobStatus.FAILED and "domain_bits 9" in a.error
    assert b.status == JobStatus.DONE and b.answered == 1
    # A's own message finds nothing left to do.
    assert answer_chunk.apply((BulkChunk.objects.get(job=a).pk,)).get() == "skipped"


def test_one_task_answers_the_chunks_in_turn_until_its_time_is_spent(
    owner, serve_matrix, vector_matrix_path, monkeypatch
):
    # A broker message is a wake-up: the task that gets one goes on taking chunks in turn, so
    # a job's chunks do not each wait for a delivery; past CHAIN_SECONDS it leaves the rest.
    from queries import tasks

    serve_matrix(vector_matrix_path)
    rng = np.random.default_rng(4)
    query = b"".join(k.to_bytes() for k in [*gen_keys(5, 8, rng=rng), gen_keys(6, 8, rng=rng)[0]])
    job = bulk.create_job(owner, [query] * 5, 5, 8, 1)  # five chunks of one query
    first = BulkChunk.objects.filter(job=job).order_by("index").first().pk
    monkeypatch.setattr(tasks, "CHAIN_SECONDS", 0.0)
    assert answer_chunk.apply((first,)).get() == "stored"
    job.refresh_from_db()
    assert job.answered == 1 and job.status == JobStatus.RUNNING
    monkeypatch.setattr(tasks, "CHAIN_SECONDS", 60.0)
    assert answer_chunk.apply((first,)).get() == "stored,stored,stored,stored"
    job.refresh_from_db()
    assert job.answered == 5 and job.status == JobStatus.DONE
