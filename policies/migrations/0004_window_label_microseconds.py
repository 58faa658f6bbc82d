"""The admin's lists uppercase column titles, where µs read as MS: the window's label says microseconds."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('policies', '0003_plural_name'),
    ]

    operations = [
        migrations.AlterField(
            model_name='batchingpolicy',
            name='window_us',
            field=models.IntegerField(default=2000, help_text='Longest a partial batch is held, counted from the oldest queued query (throughput, adaptive); the upper bound of the window slo picks. Allowed: 0..1000000 µs.', verbose_name='admission window (microseconds)'),
        ),
    ]
