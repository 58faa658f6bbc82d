"""Signals of the engine holder: how other apps hook into an engine this process builds.

Connected from their AppConfig.ready(), so the engine app imports none of them: `epochs` names
the epoch an engine starts from, `policies` gives a built engine its live policy source, `epochs`
brings a started one to the database's epoch and row updates. Sent with `engine=` the gpu_engine Engine; a receiver that raises fails
the start (the API answers 503 with the reason).
"""
from django.dispatch import Signal

# Before the Engine is built: a receiver may return the ServedEpoch to start from (epochs: the
# database's active one), so a restart does not first load the matrix file and then switch; None
# (or no receiver) starts from MORPHO_MATRIX_PATH.
starting_epoch = Signal()
# After the Engine is built, before its scheduler starts: set what it reads (policies).
engine_built = Signal()
# After its scheduler started, before any query: bring it to the state it must serve (epochs).
engine_started = Signal()
