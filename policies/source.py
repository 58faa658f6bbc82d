"""The engine's policy source: the active policy records as the engine's LanePolicy values,
kept current in every process by the cross-process watcher (engine.watcher)."""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

from django.db.models import Count, Max

from engine import watcher
from gpu_engine.scheduler import DEFAULT_POLICIES, LANES, LanePolicy, PolicyError
from policies.models import BatchingPolicy, engine_policy

log = logging.getLogger(__name__)

WATCH_NAME = "policies"


def policies_version() -> Tuple[Any, int]:
    """What changes whenever a policy is saved, activated or deleted: one indexed aggregate."""
    row = BatchingPolicy.objects.aggregate(latest=Max("updated_at"), count=Count("id"))
    return row["latest"], row["count"]


def load_active() -> Dict[str, LanePolicy]:
    """The active policy of each lane that has one, read from the database."""
    active: Dict[str, LanePolicy] = {}
    for record in BatchingPolicy.objects.filter(active=True):
        try:
            active[record.lane] = engine_policy(record)
        except PolicyError as exc:  # written around the model's checks (raw SQL): keep the old one
            log.error("active %s policy %s is invalid, not applied: %s", record.lane, record.name, exc)
    return active


class LivePolicies:
    """The engine's PolicySource: the active policies, swapped whole by the watcher.

    A call costs one dict lookup: no database read per query."""

    def __init__(self, initial: Optional[Mapping[str, LanePolicy]] = None) -> None:
        # Until the database answers (or if it never does), each lane runs its built-in default.
        self._in_force: Dict[str, LanePolicy] = dict(DEFAULT_POLICIES)
        self._in_force.update(initial or {})
        self._listeners: list = []
        self._lock = threading.Lock()

    def __call__(self, lane: str) -> LanePolicy:
        return self._in_force[lane]

    def current(self) -> Dict[str, LanePolicy]:
        return dict(self._in_force)

    def on_change(self, listener) -> None:
        """Call listener() after each swap (the engine's poke, so waiting queries see it now)."""
        with self._lock:
            self._listeners.append(listener)

    def apply(self, version: Any = None) -> None:
        in_force = dict(self._in_force)
        loaded = load_active()
        in_force.update(loaded)
        for lane in LANES:
            if lane not in loaded:
                # The model keeps one active record per lane; only raw SQL or a broken record
                # gets here, and the operator must hear which policy the lane runs instead.
                log.warning("no valid active %s policy in the database: the lane keeps %s",
                            lane, in_force[lane].name)
        changed = in_force != self._in_force
        self._in_force = in_force  # one reference swap: readers see the old or the new, whole
        if changed:
            log.info("batching policies now: %s", ", ".join(
                f"{lane}={p.name} ({p.mode})" for lane, p in sorted(in_force.items())))
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                listener()


_source: Optional[LivePolicies] = None
_source_lock = threading.Lock()


def live_policies() -> LivePolicies:
    """This process's LivePolicies, watched by the live watcher from the first call on."""
    global _source
    with _source_lock:
        if _source is None:
            _source = LivePolicies()
            watcher.register(WATCH_NAME, policies_version, _source.apply)
        else:
            watcher.default_watcher().start()  # a forked child needs its own watcher thread
        return _source


def attach(engine, **kwargs) -> LivePolicies:
    """Make `engine` follow the active policies live (engine.signals.engine_built's receiver)."""
    source = live_policies()
    # A new engine starts from the database's policies, not the last ones this process polled:
    # a watcher thread that is late or absent (a management command, the tests) leaves those.
    watcher.default_watcher().check(WATCH_NAME)
    engine.set_policy_source(source)
    source.on_change(engine.poke)
    return source


def current_policies() -> Dict[str, LanePolicy]:
    """The policies this process applies now ({} before anything was loaded); never reads the DB."""
    source = _source
    return source.current() if source is not None else {}
