"""Signals of the engine holder: how other apps hook into an engine this process builds.

Connected from their AppConfig.ready(), so the engine app imports none of them: `policies`
gives a built engine its live policy source, `epochs` brings a started one to the database's
epoch and row updates. Sent with `engine=` the gpu_engine Engine; a receiver that raises fails
the start (the API answers 503 with the reason).
"""
from django.dispatch import Signal

# After the Engine is built, before its scheduler starts: set what it reads (policies).
engine_built = Signal()
# After its scheduler started, before any query: bring it to the state it must serve (epochs).
engine_started = Signal()
