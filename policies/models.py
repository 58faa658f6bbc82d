"""Batching policy records: one active per lane, validated with the engine's own bounds and words."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Dict

from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from gpu_engine.scheduler import LANES, MODES, POLICY_BOUNDS, LanePolicy, plain_number, policy_errors

# The engine's policy fields, which a record holds under the same names.
ENGINE_FIELDS = tuple(f.name for f in fields(LanePolicy))


def record_values(record: Any) -> Dict[str, Any]:
    """The engine's fields of a policy record, by name."""
    return {name: getattr(record, name) for name in ENGINE_FIELDS}


def record_errors(record: Any) -> Dict[str, str]:
    """Field -> message in the engine's words; fields still empty are left to Django's own check."""
    values = record_values(record)
    return {name: message for name, message in policy_errors(values).items()
            if values.get(name) is not None}


def engine_policy(record: Any) -> LanePolicy:
    """The immutable engine policy of a record (the one place a record becomes one); raises
    PolicyError when it is out of range."""
    return LanePolicy(**record_values(record))


def _help(field: str, text: str) -> str:
    lo, hi, unit = POLICY_BOUNDS[field]
    return f"{text} Allowed: {plain_number(lo)}..{plain_number(hi)} {unit}."


_DEFAULT = LanePolicy()

# A bulk query waits behind interactive traffic (its lane yields, and is served at least every
# max_starvation_ms) and behind the launches its worker keeps queued; one not started within
# queue_timeout_ms fails its chunk, and a chunk that keeps failing fails the job once the task's
# retries are spent (11 attempts over about 4.5 minutes with a 5 s timeout under interactive
# load). A minute rides out an interactive burst; the bulk default is ten.
BULK_MIN_QUEUE_TIMEOUT_MS = 60_000


