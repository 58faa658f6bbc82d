"""DRF's drf_create_token, refusing a missing or unmigrated database instead of a traceback."""
from rest_framework.authtoken.management.commands import drf_create_token

from morphoweb.dbready import ReadyDatabaseMixin


class Command(ReadyDatabaseMixin, drf_create_token.Command):
    pass
