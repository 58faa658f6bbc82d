"""Prometheus figures of epochs and the device: served epoch, pending row updates, device memory."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from gpu_engine.engine import EngineBusy
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

log = logging.getLogger(__name__)


class EpochCollector:
    """Read at scrape time from this process's engine and the database; builds no engine."""

    def collect(self) -> Iterable:
        from morphoweb.engine_runtime import peek_engine

        engine = peek_engine()
        if engine is None:
            return
        try:
            epoch = engine.epoch
        except EngineBusy:  # the engine server is away; /health says why
            return
        info = InfoMetricFamily("pir_epoch", "The epoch this process's engine serves.")
        info.add_metric([], {"epoch_id": str(epoch.epoch_id), "block_number": str(epoch.block_number),
                             "num_pages": str(epoch.matrix.num_pages),
                             "domain_bits": str(epoch.matrix.domain_bits)})
        yield info
        try:
            from epochs.models import RowUpdate, UpdateState

            pending = RowUpdate.objects.filter(epoch_id=epoch.epoch_id, state=UpdateState.PENDING).count()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because the DB is away
            log.debug("pending row updates not counted: %s", exc)
        else:
            gauge = GaugeMetricFamily("pir_row_updates_pending", "Row updates in force on the served "
                                      "epoch (written over its matrix file).")
            gauge.add_metric([], pending)
            yield gauge
        health = engine.health()
        memory = GaugeMetricFamily("pir_device_memory_bytes", "Device memory: used and total on the "
                                   "device, and resident (this engine's matrix).", labels=["kind"])
        memory.add_metric(["resident"], health.get("resident_bytes") or 0)
        for kind in ("used", "total"):
            if health.get(f"{kind}_bytes") is not None:
                memory.add_metric([kind], health[f"{kind}_bytes"])
        yield memory


_registered = False
_lock = threading.Lock()


def register_collector(registry=REGISTRY) -> None:
    """Export the epoch figures from this process's registry (once)."""
    global _registered
    with _lock:
        if not _registered:
            registry.register(EpochCollector())
            _registered = True
