"""Lower lanes yield to higher ones: yield_ms, and the default bulk policy yields after 4 ms (the
value of gpu_engine.scheduler.DEFAULT_POLICIES, which tests/policies/test_policy_lanes.py checks)."""

from django.db import migrations, models

BULK_DEFAULT = "bulk-throughput"  # created by 0002_default_policies
BULK_YIELD_MS = 4.0


def bulk_yields(apps, schema_editor):
    Policy = apps.get_model("policies", "BatchingPolicy")
    Policy.objects.filter(name=BULK_DEFAULT).update(yield_ms=BULK_YIELD_MS)


class Migration(migrations.Migration):

    dependencies = [
        ('policies', '0004_window_label_microseconds'),
    ]

    operations = [
        migrations.AddField(
            model_name='batchingpolicy',
            name='yield_ms',
            field=models.FloatField(default=0.0, help_text="While a higher-priority lane is active, this lane's launches are cut to what the cost model says ends within this long, so those queries wait about this long at most behind one; 0 = never cut. Allowed: 0..60000 ms.", verbose_name='yield to higher lanes (ms)'),
        ),
        migrations.RunPython(bulk_yields, migrations.RunPython.noop),
    ]
