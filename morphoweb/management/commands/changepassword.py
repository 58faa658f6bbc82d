"""Django's changepassword, refusing a missing or unmigrated database instead of a traceback."""
from django.contrib.auth.management.commands import changepassword

from morphoweb.dbready import ReadyDatabaseMixin


class Command(ReadyDatabaseMixin, changepassword.Command):
    pass
