"""Keeps this process's engine on the active epoch, with every pending row update applied.

The database is the truth: the active Epoch record (when there is none, the epoch of the matrix
file the process was started with is recorded as the active one) plus the pending RowUpdates of
that epoch. `sync(engine)` brings an
engine there; it runs when this process changes the state (before the change is acknowledged),
right after an engine starts (engine.signals.engine_started), and from the cross-process watcher
(engine.watcher) when another process changed it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Count, Max, Q
from django.utils import timezone

from engine import holder, watcher
from engine.config import engine_settings
from epochs.models import (
    Epoch,
    EpochState,
    PendingUpdates,
    RowUpdate,
    UpdateState,
    current_epoch_shape,
)
from gpu_engine.backends import BackendUnavailable
from gpu_engine.engine import SwitchMode
from gpu_engine.placement import Placement, PlacementError
from gpu_engine.matrix import ROW_BYTES, ROWS_PER_PAGE, MatrixChanged, ServedEpoch
from morpho_pir.protocol import parse_hex
from gpu_engine.remote import RemoteError

log = logging.getLogger(__name__)

# A transaction that drew a RowUpdate id may commit after one that drew a larger id (PostgreSQL
# sequences); ids are re-checked for this long before they count as seen for good.
COMMIT_SLACK_SECONDS = 10.0
# A switch that failed in a watcher is not retried for this long (a retry reloads the matrix).
FAILED_SWITCH_BACKOFF = 30.0

WATCH_NAME = "epochs"
# Seconds a web process waits for the engine server to switch epochs or apply row updates (a
# switch loads a whole matrix).
REMOTE_CONTROL_TIMEOUT = 600.0

_lock = threading.RLock()  # one sync at a time: request threads and the watcher thread


class EpochSwitchError(RuntimeError):
    """The engine could not switch to an epoch; the message says why and what to do."""


@dataclass
class _Applied:
    """What one engine has applied of its current epoch's row updates."""

    epoch_id: int
    floor: int = 0  # every pending update with id <= floor is applied
    ids: set = field(default_factory=set)  # applied ids above the floor
    checkpoints: list[tuple[float, int]] = field(default_factory=list)  # (when, highest id seen)

    def advance(self, now: float) -> None:
        high = max(self.ids, default=self.floor)
        self.checkpoints.append((now, high))
        settled = [c for c in self.checkpoints if now - c[0] >= COMMIT_SLACK_SECONDS]
        if settled:
            self.floor = max(self.floor, max(h for _, h in settled))
            self.ids = {i for i in self.ids if i > self.floor}
            self.checkpoints = [c for c in self.checkpoints if now - c[0] < COMMIT_SLACK_SECONDS]


_applied: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# engine -> (the switch tried: record pk, switch mode, placement, activation; when; why it failed)
_failed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_engine():
    """The Engine of this process, if it runs one (None where the engine is remote)."""
    return holder.local_engine()


def _remote_call(op: str, **args) -> None:
    """Run `op` in the engine server (where the Engine is); its failure becomes EpochSwitchError."""
    try:
        holder.remote_engine().call(op, timeout=REMOTE_CONTROL_TIMEOUT, **args)
    except RemoteError as exc:
        raise EpochSwitchError(str(exc)) from None


