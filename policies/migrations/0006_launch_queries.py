"""A launch may merge requests up to 58 queries (174 keys): the bounds the help texts state."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('policies', '0005_yield_ms'),
    ]

    operations = [
        migrations.AlterField(
            model_name='batchingpolicy',
            name='adaptive_threshold',
            field=models.IntegerField(default=4, help_text='adaptive: queue depth from which batches are filled. Allowed: 1..58 queries.'),
        ),
        migrations.AlterField(
            model_name='batchingpolicy',
            name='max_batch',
            field=models.IntegerField(default=32, help_text='Queries per launch. Allowed: 1..58 queries.'),
        ),
        migrations.AlterField(
            model_name='batchingpolicy',
            name='micro_batch',
            field=models.IntegerField(default=0, help_text='Keys per kernel launch inside a batch; 0 = whole batch. Allowed: 0..174 keys.', verbose_name='micro-batch cap (keys)'),
        ),
    ]
