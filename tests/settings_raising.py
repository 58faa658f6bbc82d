"""Settings of a server with one view that raises: how a bug reaches the logs of a real process."""
from morphoweb.settings import *  # noqa: F401,F403 - the party's settings, DEBUG off as deployed

ROOT_URLCONF = "tests.urls_raising"
