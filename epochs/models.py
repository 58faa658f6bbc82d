"""Epoch records (a matrix file plus its metadata) and row updates pushed between epochs."""
from __future__ import annotations

import os

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from engine import holder
from engine.config import engine_settings
from epochs.matrix_files import (
    MatrixPathError, check_matrix_file, check_new_matrix, file_identity,
)
from gpu_engine.engine import EngineBusy, SwitchMode
from gpu_engine.placement import Placement
from gpu_engine.matrix import (
    PAGE_BYTES,
    ROW_BYTES,
    ROWS_PER_PAGE,
    MatrixChanged,
    ServedEpoch,
    domain_bits_for,
    load_matrix,
    read_epoch_metadata,
)
from morpho_pir.protocol import parse_hex

U64_MAX = (1 << 64) - 1


def default_seeds() -> list:
    return [0, 0, 0]


class EpochState(models.TextChoices):
    LOADED = "loaded", "loaded (not serving)"
    ACTIVE = "active", "active (serving)"
    RETIRED = "retired", "retired"


class PendingUpdates(models.TextChoices):
    ABSORB = "absorb", "absorb: pending row updates stay in force on the new epoch"
    DISCARD = "discard", "discard: the new epoch starts from its matrix file alone"


class EpochQuerySet(models.QuerySet):
    def active(self) -> Epoch | None:
        return self.filter(state=EpochState.ACTIVE).order_by("-activated", "-pk").first()


