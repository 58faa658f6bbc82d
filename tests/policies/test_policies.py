"""Policy records: defaults, validation in the engine's words, admin, activation, live propagation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from django.contrib.admin.models import LogEntry
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from engine.watcher import Watcher
from gpu_engine.scheduler import LanePolicy
from policies.models import BatchingPolicy, engine_policy
from policies.source import LivePolicies, policies_version
from tests.conftest import REPO

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/policies/batchingpolicy/"


def active(lane):
    return BatchingPolicy.objects.get(lane=lane, active=True)


def test_fresh_database_has_one_safe_active_policy_per_lane():
    assert active("interactive").name == "interactive-latency"
    assert active("bulk").name == "bulk-throughput"
    assert engine_policy(active("interactive")) == LanePolicy(
        name="interactive-latency", mode="latency", max_batch=32, window_us=2000, max_queue=1024,
        queue_timeout_ms=5000, p95_target_ms=250)
    assert {p.name for p in BatchingPolicy.objects.filter(active=False)} == {
        "interactive-slo", "interactive-throughput"}


def test_clean_names_the_field_the_range_and_the_value():
    policy = BatchingPolicy(name="x", lane="interactive", max_batch=75, streams=0, safety_margin=1.5)
    with pytest.raises(ValidationError) as caught:
        policy.full_clean()
    assert caught.value.message_dict == {
        "max_batch": ["max_batch must be in 1..74 queries, got 75"],
        "streams": ["streams must be in 1..8 streams, got 0"],
        "safety_margin": ["safety_margin must be in 0..0.9 (fraction of the target), got 1.5"],
    }
    policy = BatchingPolicy(name="y", lane="interactive", mode="adaptive", max_batch=4, adaptive_threshold=8)
    with pytest.raises(ValidationError) as caught:
        policy.full_clean()
    assert caught.value.message_dict == {
        "adaptive_threshold": ["adaptive_threshold must be at most max_batch (4 queries), got 8"]}


def test_activating_takes_the_lane_over_and_two_actives_cannot_exist():
    slo = BatchingPolicy.objects.get(name="interactive-slo")
    slo.activate()
    assert active("interactive").name == "interactive-slo"
    assert active("bulk").name == "bulk-throughput"  # other lanes are untouched
    with pytest.raises(IntegrityError), transaction.atomic():
        BatchingPolicy.objects.filter(name="interactive-latency").update(active=True)
    with pytest.raises(ValidationError, match="is the active interactive policy"):
        slo.delete()


def test_version_changes_on_every_save_activation_and_delete():
    versions = [policies_version()]
    BatchingPolicy.objects.get(name="interactive-slo").activate()
    versions.append(policies_version())
    extra = BatchingPolicy.objects.create(name="spare", lane="bulk")
    versions.append(policies_version())
    extra.delete()
    versions.append(policies_version())
    assert all(a != b for a, b in zip(versions, versions[1:]))


# -- admin --------------------------------------------------------------------------------------
@pytest.fixture
def staff(client, django_user_model):
    user = django_user_model.objects.create_superuser("ops", "ops@example.org", "pw")
    client.force_login(user)
    return client


def _form(**changes):
    values = {f: getattr(LanePolicy(), f) for f in (
        "mode", "max_batch", "window_us", "adaptive_threshold", "micro_batch", "streams",
        "p95_target_ms", "safety_margin", "max_queue", "queue_timeout_ms", "max_starvation_ms",
        "yield_ms")}
    values.update(name="new-one", lane="interactive", notes="")
    values.update(changes)
    return {k: v for k, v in values.items() if v is not False}


def test_admin_form_refuses_out_of_range_with_the_same_words(staff):
    response = staff.post(CHANGELIST + "add/", _form(streams=9, window_us=-5))
    assert response.status_code == 200
    page = response.content.decode()
    assert "streams must be in 1..8 streams, got 9" in page
    assert "window_us must be in 0..1000000 µs, got -5" in page
    assert not BatchingPolicy.objects.filter(name="new-one").exists()


def test_admin_list_marks_active_and_activate_action_logs_who_did_what(staff, django_user_model):
    page = staff.get(CHANGELIST).content.decode()
    assert "interactive-latency" in page and 'alt="True"' in page and "Live (last minute)" in page
    slo = BatchingPolicy.objects.get(name="interactive-slo")
    response = staff.post(CHANGELIST, {"action": "activate", "_selected_action": [slo.pk]}, follow=True)
    assert "Policy interactive-slo is now the interactive policy" in response.content.decode()
    assert active("interactive").name == "interactive-slo"
    entry = LogEntry.objects.get(object_id=str(slo.pk))
    assert entry.user.username == "ops" and entry.get_change_message() == "Activated as the interactive policy."
    history = staff.get(CHANGELIST + f"{slo.pk}/history/").content.decode()
    assert "Activated as the interactive policy." in history
    # two of one lane at once: refused, nothing changes
    both = BatchingPolicy.objects.filter(lane="interactive").values_list("pk", flat=True)
    response = staff.post(CHANGELIST, {"action": "activate", "_selected_action": list(both)}, follow=True)
    assert "Select at most one policy per lane" in response.content.decode()
    assert active("interactive").name == "interactive-slo"


def test_admin_edit_is_recorded_in_history(staff):
    policy = BatchingPolicy.objects.get(name="interactive-throughput")
    response = staff.post(CHANGELIST + f"{policy.pk}/change/",
                          _form(name="interactive-throughput", mode="throughput", window_us=7000))
    assert response.status_code == 302
    policy.refresh_from_db()
    assert policy.window_us == 7000
    entry = LogEntry.objects.get(object_id=str(policy.pk))
    assert "Admission window" in entry.get_change_message()
    page = staff.get(CHANGELIST + f"{active('interactive').pk}/change/").content.decode()
    assert "Live figures of the engine" in page and "this process has not started an engine yet" in page


# -- live propagation ---------------------------------------------------------------------------
# serialized_rollback: the default policies come from a migration, and an earlier transactional
# test's flush removed them.
@pytest.mark.django_db(transaction=True, serialized_rollback=True)
def test_watcher_swaps_the_snapshot_and_wakes_the_engine_without_a_read_per_query():
    source = LivePolicies()
    pokes = threading.Event()
    source.on_change(pokes.set)
    watcher = Watcher(poll_s=0.05)
    watcher.register("policies-test", policies_version, source.apply)
    try:
        assert source("interactive").name == "interactive-latency"
        pokes.clear()
        BatchingPolicy.objects.get(name="interactive-slo").activate()
        assert pokes.wait(1.0), "the watcher did not apply the change within 1 s"
        assert source("interactive").mode == "slo"
        # a record made invalid behind the model's back is not applied; the last good one stays
        BatchingPolicy.objects.filter(name="interactive-slo").update(max_batch=99)
        BatchingPolicy.objects.filter(name="interactive-slo").update(updated_at=time_now())
        watcher.check_all()  # a poll that has seen the invalid record, whatever the thread did
        assert source("interactive").name == "interactive-slo" and source("interactive").max_batch == 32
    finally:
        watcher.stop()


def test_a_new_engine_starts_from_the_databases_policies_not_the_last_polled(settings, serve_matrix,
                                                                           vector_matrix_path):
    """This process polled a policy that the database no longer holds active (a change rolled
    back, or undone by another process, before the next poll): the next engine built runs the
    database's, whether or not a watcher thread has polled since."""
    from engine.holder import get_engine
    from engine.watcher import default_watcher
    from policies.source import live_policies

    serve_matrix(vector_matrix_path)
    live_policies()  # this process's source, watched
    with transaction.atomic():
        BatchingPolicy.objects.get(name="interactive-slo").activate()
        default_watcher().check_all()
        assert live_policies()("interactive").name == "interactive-slo"
        transaction.set_rollback(True)
    assert active("interactive").name == "interactive-latency"
    assert get_engine().policies()["interactive"].name == "interactive-latency"