def state_version() -> tuple:
    """Changes whenever the active epoch or the set of pending updates changes (two small queries)."""
    active = Epoch.objects.filter(state=EpochState.ACTIVE).values_list(
        "pk", "epoch_id", "switch_mode", "placement", "activated").order_by("-activated", "-pk").first()
    pending = RowUpdate.objects.filter(state=UpdateState.PENDING)
    figures = pending.aggregate(n=Count("pk"), high=Max("pk"))
    # while a switch of this process's engine has failed, the version also moves every
    # FAILED_SWITCH_BACKOFF, so that the watcher tries it again though nothing else changes
    retry = int(time.monotonic() // FAILED_SWITCH_BACKOFF) if len(_failed) else None
    return (active, figures["n"], figures["high"], retry)


def _final_rows(selection: Q, rows: Sequence[int] | None = None) -> tuple[dict[int, bytes], list[int]]:
    """The latest pending data of each row among `selection`'s updates (highest id wins) and the
    ids that were read."""
    updates = RowUpdate.objects.filter(selection, state=UpdateState.PENDING)
    if rows is not None:
        updates = updates.filter(row__in=list(rows))
    data: dict[int, bytes] = {}
    ids = []
    for pk, row, hexdata in updates.order_by("pk").values_list("pk", "row", "data"):
        data[row] = parse_hex(hexdata, ROW_BYTES)
        ids.append(pk)
    return data, ids


def _starting_rows(record: Epoch, old_epoch_id: int | None) -> tuple[dict[int, bytes], list[int]]:
    """The pending rows `record`'s epoch starts with once its activation commits: its own pending
    updates plus, when it absorbs them, those of the old epoch that fit its rows (_commit_switch
    moves them so)."""
    selection = Q(epoch_id=record.epoch_id)
    if record.pending_updates == PendingUpdates.ABSORB and old_epoch_id is not None:
        selection |= Q(epoch_id=old_epoch_id, row__lt=(record.num_pages or 0) * ROWS_PER_PAGE)
    return _final_rows(selection)


def _reason(exc: Exception) -> str:
    """A failed switch in the words stored on the record and shown to the operator."""
    # the messages of a file that changed and of a placement the devices cannot make are worded
    # for operators; anything else keeps its type's name
    worded = isinstance(exc, (EpochSwitchError, MatrixChanged, PlacementError))
    return str(exc) if worded else f"{type(exc).__name__}: {exc}"


def _switch(engine, record: Epoch, mode: SwitchMode,
            starting: tuple[dict[int, bytes], list[int]] | None = None) -> None:
    """Load `record` with its pending updates written in, and switch the engine to it.

    starting: the (rows, ids) to write in, when they are not yet `record`'s pending updates."""
    stop_the_world = SwitchMode(mode) is SwitchMode.STOP_THE_WORLD
    epoch = record.load()
    rows, ids = starting if starting is not None else _final_rows(Q(epoch_id=record.epoch_id))
    for row, data in rows.items():
        epoch.matrix.write_row(row, data)  # copy-on-write: the file is never touched
    try:
        engine.switch_epoch(epoch, mode, written=rows).result()
    except Exception as exc:
        if stop_the_world:
            # The engine reloaded its current epoch from the matrix file, without its updates: the
            # caller writes them again (outside any transaction that is being rolled back).
            _applied.pop(engine, None)
        if not isinstance(exc, BackendUnavailable):
            raise
        current = engine.epoch.matrix.nbytes
        hint = "" if stop_the_world else (
            f" Epoch {record.epoch_id} ({epoch.matrix.nbytes} bytes) does not fit beside epoch "
            f"{engine.epoch.epoch_id} ({current} bytes): activate it with switch mode "
            f"'stop the world' to free the current epoch first (queries wait during the load).")
        raise EpochSwitchError(f"{exc}.{hint}") from exc
    state = _Applied(record.epoch_id, ids=set(ids))
    state.advance(time.monotonic())
    _applied[engine] = state
    log.info("engine now serves epoch %s (%d pending row updates applied)", record.epoch_id, len(ids))


def _apply_new_updates(engine) -> int:
    """Write the pending updates this engine has not applied yet; returns how many there were."""
    epoch_id = engine.epoch.epoch_id
    state = _applied.get(engine)
    if state is None or state.epoch_id != epoch_id:
        state = _Applied(epoch_id)
        _applied[engine] = state
    fresh = [
        (pk, row) for pk, row in RowUpdate.objects.filter(
            epoch_id=epoch_id, state=UpdateState.PENDING, pk__gt=state.floor,
        ).values_list("pk", "row") if pk not in state.ids
    ]
    if fresh:
        # Rewrite each touched row with its latest value, so an update that committed late
        # never overrides a newer one of the same row.
        rows, _ = _final_rows(Q(epoch_id=epoch_id), {row for _, row in fresh})
        engine.write_rows(rows).result()
        state.ids.update(pk for pk, _ in fresh)
    state.advance(time.monotonic())
    return len(fresh)


def sync(engine, explicit: bool = False) -> None:
    """Bring `engine` to the database state. `explicit`: an operator asked; errors are raised."""
    if engine is None:
        return
    with _lock:
        record = Epoch.objects.active()
        other = record is not None and record.epoch_id != engine.epoch.epoch_id
        if record is not None and (other or _placed_otherwise(engine, record)):
            tried = (record.pk, record.switch_mode, record.placement, record.activated)
            last = _failed.get(engine)
            # The same switch that failed is tried again only after FAILED_SWITCH_BACKOFF, and
            # only while the engine serves another epoch (a placement the devices could not make
            # waits for the record to change): a retry loads a whole matrix.
            if not explicit and last is not None and last[0] == tried and (
                    not other or time.monotonic() - last[1] < FAILED_SWITCH_BACKOFF):
                engine.hold(_held_reason(record.epoch_id, last[2]) if other else None)
                _apply_new_updates(engine)  # updates acknowledged meanwhile still land
                return
            try:
                _switch(engine, record, SwitchMode(record.switch_mode))
            except Exception as exc:
                reason = _reason(exc)
                # first of all: nothing is answered from another epoch, whatever fails next
                engine.hold(_held_reason(record.epoch_id, reason) if other else None)
                _failed[engine] = (tried, time.monotonic(), reason)
                log.error("switch to epoch %s failed: %s", record.epoch_id, reason)
                Epoch.objects.filter(pk=record.pk).update(message=reason)
                _apply_new_updates(engine)
                if explicit:
                    raise EpochSwitchError(reason) from exc
                return
        if _failed.pop(engine, None) is not None and record is not None:
            # switched since it failed: the record no longer shows that failure
            Epoch.objects.filter(pk=record.pk).exclude(message="").update(message="")
        _apply_new_updates(engine)
        engine.hold(None)  # it serves the active epoch (or the database has none)


def _held_reason(epoch_id: int, reason: str) -> str:
    """Why an engine refuses queries while it cannot serve the party's active epoch: answers from
    another epoch would disagree with the database and, once it has switched, the other party."""
    return (f"epoch {epoch_id} is this party's active epoch, but this engine cannot serve it "
            f"({reason}); it answers no query until it can: fix the cause (the epoch's placement "
            f"or switch mode in the admin, the file, the devices) or activate another epoch. It "
            f"tries again every {FAILED_SWITCH_BACKOFF:.0f} s, and at once after such a change")


def _placed_otherwise(engine, record: Epoch) -> bool:
    """Whether an engine of several devices serves `record`'s epoch placed otherwise than the
    record now says (an operator changed it, or the engine started from the file with auto):
    sync then loads it again as the record says, by its switch mode."""
    served = engine.placement  # what is in force: "single", "shard" or "replicate"
    if served == "single" or record.placement == engine.epoch.placement:
        return False
    return record.placement == Placement.AUTO or record.placement != served


def record_served_epoch(engine) -> Epoch | None:
    """Record the epoch an engine serves from its matrix file when the database has no active one.

    A fresh party (the demo matrix of `make run`, a new deployment) then lists the epoch it serves
    in the admin and /api/epochs/, and activating another one starts from it. Returns the record
    made, or None when there was nothing to record."""
    served = engine.epoch
    if served.matrix.source is None:
        return None  # a matrix built in memory: no file for other processes to load
    with transaction.atomic():
        if Epoch.objects.filter(Q(state=EpochState.ACTIVE) | Q(epoch_id=served.epoch_id)).exists():
            return None
        record = Epoch(
            epoch_id=served.epoch_id,
            matrix_path=os.path.abspath(served.matrix.source),
            block_number=served.block_number,
            state_root="0x" + served.state_root.hex(),
            seeds=list(served.seeds),
            domain_bits=engine_settings().domain_bits,
            num_pages=served.matrix.num_pages,
            # the file's size and digest as the engine checked them at load (its sidecar's)
            size_bytes=served.matrix.size_bytes,
            sha256=served.matrix.sha256 or "",
            state=EpochState.ACTIVE,
            activated=timezone.now(),
        )
        try:
            with transaction.atomic():
                record.save()
        except IntegrityError:
            return None  # another process of this party recorded it first
    log.info("recorded the served epoch %s (%s) as the active epoch", record.epoch_id,
             record.matrix_path)
    return record


def starting_epoch(**kwargs) -> ServedEpoch | None:
    """engine.signals.starting_epoch's receiver: the party's active epoch, loaded, so that an
    engine (re)started after a switch serves it at once instead of loading the matrix file of
    MORPHO_MATRIX_PATH first (the demo matrix under `make run`) and then switching. None where the
    database has no active epoch or cannot say (the file is served, and adopt() follows)."""
    try:
        record = Epoch.objects.active()
    except (DatabaseError, RuntimeError):
        return None  # not migrated yet, or no database access (tests): adopt() says so
    if record is None:
        return None
    try:
        return record.load()
    except (OSError, ValueError) as exc:  # missing, changed, outside the matrix folder
        # started from the file instead: sync() then holds the engine, saying why
        log.warning("epoch %s, the active epoch, cannot be loaded (%s); starting from the matrix "
                    "file", record.epoch_id, _reason(exc))
        return None


def adopt(engine, **kwargs) -> None:
    """Once an engine has started (engine.signals.engine_started's receiver): serve the
    database's epoch and updates before any query."""
    try:
        record_served_epoch(engine)
        sync(engine)
    except (DatabaseError, RuntimeError) as exc:
        # A server may start before `migrate` ran (or, in tests, without database access); it
        # then serves its matrix file as it is until the watcher finds the database.
        log.warning("epochs: database not ready (%s); serving the matrix file without updates", exc)
    # Changes made by other processes (another web worker, an admin, load_epoch) arrive through
    # the same per-process watcher that carries policy changes.
    watcher.register(WATCH_NAME, state_version, lambda version: apply_from_watcher(), check_now=False)


def activate(record: Epoch, mode: SwitchMode | None = None,
             placement: Placement | None = None) -> Epoch:
    """Make `record` the active epoch: switch this process's engine (if any) first, then commit
    the state change in one short transaction.

    When this process serves, a switch that cannot happen (the matrix does not fit beside the
    current one, the load fails) is raised before anything changes; so is one that another switch
    committed ahead of while this one loaded, and the engine then follows the database. Other
    processes follow within a second. `mode`: how to switch, when not the record's own
    switch_mode (which it then becomes); `placement` likewise, over the engine's devices.
    """
    if mode is not None:
        record.switch_mode = SwitchMode(mode)
    if placement is not None:
        record.placement = Placement(placement)
    if holder.is_remote():
        # The engine server switches its Engine and commits, as below, in its own process.
        _remote_call("activate", pk=record.pk, switch_mode=record.switch_mode,
                     placement=record.placement)
        record.refresh_from_db()
        return record
    engine = _local_engine()
    with _lock:
        if engine is not None:
            sync(engine)
        active = Epoch.objects.active()
        if active is not None:
            old_epoch_id = active.epoch_id
        elif engine is not None:
            old_epoch_id = engine.epoch.epoch_id
        else:
            try:
                old_epoch_id = current_epoch_shape()[0]
            except LookupError:
                old_epoch_id = None  # nothing served yet: no pending updates to carry over
        if record.epoch_id == old_epoch_id:
            raise EpochSwitchError(f"epoch {record.epoch_id} is already being served")
        loaded_against = _active_marks()
        if engine is not None:
            # Outside any transaction: a load takes as long as the matrix upload, and an open
            # write transaction is SQLite's database lock (IMMEDIATE mode), so bulk workers'
            # claims and lease renewals would wait for the whole upload. A load that fails has
            # changed nothing in the database.
            try:
                _switch(engine, record, SwitchMode(record.switch_mode),
                        _starting_rows(record, old_epoch_id))
            except Exception as exc:
                reason = _reason(exc)
                Epoch.objects.filter(pk=record.pk).update(message=reason)
                record.refresh_from_db()
                _apply_new_updates(engine)
                raise EpochSwitchError(reason) from exc
        try:
            _commit_switch(record, old_epoch_id, loaded_against)
        except Exception:
            if engine is not None:
                _follow_database(engine)
            raise
        if engine is not None:
            sync(engine)  # updates committed by other processes while this one switched
    return record


def _active_marks(lock: bool = False) -> list[tuple]:
    """(pk, activated) of the active epoch records: a switch committed elsewhere changes them."""
    records = Epoch.objects.filter(state=EpochState.ACTIVE)
    if lock:
        records = records.select_for_update()
    return sorted(records.values_list("pk", "activated"))


def _commit_switch(record: Epoch, old_epoch_id: int | None, loaded_against: list[tuple]) -> None:
    """The short transaction of a switch: carry over or discard the pending updates, retire the
    old epoch, activate `record`, unless another switch committed since `loaded_against` was read.
    """
    with transaction.atomic():
        # Row locks on PostgreSQL (SQLite's IMMEDIATE transaction already holds the database): a
        # second switch committing at the same time waits here, then finds the active records
        # changed and gives up, instead of both moving the same pending updates.
        if _active_marks(lock=True) != loaded_against:
            current = Epoch.objects.active()
            raise EpochSwitchError(
                f"another switch (to epoch {current.epoch_id if current else None}) committed "
                f"while epoch {record.epoch_id} loaded; nothing was changed by this one: activate "
                f"epoch {record.epoch_id} again if it is still wanted")
        pending = RowUpdate.objects.filter(epoch_id=old_epoch_id, state=UpdateState.PENDING)
        if record.pending_updates == PendingUpdates.ABSORB:
            # Absorbed updates are validated against the new shape: a row past its end is lost.
            bad = pending.filter(row__gte=(record.num_pages or 0) * ROWS_PER_PAGE)
            bad.update(state=UpdateState.DISCARDED)
            pending.update(epoch_id=record.epoch_id)
        else:
            pending.update(state=UpdateState.DISCARDED)
        Epoch.objects.filter(state=EpochState.ACTIVE).exclude(pk=record.pk).update(
            state=EpochState.RETIRED)
        record.state = EpochState.ACTIVE
        record.activated = timezone.now()
        record.message = ""
        record.save()


def _follow_database(engine) -> None:
    """After a switch whose commit failed, serve what the database says instead of the epoch
    just loaded (the watcher retries if the database cannot say now)."""
    try:
        sync(engine)
    except DatabaseError as exc:
        log.warning("epochs: cannot read the active epoch after a failed switch (%s); the watcher "
                    "retries", exc)


def save_updates(records: Sequence[RowUpdate]) -> None:
    """Store validated row updates in one transaction, then apply them to this process's engine.

    Returning means acknowledged: every answer this process starts from now on includes them.
    """
    engine = _local_engine()
    with _lock:
        with transaction.atomic():
            served = current_epoch_shape()[0]
            for update in records:
                if update.epoch_id != served:
                    # The epoch switched since the update was validated: it applies to the new one.
                    update.epoch_id = update.first_epoch_id = None
                    update.clean()
                if update.first_epoch_id is None:
                    update.first_epoch_id = update.epoch_id
                update.save()
        if engine is not None:
            sync(engine)
        elif holder.is_remote():
            _remote_call("sync")  # acknowledged once the engine server has applied them


def push_rows(rows: Sequence[tuple[int, object]], user=None) -> list[RowUpdate]:
    """Validate (row, data) pairs against the served epoch, store and apply them; all or none."""
    engine = _local_engine()
    with _lock:
        if engine is not None:
            sync(engine)  # validate against the epoch this process will apply them to
        records, errors = [], {}
        for index, (row, data) in enumerate(rows):
            update = RowUpdate(row=row, data=data.hex() if isinstance(data, bytes) else data,
                               created_by=user)
            try:
                update.full_clean(exclude=["epoch_id", "first_epoch_id"])
            except ValidationError as exc:
                errors[index] = exc.message_dict
            records.append(update)
        if errors:
            raise ValidationError(errors)
        save_updates(records)
    return records


def activate_by_pk(engine, args: dict) -> dict:
    """The engine server's "activate" control operation: activate() where the Engine is."""
    record = Epoch.objects.get(pk=args["pk"])
    mode, placement = args.get("switch_mode"), args.get("placement")
    activate(record, SwitchMode(mode) if mode else None, Placement(placement) if placement else None)
    return {"epoch_id": engine.epoch.epoch_id}


def sync_now(engine, args: dict) -> dict:
    """The engine server's "sync" control operation: apply the database's state now."""
    sync(engine, explicit=bool(args.get("explicit")))
    return {"epoch_id": engine.epoch.epoch_id}


def apply_from_watcher() -> None:
    """The watcher's apply function: follow a change another process made."""
    engine = _local_engine()
    if engine is not None:
        sync(engine)
