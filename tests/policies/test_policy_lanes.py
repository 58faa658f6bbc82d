"""One active policy per lane, whatever changes lane or active: the model, the database, the admin."""
from __future__ import annotations

import dataclasses
import logging

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, OperationalError, transaction

import policies.source
from gpu_engine.backends.cpu import NumpyBackend
from gpu_engine.engine import Engine
from gpu_engine.matrix import ServedEpoch, random_matrix
from gpu_engine.scheduler import DEFAULT_POLICIES
from policies.models import BatchingPolicy, engine_policy
from policies.source import LivePolicies

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/policies/batchingpolicy/"
FORM_FIELDS = ("name", "lane", "mode", "max_batch", "window_us", "adaptive_threshold", "micro_batch",
               "streams", "p95_target_ms", "safety_margin", "max_queue", "queue_timeout_ms",
               "max_starvation_ms", "yield_ms", "notes")


def actives() -> dict[str, str]:
    return dict(BatchingPolicy.objects.filter(active=True).values_list("lane", "name"))


DEFAULT_ACTIVES = {"interactive": "interactive-latency", "bulk": "bulk-throughput"}

BULK_TIMEOUT_REFUSED = (
    "a bulk policy needs a queue_timeout_ms of at least 60000 ms, got 5000: bulk queries wait "
    "behind interactive traffic and the launches queued before them, and one not started in time "
    "fails its chunk, then its job once the retries are spent")


@pytest.fixture
def staff(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("ops", "ops@example.org", "pw"))
    return client


def form_of(policy: BatchingPolicy, **changes) -> dict:
    values = {name: getattr(policy, name) for name in FORM_FIELDS}
    values.update(changes)
    return values


# -- the model -----------------------------------------------------------------------------------
def test_moving_the_active_policy_to_another_lane_is_refused_saying_what_would_happen():
    slo = BatchingPolicy.objects.get(name="interactive-slo")
    slo.activate()
    slo.lane = "bulk"
    expected = ("interactive-slo is the active interactive policy: moving it to bulk would leave the "
                "interactive lane without a policy and replace bulk-throughput as the bulk policy. "
                "Activate another interactive policy first, then move this one.")
    with pytest.raises(ValidationError) as caught:
        slo.full_clean()
    # and its interactive queue_timeout could not serve bulk either
    assert caught.value.message_dict == {"lane": [expected],
                                         "queue_timeout_ms": [BULK_TIMEOUT_REFUSED]}
    with pytest.raises(ValidationError) as caught:
        slo.save()  # callers that skip full_clean() are refused too
    assert caught.value.message_dict == {"lane": [expected]}
    assert actives() == {"interactive": "interactive-slo", "bulk": "bulk-throughput"}


def test_moving_into_a_lane_without_an_active_policy_says_so():
    latency = BatchingPolicy.objects.get(name="interactive-latency")
    # A database written around the model (raw SQL) may have a lane with no active record.
    BatchingPolicy.objects.filter(lane="bulk").update(active=False)
    latency.lane = "bulk"
    with pytest.raises(ValidationError, match="and make it the bulk policy"):
        latency.full_clean()


def test_deactivating_the_active_policy_by_saving_is_refused():
    latency = BatchingPolicy.objects.get(name="interactive-latency")
    latency.active = False
    with pytest.raises(ValidationError) as caught:
        latency.save()
    assert caught.value.message_dict == {"active": [
        "interactive-latency is the active interactive policy: deactivating it would leave the "
        "interactive lane without a policy. Activate another interactive policy instead; that "
        "deactivates this one."]}
    assert actives() == DEFAULT_ACTIVES


def test_an_inactive_policy_may_move_and_then_be_activated_there():
    spare = BatchingPolicy.objects.get(name="interactive-throughput")
    spare.lane, spare.queue_timeout_ms = "bulk", 600_000
    spare.full_clean()
    spare.save()
    assert actives() == DEFAULT_ACTIVES
    spare.activate()
    assert actives() == {"interactive": "interactive-latency", "bulk": "interactive-throughput"}


def test_a_policy_moved_to_bulk_with_an_interactive_queue_timeout_is_refused():
    """Moved from interactive with its 5 s queue_timeout, a bulk policy failed a job for good
    after 11 attempts over 4.5 minutes of interactive load, and nothing said why beforehand."""
    spare = BatchingPolicy.objects.get(name="interactive-throughput")
    spare.lane = "bulk"
    with pytest.raises(ValidationError) as caught:
        spare.full_clean()
    assert caught.value.message_dict == {"queue_timeout_ms": [BULK_TIMEOUT_REFUSED]}
    spare.queue_timeout_ms = 60_000
    spare.full_clean()


def test_the_database_refuses_two_active_policies_in_a_lane_even_around_the_model():
    with pytest.raises(IntegrityError), transaction.atomic():
        BatchingPolicy.objects.filter(name="interactive-latency").update(lane="bulk")
    with pytest.raises(IntegrityError), transaction.atomic():
        BatchingPolicy.objects.filter(name="interactive-slo").update(active=True)
    assert actives() == DEFAULT_ACTIVES


def test_the_engine_side_warns_when_a_lane_has_no_active_record(caplog):
    BatchingPolicy.objects.filter(lane="interactive").update(active=False)  # raw, around the model
    source = LivePolicies()
    with caplog.at_level(logging.WARNING, logger="policies.source"):
        source.apply()
    assert "no valid active interactive policy in the database: the lane keeps interactive-builtin" \
        in caplog.text
    assert source("bulk").name == "bulk-throughput"