def time_now():
    from django.utils import timezone

    return timezone.now()


def _manage(args, env, **kwargs):
    return subprocess.Popen([sys.executable, "manage.py", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_change_reaches_another_process_within_one_second(tmp_path):
    env = {**os.environ, "MORPHO_VAR_DIR": str(tmp_path),
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "MORPHO_LOG_LEVEL": "WARNING"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    migrate = _manage(["migrate", "-v", "0"], env)
    assert migrate.wait(120) == 0, migrate.stderr.read()
    watcher = _manage(["watch_policies", "--seconds", "60"], env)
    try:
        first = json.loads(watcher.stdout.readline())
        assert first["policies"]["interactive"]["name"] == "interactive-latency"
        writer = _manage(["shell", "-c", (
            "import time; from policies.models import BatchingPolicy as P; "
            "P.objects.get(name='interactive-slo').activate(); print(time.time())")], env)
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        committed = float(out.strip().splitlines()[-1])
        seen = json.loads(watcher.stdout.readline())
        assert seen["policies"]["interactive"] == {"name": "interactive-slo", "mode": "slo", "max_batch": 32}
        assert seen["time"] - committed < 1.0, f"seen {seen['time'] - committed:.3f} s after the commit"
    finally:
        watcher.kill()
        watcher.wait()