class Epoch(models.Model):
    """One immutable matrix file and the metadata a client needs (docs/PROTOCOL.md section 6)."""

    epoch_id = models.PositiveBigIntegerField(
        unique=True, help_text="The epoch_id clients see in /epoch and in every answer."
    )
    matrix_path = models.CharField(
        max_length=1024,
        help_text="Path of the matrix file inside the matrix directory (MORPHO_MATRIX_DIR), "
                  "readable by every web and worker process of this party; stored resolved.",
    )
    block_number = models.PositiveBigIntegerField(default=0)
    state_root = models.CharField(
        max_length=66, default="0x" + "00" * 32, help_text="32 bytes as hex (0x optional)."
    )
    seeds = models.JSONField(
        default=default_seeds, blank=True, help_text="The three cuckoo seeds, u64 each, e.g. [1, 2, 3]."
    )
    domain_bits = models.PositiveSmallIntegerField(
        null=True, blank=True,
        help_text="DPF tree depth; empty = the smallest that covers the matrix's pages.",
    )
    pending_updates = models.CharField(
        max_length=16, choices=PendingUpdates.choices, default=PendingUpdates.ABSORB,
        help_text="What happens to the row updates pending on the current epoch at the switch.",
    )
    switch_mode = models.CharField(
        max_length=16, choices=SwitchMode.choices(), default=SwitchMode.BESIDE.value,
        help_text="Stop-the-world is for a GPU that cannot hold both matrices at once.",
    )
    placement = models.CharField(
        max_length=16, choices=Placement.choices(), default=Placement.AUTO.value,
        help_text="How an engine of several devices (MORPHO_ENGINE_DEVICES) holds the pages: at "
                  "activation, and within a second for the active epoch (loaded again, as its "
                  "switch mode says). One device: no effect.",
    )
    state = models.CharField(
        max_length=16, choices=EpochState.choices, default=EpochState.LOADED, editable=False
    )
    num_pages = models.PositiveBigIntegerField(null=True, editable=False)
    size_bytes = models.PositiveBigIntegerField(
        null=True, editable=False,
        help_text="Size of the matrix file in bytes when recorded; checked at every load.",
    )
    sha256 = models.CharField(
        max_length=64, blank=True, editable=False,
        help_text="SHA-256 of the matrix file when recorded (from its sidecar, else computed); "
                  "a load of other bytes is refused, so one epoch_id never names two contents.",
    )
    message = models.TextField(
        blank=True, editable=False, help_text="Why the last switch to this epoch failed, if it did."
    )
    created = models.DateTimeField(auto_now_add=True)
    activated = models.DateTimeField(null=True, blank=True, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, editable=False, on_delete=models.SET_NULL,
        related_name="+",
    )

    objects = EpochQuerySet.as_manager()

    class Meta:
        ordering = ["-epoch_id"]

    def __str__(self) -> str:
        return f"epoch {self.epoch_id} (block {self.block_number})"

    @property
    def num_rows(self) -> int | None:
        return None if self.num_pages is None else self.num_pages * ROWS_PER_PAGE

    def clean(self) -> None:
        errors = {}
        if self.epoch_id is not None:
            clash = Epoch.objects.filter(epoch_id=self.epoch_id).exclude(pk=self.pk).first()
            if clash is not None:
                errors["epoch_id"] = (f"epoch_id {self.epoch_id} is already recorded "
                                      f"({clash.state}, {clash.matrix_path})")
        path = str(self.matrix_path or "").strip()
        self.matrix_path = path
        if not path:
            errors["matrix_path"] = "expected the path of a matrix file, got nothing"
        else:
            try:
                resolved, size = check_matrix_file(path)
                if self._new_path(resolved):
                    check_new_matrix(resolved, size)
            except MatrixPathError as exc:
                errors["matrix_path"] = str(exc)
            else:
                # The resolved path is what is loaded later: no symlink can be swapped in between.
                self.matrix_path = str(resolved)
                self.num_pages = -(-size // PAGE_BYTES)
                problem = self._record_identity(resolved, size)
                if problem:
                    errors["matrix_path"] = problem
        try:
            self.state_root = "0x" + parse_hex(self.state_root, 32).hex()
        except ValueError as exc:
            errors["state_root"] = f"state_root {self.state_root!r}: {exc}"
        seeds = self.seeds if self.seeds not in (None, "", []) else default_seeds()
        if (not isinstance(seeds, list) or len(seeds) != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
                or not all(0 <= s <= U64_MAX for s in seeds)):
            errors["seeds"] = f"expected three integers in 0..{U64_MAX}, got {seeds!r}"
        else:
            self.seeds = seeds
        if self.domain_bits is not None and self.num_pages and "matrix_path" not in errors:
            try:
                domain_bits_for(self.num_pages, self.domain_bits)
            except ValueError as exc:
                errors["domain_bits"] = str(exc)
        if errors:
            raise ValidationError(errors)

    def _new_path(self, path) -> bool:
        """Whether this record is new or is being given another file than the one it has."""
        if self.pk is None:
            return True
        recorded = Epoch.objects.filter(pk=self.pk).values_list("matrix_path", flat=True).first()
        return recorded != str(path)

    def _record_identity(self, path, size: int) -> str | None:
        """Record the file's size and SHA-256 once; afterwards the file must keep that size."""
        recorded_path = None
        if self.pk is not None:
            recorded_path = (Epoch.objects.filter(pk=self.pk)
                             .values_list("matrix_path", flat=True).first())
        if self.sha256 and recorded_path == str(path):
            if self.size_bytes is not None and size != self.size_bytes:
                return (f"matrix file {str(path)!r} changed since epoch {self.epoch_id} was "
                        f"recorded: {size} bytes, expected {self.size_bytes}")
            return None
        self.size_bytes, self.sha256 = file_identity(path, size)
        return None

    def load(self) -> ServedEpoch:
        """This record as the engine serves it (a ServedEpoch): the file read into memory and
        checked against the size and SHA-256 recorded with it (MatrixChanged, a ValueError, when
        it differs)."""
        # Checked again: the directory setting or a folder on the way may have changed since.
        path, _ = check_matrix_file(self.matrix_path)
        matrix = load_matrix(path, self.domain_bits, size_bytes=self.size_bytes,
                             sha256=self.sha256 or None)
        if not self.sha256:
            # Recorded before digests were: the first load pins what this epoch_id serves.
            Epoch.objects.filter(pk=self.pk, sha256="").update(
                size_bytes=matrix.size_bytes, sha256=matrix.sha256)
            pinned = Epoch.objects.filter(pk=self.pk).values_list("sha256", flat=True).first()
            if pinned and pinned != matrix.sha256:
                raise MatrixChanged(f"matrix file {path} changed since epoch {self.epoch_id} was "
                                    f"first loaded: sha256 {matrix.sha256}, expected {pinned}")
            self.size_bytes, self.sha256 = matrix.size_bytes, matrix.sha256
        return ServedEpoch(
            epoch_id=self.epoch_id,
            matrix=matrix,
            block_number=self.block_number,
            state_root=parse_hex(self.state_root, 32),
            seeds=tuple(self.seeds or (0, 0, 0)),
            placement=self.placement,
        )


class UpdateState(models.TextChoices):
    PENDING = "pending", "pending (in force)"
    DISCARDED = "discarded", "discarded at an epoch switch"


class RowUpdate(models.Model):
    """Row `row` of epoch `epoch_id` reads as `data` (256 bytes) from the moment it is acknowledged."""

    epoch_id = models.PositiveBigIntegerField(
        db_index=True, editable=False,
        help_text="The epoch this update is in force on (the one served when it was pushed, or "
                  "a later one that absorbed it).",
    )
    first_epoch_id = models.PositiveBigIntegerField(editable=False, null=True)
    row = models.PositiveBigIntegerField(help_text="Row index: page row // 16, slot row % 16.")
    data = models.CharField(max_length=514, help_text="The row's new 256 bytes as hex (0x optional).")
    state = models.CharField(
        max_length=16, choices=UpdateState.choices, default=UpdateState.PENDING, editable=False
    )
    created = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, editable=False, on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        ordering = ["-pk"]
        indexes = [models.Index(fields=["epoch_id", "state"])]

    def __str__(self) -> str:
        return f"row {self.row} of epoch {self.epoch_id}"

    @property
    def data_bytes(self) -> bytes:
        return parse_hex(self.data, ROW_BYTES)

    def clean(self) -> None:
        errors = {}
        try:
            self.data = "0x" + parse_hex(self.data or "", ROW_BYTES).hex()
        except ValueError as exc:
            errors["data"] = f"row data: {exc}"
        try:
            # An update applies to the epoch served now, unless it was created for another.
            self.epoch_id, num_rows = current_epoch_shape(self.epoch_id)
        except LookupError as exc:
            raise ValidationError({"row": str(exc)}) from None
        if self.first_epoch_id is None:
            self.first_epoch_id = self.epoch_id
        if self.row is not None and not 0 <= self.row < num_rows:
            errors["row"] = (
                f"row {self.row} is outside epoch {self.epoch_id}'s rows 0..{num_rows - 1} "
                f"({num_rows // ROWS_PER_PAGE} pages of {ROWS_PER_PAGE} rows)"
            )
        if errors:
            raise ValidationError(errors)


def _served_engine():
    """Whatever this process reads the served epoch from: its Engine or the engine server."""
    engine = holder.peek_engine()
    if engine is None and holder.is_remote():
        engine = holder.get_engine()
    return engine


def current_epoch_shape(epoch_id: int | None = None) -> tuple[int, int]:
    """(epoch_id, num_rows) of the epoch served now, or of `epoch_id`; LookupError if unknown."""
    record = Epoch.objects.active() if epoch_id is None else Epoch.objects.filter(epoch_id=epoch_id).first()
    if record is not None and record.num_pages:
        return record.epoch_id, record.num_rows
    engine = _served_engine()
    if engine is not None:
        try:
            served = engine.epoch
        except EngineBusy as exc:
            raise LookupError(f"no epoch is being served: {exc.reason}") from None
        if epoch_id is None or served.epoch_id == epoch_id:
            return served.epoch_id, served.matrix.num_rows
        if holder.is_remote():
            raise LookupError(f"epoch {epoch_id} is not known to this server")
    # No engine in this process (a Celery worker, manage.py): the file and its sidecar say, without
    # reading the whole matrix.
    path = engine_settings().matrix_path
    try:
        size = os.path.getsize(path)
        served_id = int(read_epoch_metadata(path).get("epoch_id", 1))
    except (OSError, ValueError) as exc:
        raise LookupError(f"no epoch is being served: {exc}") from None
    if size == 0:
        raise LookupError(
            f"no epoch is being served: matrix file {path} is empty"
        )
    if epoch_id is not None and served_id != epoch_id:
        raise LookupError(f"epoch {epoch_id} is not known to this server")
    return served_id, -(-size // PAGE_BYTES) * ROWS_PER_PAGE