class BatchingPolicy(models.Model):
    """How one lane of every engine batches; the active record of a lane is in force everywhere."""

    name = models.CharField(max_length=100, unique=True)
    lane = models.CharField(max_length=20, choices=[(lane, lane) for lane in LANES])
    mode = models.CharField(max_length=20, choices=[(mode, mode) for mode in MODES], default=_DEFAULT.mode)
    max_batch = models.IntegerField(
        default=_DEFAULT.max_batch,
        help_text=_help("max_batch", "Queries per launch; an engine launches no more than its backend "
                                     "serves in one pass over the matrix (pass_queries in /health)."))
    window_us = models.IntegerField(
        "admission window (microseconds)", default=_DEFAULT.window_us,
        help_text=_help("window_us", "Longest a partial batch is held, counted from the oldest "
                                     "queued query (throughput, adaptive); the upper bound of "
                                     "the window slo picks."))
    adaptive_threshold = models.IntegerField(
        default=_DEFAULT.adaptive_threshold,
        help_text=_help("adaptive_threshold", "adaptive: queue depth from which batches are filled."))
    micro_batch = models.IntegerField(
        "micro-batch cap (keys)", default=_DEFAULT.micro_batch,
        help_text=_help("micro_batch", "Keys per kernel launch inside a batch; 0 = whole batch."))
    streams = models.IntegerField(default=_DEFAULT.streams, help_text=_help("streams", "CUDA streams."))
    cuda_graph = models.BooleanField("CUDA graph replay", default=_DEFAULT.cuda_graph)
    p95_target_ms = models.FloatField(
        "p95 target (ms)", default=_DEFAULT.p95_target_ms,
        help_text=_help("p95_target_ms", "slo: p95 latency from arrival to answer to stay under."))
    safety_margin = models.FloatField(
        default=_DEFAULT.safety_margin,
        help_text=_help("safety_margin", "slo: share of the target kept in reserve."))
    max_queue = models.IntegerField(
        default=_DEFAULT.max_queue,
        help_text=_help("max_queue", "Queries the lane may hold; beyond it requests get 503."))
    queue_timeout_ms = models.IntegerField(
        default=_DEFAULT.queue_timeout_ms,
        help_text=_help("queue_timeout_ms", "A query not started this long after arrival gets 503 "
                                            f"(bulk: fails its chunk; at least "
                                            f"{BULK_MIN_QUEUE_TIMEOUT_MS} ms there)."))
    max_starvation_ms = models.IntegerField(
        default=_DEFAULT.max_starvation_ms,
        help_text=_help("max_starvation_ms", "Longest this lane waits while a higher-priority lane "
                                             "keeps the device busy."))
    yield_ms = models.FloatField(
        "yield to higher lanes (ms)", default=_DEFAULT.yield_ms,
        help_text=_help("yield_ms", "While a higher-priority lane is active, this lane's launches "
                                    "are cut to what the cost model says ends within this long, "
                                    "so those queries wait about this long at most behind one; "
                                    "0 = never cut."))
    notes = models.TextField(blank=True)
    active = models.BooleanField(default=False, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        verbose_name_plural = "batching policies"
        ordering = ["lane", "-active", "name"]
        constraints = [
            models.UniqueConstraint(fields=["lane"], condition=Q(active=True),
                                    name="one_active_policy_per_lane"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.lane}, {self.mode}{', active' if self.active else ''})"

    def clean(self) -> None:
        # The engine's own check, so the admin, any API and the engine say the same words.
        errors = record_errors(self)
        errors.update(self.lane_errors())
        errors.update({name: message for name, message in self.fit_errors().items()
                       if name not in errors})
        if errors:
            raise ValidationError(errors)

    def fit_errors(self) -> dict[str, str]:
        """Field -> why this policy's settings cannot serve its lane ({} if they can): a policy
        moved from the interactive lane keeps settings made for answers within seconds."""
        timeout = self.queue_timeout_ms
        if self.lane == "bulk" and timeout is not None and timeout < BULK_MIN_QUEUE_TIMEOUT_MS:
            return {"queue_timeout_ms": (
                f"a bulk policy needs a queue_timeout_ms of at least {BULK_MIN_QUEUE_TIMEOUT_MS} ms, "
                f"got {self.queue_timeout_ms}: bulk queries wait behind interactive traffic and "
                f"the launches queued before them, and one not started in time fails its chunk, "
                f"then its job once the retries are spent")}
        return {}

    def lane_errors(self, stored: tuple[str, bool] | None = None) -> dict[str, str]:
        """Field -> why this change would leave a lane without its active policy ({} if none).

        `stored` is the record's (lane, active) in the database, read here when not given."""
        if self.pk is None:
            return {}  # a new record takes its lane over only when saved active, as activate() does
        if stored is None:
            stored = BatchingPolicy.objects.filter(pk=self.pk).values_list("lane", "active").first()
        if stored is None or not stored[1]:
            return {}
        lane, _ = stored
        if self.lane != lane:
            taken = (BatchingPolicy.objects.filter(lane=self.lane, active=True).exclude(pk=self.pk)
                     .values_list("name", flat=True).first())
            replaced = (f"and replace {taken} as the {self.lane} policy" if taken
                        else f"and make it the {self.lane} policy")
            return {"lane": f"{self.name} is the active {lane} policy: moving it to {self.lane} "
                            f"would leave the {lane} lane without a policy {replaced}. Activate "
                            f"another {lane} policy first, then move this one."}
        if not self.active:
            return {"active": f"{self.name} is the active {lane} policy: deactivating it would "
                              f"leave the {lane} lane without a policy. Activate another {lane} "
                              f"policy instead; that deactivates this one."}
        return {}

    def save(self, *args, **kwargs) -> None:
        with transaction.atomic():
            if self.pk is not None:
                # Checked again under the row lock, for callers that skip full_clean(): every lane
                # keeps exactly one active policy.
                stored = (BatchingPolicy.objects.select_for_update().filter(pk=self.pk)
                          .values_list("lane", "active").first())
                errors = self.lane_errors(stored)
                if errors:
                    raise ValidationError(errors)
            if self.active:
                # Saving an active record takes the lane over, in the same transaction, so the
                # lane is never without an active policy and never has two.
                BatchingPolicy.objects.filter(lane=self.lane, active=True).exclude(pk=self.pk).update(
                    active=False, updated_at=timezone.now())
            super().save(*args, **kwargs)

    def delete_refusal(self) -> str | None:
        """Why this record may not be deleted, or None."""
        if self.active:
            return (f"{self.name} is the active {self.lane} policy: activate another one for the "
                    f"lane before deleting it")
        return None

    def delete(self, *args, **kwargs):
        refusal = self.delete_refusal()
        if refusal:
            raise ValidationError(refusal)
        return super().delete(*args, **kwargs)

    def activate(self) -> None:
        """Make this the lane's policy in force (every process follows within a second)."""
        self.active = True
        self.save()
