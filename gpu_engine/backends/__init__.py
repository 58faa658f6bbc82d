"""The backends' public names: the interface (base) and the factory that picks one (factory)."""
from __future__ import annotations

from gpu_engine.backends.base import (  # noqa: F401 - the package's public names
    Backend,
    BackendUnavailable,
    DispatchShape,
    KeysRefused,
    ResidentMatrix,
)
from gpu_engine.backends.factory import create_backend  # noqa: F401 - scripts import it from here
