"""The engine's settings, read from Django's settings in this one place into one frozen, checked
value (`engine_settings()`); every Django-side reader of the engine takes them from here.

settings.py parses the environment (MORPHO_* variables, documented in docs/OPERATIONS.md); this value is
what the engine holder, the engine server and the epoch code use. It is read again after a
setting changes (tests override settings), and checked at start-up from EngineConfig.ready(), so a
bad value stops the process before it serves.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from gpu_engine.backends.cuda_plan import MATRIX_LAYOUTS, V2_SCANS
from gpu_engine.placement import parse_devices
from gpu_engine.choices import BACKEND_NAMES


@dataclass(frozen=True)
class EngineSettings:
    """What the Django side needs to build, reach or serve this party's engine."""

    matrix_path: Path  # MORPHO_MATRIX_PATH: the matrix file the engine serves
    matrix_dir: Optional[Path]  # MORPHO_MATRIX_DIR: where epoch files may come from (None: below)
    backend: str  # MORPHO_ENGINE_BACKEND: auto, cpu or cuda
    devices: Tuple[int, ...]  # MORPHO_ENGINE_DEVICES: device ids; () = one device, the current one
    v2_scan: str  # MORPHO_V2_SCAN: how CUDA scans v2 keys: auto, mma or alu
    matrix_layout: str  # MORPHO_MATRIX_LAYOUT: how CUDA stores the matrix: pages or fragments
    domain_bits: Optional[int]  # MORPHO_DOMAIN_BITS: None = the smallest that fits the pages
    url: str  # MORPHO_ENGINE_URL: the engine server's address; "" = an engine in this process
    deadline_s: float  # MORPHO_ENGINE_DEADLINE: silence after which the engine server is given up
    retry_after_s: int  # MORPHO_ENGINE_RETRY_AFTER: 503 after a failed start, before a new try
    warm_up: bool  # MORPHO_ENGINE_WARMUP: the engine server warms every batch shape up first
    eager: bool  # MORPHO_ENGINE_EAGER: the WSGI application starts the engine when it loads
    gil_switch_interval_us: int  # MORPHO_GIL_SWITCH_INTERVAL_US: 0 = Python's own

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ImproperlyConfigured(
                f"MORPHO_ENGINE_BACKEND: expected {', '.join(BACKEND_NAMES[:-1])} or "
                f"{BACKEND_NAMES[-1]}, got {self.backend!r}")
        if self.v2_scan not in V2_SCANS:
            raise ImproperlyConfigured(
                f"MORPHO_V2_SCAN: expected {', '.join(V2_SCANS[:-1])} or {V2_SCANS[-1]}, "
                f"got {self.v2_scan!r}")
        if self.matrix_layout not in MATRIX_LAYOUTS:
            raise ImproperlyConfigured(
                f"MORPHO_MATRIX_LAYOUT: expected {' or '.join(MATRIX_LAYOUTS)}, got {self.matrix_layout!r}")
        if self.domain_bits is not None and not 1 <= self.domain_bits <= 32:
            raise ImproperlyConfigured(
                f"MORPHO_DOMAIN_BITS: expected an integer in 1..32, got {self.domain_bits}")
        if self.deadline_s < 0.5:
            raise ImproperlyConfigured(
                f"MORPHO_ENGINE_DEADLINE: expected a number >= 0.5, got {self.deadline_s}")
        if self.retry_after_s < 1:
            raise ImproperlyConfigured(
                f"MORPHO_ENGINE_RETRY_AFTER: expected an integer >= 1, got {self.retry_after_s}")
        if not 0 <= self.gil_switch_interval_us <= 1_000_000:
            raise ImproperlyConfigured(
                f"MORPHO_GIL_SWITCH_INTERVAL_US: expected an integer in 0..1000000, got "
                f"{self.gil_switch_interval_us}")

    @property
    def matrix_folder(self) -> Path:
        """The only folder epoch matrix files may come from, as configured (before symlinks):
        MORPHO_MATRIX_DIR, else the folder of MORPHO_MATRIX_PATH."""
        return self.matrix_dir or self.matrix_path.parent

    @property
    def remote(self) -> bool:
        """True where an engine server address is set (every process but the server submits to it)."""
        return bool(self.url)


@functools.lru_cache(maxsize=1)
def engine_settings() -> EngineSettings:
    """This process's engine settings (read once; again after a setting changed)."""
    return EngineSettings(
        matrix_path=Path(settings.MORPHO_MATRIX_PATH),
        matrix_dir=Path(settings.MORPHO_MATRIX_DIR) if settings.MORPHO_MATRIX_DIR else None,
        backend=settings.MORPHO_ENGINE_BACKEND,
        devices=_devices(settings.MORPHO_ENGINE_DEVICES),
        v2_scan=settings.MORPHO_V2_SCAN,
        matrix_layout=settings.MORPHO_MATRIX_LAYOUT,
        domain_bits=settings.MORPHO_DOMAIN_BITS,
        url=settings.MORPHO_ENGINE_URL,
        deadline_s=settings.MORPHO_ENGINE_DEADLINE,
        retry_after_s=settings.MORPHO_ENGINE_RETRY_AFTER,
        warm_up=settings.MORPHO_ENGINE_WARMUP,
        eager=settings.MORPHO_ENGINE_EAGER,
        gil_switch_interval_us=settings.MORPHO_GIL_SWITCH_INTERVAL_US,
    )


def _devices(text: str) -> Tuple[int, ...]:
    try:
        return tuple(parse_devices(text))
    except ValueError as exc:
        raise ImproperlyConfigured(f"MORPHO_ENGINE_DEVICES: {exc}") from None


@receiver(setting_changed)
def _reread(setting: str, **kwargs) -> None:
    if setting.startswith("MORPHO_"):
        engine_settings.cache_clear()
