"""Django's createsuperuser, refusing a missing or unmigrated database; --if-missing for scripts."""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.management.commands import createsuperuser
from django.db import DEFAULT_DB_ALIAS

from morphoweb.dbready import ReadyDatabaseMixin


class Command(ReadyDatabaseMixin, createsuperuser.Command):
    help = (
        "Create a superuser in the database of DATABASE_URL (refused, with what to do, when "
        "that database is missing or not migrated)."
    )

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument(
            "--if-missing", action="store_true",
            help="do nothing (and succeed) when a user of that name exists: `make superuser` "
                 "can run again",
        )

    def handle(self, *args, **options):
        username = options.get(get_user_model().USERNAME_FIELD)
        if options["if_missing"] and username:
            users = get_user_model()._default_manager.db_manager(
                options.get("database") or DEFAULT_DB_ALIAS)
            if users.filter(**{get_user_model().USERNAME_FIELD: username}).exists():
                self.stdout.write(f"user {username} exists; kept as it is")
                return
        return super().handle(*args, **options)
