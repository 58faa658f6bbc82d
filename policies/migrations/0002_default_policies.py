"""Safe default policies, so a fresh database serves sensibly: one active per lane, alternatives ready."""
from django.db import migrations

# Kept as written (a migration is history): the two active records hold the values of
# gpu_engine.scheduler.DEFAULT_POLICIES, which tests/policies/test_policy_lanes.py checks.
DEFAULTS = [
    # Interactive: answer at once with whatever is queued; under load batches form by themselves
    # while the device is busy. A deep queue or an old query is refused (503) rather than served late.
    dict(name="interactive-latency", lane="interactive", mode="latency", active=True, max_batch=32,
         window_us=2000, adaptive_threshold=4, max_queue=1024, queue_timeout_ms=5000,
         max_starvation_ms=1000, p95_target_ms=250, safety_margin=0.2,
         notes="Default. Launch at once with whatever is queued, up to 32 queries."),
    dict(name="interactive-slo", lane="interactive", mode="slo", active=False, max_batch=32,
         window_us=20000, adaptive_threshold=4, max_queue=1024, queue_timeout_ms=5000,
         max_starvation_ms=1000, p95_target_ms=250, safety_margin=0.2,
         notes="Holds queries only as long as the p95 target allows, to form batches that keep up."),
    dict(name="interactive-throughput", lane="interactive", mode="throughput", active=False,
         max_batch=32, window_us=5000, adaptive_threshold=4, max_queue=1024, queue_timeout_ms=5000,
         max_starvation_ms=1000, p95_target_ms=250, safety_margin=0.2,
         notes="Fills batches of 32 or waits 5 ms from the oldest query."),
    # Bulk: large batches, a deep queue for whole job chunks, long deadlines; never starved for
    # more than a second by interactive traffic.
    dict(name="bulk-throughput", lane="bulk", mode="throughput", active=True, max_batch=32,
         window_us=20000, adaptive_threshold=4, max_queue=100000, queue_timeout_ms=600000,
         max_starvation_ms=1000, p95_target_ms=1000, safety_margin=0.2,
         notes="Default. Full batches of 32, or whatever is queued after 20 ms."),
]


def create_defaults(apps, schema_editor):
    Policy = apps.get_model("policies", "BatchingPolicy")
    for values in DEFAULTS:
        if not Policy.objects.filter(name=values["name"]).exists():
            Policy.objects.create(**values)


def remove_defaults(apps, schema_editor):
    Policy = apps.get_model("policies", "BatchingPolicy")
    Policy.objects.filter(name__in=[values["name"] for values in DEFAULTS]).delete()


class Migration(migrations.Migration):
    dependencies = [("policies", "0001_initial")]
    operations = [migrations.RunPython(create_defaults, remove_defaults)]