def test_with_the_database_unreachable_at_start_the_bulk_lane_runs_the_bulk_default(monkeypatch):
    def unreachable():
        raise OperationalError("could not connect to server: Connection refused")

    monkeypatch.setattr(policies.source, "load_active", unreachable)
    source = LivePolicies()
    with pytest.raises(OperationalError):
        source.apply()  # the watcher's first check as the engine starts; it keeps what it has
    engine = Engine(NumpyBackend(workers=1), ServedEpoch(1, random_matrix(16, seed=1)), source)
    bulk, interactive = engine.policies()["bulk"], engine.policies()["interactive"]
    assert bulk == DEFAULT_POLICIES["bulk"]
    assert (bulk.mode, bulk.max_batch, bulk.window_us, bulk.max_queue, bulk.queue_timeout_ms) == \
        ("throughput", 32, 20_000, 100_000, 600_000)
    assert interactive == DEFAULT_POLICIES["interactive"]
    assert (interactive.mode, interactive.max_queue, interactive.queue_timeout_ms) == \
        ("latency", 1024, 5000)


def test_the_builtin_defaults_are_the_records_a_fresh_database_starts_with():
    for lane, name in DEFAULT_ACTIVES.items():
        record = BatchingPolicy.objects.get(name=name)
        assert engine_policy(record) == dataclasses.replace(DEFAULT_POLICIES[lane], name=name)


# -- the admin -----------------------------------------------------------------------------------
def test_admin_change_form_refuses_moving_the_active_policy(staff):
    latency = BatchingPolicy.objects.get(name="interactive-latency")
    response = staff.post(CHANGELIST + f"{latency.pk}/change/", form_of(latency, lane="bulk"))
    assert response.status_code == 200  # the form again, with the error under the lane field
    page = response.content.decode()
    assert "interactive-latency is the active interactive policy: moving it to bulk" in page
    assert "errorlist" in page
    assert actives() == DEFAULT_ACTIVES
    latency.refresh_from_db()
    assert latency.lane == "interactive"


def test_admin_change_form_moves_an_inactive_policy(staff):
    slo = BatchingPolicy.objects.get(name="interactive-slo")
    refused = staff.post(CHANGELIST + f"{slo.pk}/change/", form_of(slo, lane="bulk"))
    assert refused.status_code == 200 and BULK_TIMEOUT_REFUSED in refused.content.decode()
    slo.refresh_from_db()
    assert slo.lane == "interactive"
    response = staff.post(CHANGELIST + f"{slo.pk}/change/",
                          form_of(slo, lane="bulk", queue_timeout_ms=600_000))
    assert response.status_code == 302
    slo.refresh_from_db()
    assert slo.lane == "bulk" and not slo.active
    assert actives() == DEFAULT_ACTIVES


def test_admin_add_form_cannot_create_an_active_policy(staff):
    template = BatchingPolicy.objects.get(name="interactive-slo")
    response = staff.post(CHANGELIST + "add/", form_of(template, name="posted-active", active="on"))
    assert response.status_code == 302
    assert not BatchingPolicy.objects.get(name="posted-active").active  # `active` is not a form field
    assert actives() == DEFAULT_ACTIVES


def test_admin_activate_action_keeps_one_per_lane_for_both_lanes_at_once(staff):
    spare = BatchingPolicy.objects.create(name="bulk-spare", lane="bulk", max_queue=100000,
                                          queue_timeout_ms=600000, window_us=20000)
    slo = BatchingPolicy.objects.get(name="interactive-slo")
    staff.post(CHANGELIST, {"action": "activate", "_selected_action": [slo.pk, spare.pk]})
    assert actives() == {"interactive": "interactive-slo", "bulk": "bulk-spare"}


def test_admin_activate_action_refuses_a_policy_that_cannot_serve_its_lane(staff):
    raw = BatchingPolicy.objects.create(name="bulk-raw", lane="bulk")  # around the model's check
    response = staff.post(CHANGELIST, {"action": "activate", "_selected_action": [raw.pk]},
                          follow=True)
    assert f"Policy bulk-raw was not activated: {BULK_TIMEOUT_REFUSED}" in response.content.decode()
    assert actives() == DEFAULT_ACTIVES


def test_admin_cannot_delete_the_active_policy_one_by_one_or_in_bulk(staff):
    latency = BatchingPolicy.objects.get(name="interactive-latency")
    # by its URL (no page links it): the admin's own error message on the change form, never
    # the API's bare JSON 403 inside the admin
    for method in (staff.get, staff.post):
        response = method(CHANGELIST + f"{latency.pk}/delete/", follow=True)
        assert response.status_code == 200
        assert response.redirect_chain == [(CHANGELIST + f"{latency.pk}/change/", 302)]
        page = response.content.decode()
        assert '<ul class="messagelist">' in page and "permission denied" not in page
        assert ("Not deleted: interactive-latency is the active interactive policy: activate "
                "another one for the lane before deleting it.") in page
    assert BatchingPolicy.objects.filter(pk=latency.pk).exists()
    page = staff.get(CHANGELIST).content.decode()
    assert 'value="delete_selected"' not in page
    assert actives() == DEFAULT_ACTIVES


# -- words ----------------------------------------------------------------------------------
def test_admin_names_the_model_in_plural_and_bounds_as_plain_numbers(staff):
    index = staff.get("/admin/").content.decode()
    assert "Batching policies" in index and "policys" not in index
    add = staff.get(CHANGELIST + "add/").content.decode()
    assert "Allowed: 0..1000000 µs." in add and "1e+06" not in add
    assert "Allowed: 1..600000 ms." in add
