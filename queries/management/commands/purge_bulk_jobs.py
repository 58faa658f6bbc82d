"""`manage.py purge_bulk_jobs`: delete the bulk jobs past their retention, with their files."""
from __future__ import annotations

from django.core.management.base import BaseCommand
from django.utils import timezone

from morphoweb.dbready import ReadyDatabaseMixin
from queries.bulk_files import purge_expired


class Command(ReadyDatabaseMixin, BaseCommand):
    help = ("Delete the bulk jobs whose expires_at has passed (MORPHO_BULK_RETENTION_SECONDS after "
            "they finished), their chunks, results and files; Celery beat does it every "
            "MORPHO_BULK_PURGE_SECONDS.")

    def handle(self, *args, **options):
        now = timezone.now()
        purged = purge_expired(now)
        self.stdout.write(f"purged {purged} bulk job{'s' if purged != 1 else ''} "
                          f"expired before {now.isoformat(timespec='seconds')}")
