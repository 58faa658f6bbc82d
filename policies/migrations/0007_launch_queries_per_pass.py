"""A launch may merge requests up to 74 queries (222 keys), as many as the wgmma scan serves in one
pass; an engine launches at most its backend's pass_queries: the bounds the help texts state."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('policies', '0006_launch_queries'),
    ]

    operations = [
        migrations.AlterField(
            model_name='batchingpolicy',
            name='adaptive_threshold',
            field=models.IntegerField(default=4, help_text='adaptive: queue depth from which batches are filled. Allowed: 1..74 queries.'),
        ),
        migrations.AlterField(
            model_name='batchingpolicy',
            name='max_batch',
            field=models.IntegerField(default=32, help_text='Queries per launch; an engine launches no more than its backend serves in one pass over the matrix (pass_queries in /health). Allowed: 1..74 queries.'),
        ),
        migrations.AlterField(
            model_name='batchingpolicy',
            name='micro_batch',
            field=models.IntegerField(default=0, help_text='Keys per kernel launch inside a batch; 0 = whole batch. Allowed: 0..222 keys.', verbose_name='micro-batch cap (keys)'),
        ),
    ]
