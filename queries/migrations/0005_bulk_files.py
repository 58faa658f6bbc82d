# Chunk keys and answers move from database rows to files (queries/bulk_files.py); finished
# jobs get their expiry.

from datetime import timedelta

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.db import migrations, models


def rows_to_files(apps, schema_editor):
    storage = storages["bulk"]
    for chunk in apps.get_model("queries", "BulkChunk").objects.exclude(keys=b"").iterator():
        chunk.keys_file = storage.save(
            f"{chunk.job_id}/keys-{chunk.index:06d}.bin", ContentFile(bytes(chunk.keys)))
        chunk.save(update_fields=["keys_file"])
    for result in apps.get_model("queries", "BulkResult").objects.iterator():
        result.answers_file = storage.save(
            f"{result.job_id}/answers-{result.index:06d}-migrated.bin",
            ContentFile(bytes(result.answers)))
        result.save(update_fields=["answers_file"])
    retention = timedelta(seconds=settings.MORPHO_BULK_RETENTION_SECONDS)
    for job in apps.get_model("queries", "BulkJob").objects.filter(finished__isnull=False):
        job.expires = job.finished + retention
        job.save(update_fields=["expires"])


class Migration(migrations.Migration):

    dependencies = [
        ('queries', '0004_fair_share'),
    ]

    operations = [
        migrations.AddField(
            model_name='bulkchunk',
            name='keys_file',
            field=models.CharField(blank=True, help_text="file of the chunk's keys", max_length=255),
        ),
        migrations.AddField(
            model_name='bulkjob',
            name='expires',
            field=models.DateTimeField(blank=True, db_index=True, help_text='when the job and its answers are deleted; set once it is done, failed or cancelled', null=True),
        ),
        migrations.AddField(
            model_name='bulkresult',
            name='answers_file',
            field=models.CharField(default='', help_text="file of the chunk's answers", max_length=255),
            preserve_default=False,
        ),
        migrations.RunPython(rows_to_files, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='bulkchunk',
            name='keys',
        ),
        migrations.RemoveField(
            model_name='bulkresult',
            name='answers',
        ),
    ]
