"""Commands that write to a party's database (users, tokens, epochs) refuse one that is missing or
not migrated, before connecting creates an empty SQLite file that no server uses."""
from __future__ import annotations

from pathlib import Path

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor

# `make run` keeps each party's users in its own file; the default DATABASE_URL is neither.
PARTY_DATABASES = "var/party-a.sqlite3 and var/party-b.sqlite3"
# What to do instead, by what the command writes.
USERS_HINT = (
    f"`make run` keeps its parties' users in {PARTY_DATABASES}: `make superuser` creates an "
    "admin user and a token on both (docs/OPERATIONS.md, Admin users and tokens); for another "
    "database set DATABASE_URL to it and run `python manage.py migrate` first"
)
EPOCHS_HINT = (
    f"`make run` keeps its parties' epochs in {PARTY_DATABASES}: `make epoch MATRIX=FILE` "
    "records and activates an epoch on both (docs/OPERATIONS.md, Switching epochs); for one "
    "party set DATABASE_URL (and MORPHO_ENGINE_URL) to that party's, and run "
    "`python manage.py migrate` first where its database is new"
)


def describe(alias: str = DEFAULT_DB_ALIAS) -> str:
    """The database as an operator would name it: the SQLite file, else name@host (no password)."""
    db = connections[alias].settings_dict
    if connections[alias].vendor == "sqlite":
        return str(db["NAME"])
    return f"{db.get('NAME')} on {db.get('HOST') or 'localhost'}:{db.get('PORT') or 'default port'}"


def require_ready_database(alias: str = DEFAULT_DB_ALIAS, hint: str = USERS_HINT) -> None:
    """CommandError, before anything connects, unless the database exists and is migrated.

    Connecting to a SQLite file that does not exist creates it empty, which would leave a
    database behind that no server uses; so a missing file is refused without connecting."""
    connection = connections[alias]
    name = describe(alias)
    if connection.vendor == "sqlite":
        path = str(connection.settings_dict["NAME"])
        in_memory = path == ":memory:" or path.startswith("file:") or not path
        if not in_memory and not Path(path).exists():
            raise CommandError(f"the database {name} does not exist. {hint}")
    executor = MigrationExecutor(connection)
    pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if pending:
        apps = sorted({migration.app_label for migration, _ in pending})
        raise CommandError(
            f"the database {name} is not migrated ({len(pending)} migrations of "
            f"{', '.join(apps)} not applied). {hint}"
        )


class ReadyDatabaseMixin:
    """Put before a management command's class: its execute() checks the database first."""

    database_hint = USERS_HINT  # what the refusal tells the operator to do instead

    def execute(self, *args, **options):
        require_ready_database(options.get("database") or DEFAULT_DB_ALIAS, self.database_hint)
        return super().execute(*args, **options)
