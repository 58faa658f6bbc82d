"""`manage.py load_epoch PATH`: record a new epoch for a matrix file and, optionally, activate it."""
from __future__ import annotations

import json

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from engine import holder
from epochs import sync
from epochs.matrix_files import MatrixPathError, confine
from epochs.models import Epoch, EpochState, PendingUpdates, current_epoch_shape
from gpu_engine.engine import EngineBusy, SwitchMode
from gpu_engine.matrix import metadata_path
from gpu_engine.placement import Placement
from morphoweb.dbready import EPOCHS_HINT, ReadyDatabaseMixin


class Command(ReadyDatabaseMixin, BaseCommand):
    help = ("Record a matrix file as a new epoch (metadata from flags, else from its "
            "<path>.epoch.json sidecar) and, with --activate, switch this party to it (refused, "
            "with what to do, when the database of DATABASE_URL is missing or not migrated).")
    database_hint = EPOCHS_HINT

    def add_arguments(self, parser):
        parser.add_argument("path", help="matrix file inside the matrix directory (MORPHO_MATRIX_DIR), "
                                         "readable by every web and worker process")
        parser.add_argument("--epoch-id", type=int, help="default: the sidecar's, else the highest + 1")
        parser.add_argument("--block-number", type=int)
        parser.add_argument("--state-root", help="32 bytes as hex")
        parser.add_argument("--seeds", type=int, nargs=3, metavar="SEED")
        parser.add_argument("--domain-bits", type=int)
        parser.add_argument("--discard-updates", action="store_true",
                            help="drop the row updates pending on the current epoch (default: absorb)")
        parser.add_argument("--stop-the-world", action="store_true",
                            help="free the current epoch before loading this one (GPU too small for both)")
        parser.add_argument("--placement", choices=[p.value for p in Placement], default=Placement.AUTO.value,
                            help="how an engine of several devices holds the pages: shard, "
                                 "replicate, or auto (shard where one device cannot hold the "
                                 "matrix twice)")
        parser.add_argument("--activate", action="store_true", help="make it the active epoch now")

    def handle(self, *args, path, **options):
        try:
            # Before the sidecar is read: nothing outside the matrix directory is opened.
            path = str(confine(path))
        except MatrixPathError as exc:
            raise CommandError(f"matrix_path: {exc}") from None
        sidecar = metadata_path(path)
        meta = json.loads(sidecar.read_text()) if sidecar.exists() else {}
        epoch_id = options["epoch_id"]
        if epoch_id is None:
            epoch_id = meta.get("epoch_id")
        if epoch_id is None:
            last = Epoch.objects.order_by("-epoch_id").values_list("epoch_id", flat=True).first()
            epoch_id = (last if last is not None else current_epoch_shape()[0]) + 1
        record = Epoch(
            epoch_id=epoch_id,
            matrix_path=path,
            block_number=_pick(options["block_number"], meta.get("block_number"), 0),
            state_root=_pick(options["state_root"], meta.get("state_root"), "0x" + "00" * 32),
            seeds=list(_pick(options["seeds"], meta.get("seeds"), [0, 0, 0])),
            domain_bits=options["domain_bits"],
            pending_updates=PendingUpdates.DISCARD if options["discard_updates"] else PendingUpdates.ABSORB,
            switch_mode=SwitchMode.STOP_THE_WORLD if options["stop_the_world"] else SwitchMode.BESIDE,
            placement=options["placement"],
        )
        try:
            record.full_clean()
        except ValidationError as exc:
            raise CommandError("; ".join(f"{field}: {' '.join(msgs)}"
                                         for field, msgs in exc.message_dict.items())) from None
        record.save()
        recorded = (f"recorded epoch {record.epoch_id}: {record.num_pages} pages from "
                    f"{record.matrix_path} (block {record.block_number})")
        if options["activate"]:
            try:
                sync.activate(record)
            except (sync.EpochSwitchError, EngineBusy) as exc:
                # Refused before it served anything (the switch failed, or the party's engine
                # server is not running): the record goes as well, so the same command,
                # corrected, can run again.
                Epoch.objects.filter(pk=record.pk, state=EpochState.LOADED).delete()
                raise CommandError(f"epoch {record.epoch_id} was neither activated nor recorded: "
                                   f"{exc}") from None
            self.stdout.write(recorded)
            self.stdout.write(f"epoch {record.epoch_id} is active; every engine of this party "
                              f"switches to it within a second")
            if holder.peek_engine() is None:
                self.stderr.write(
                    "no engine runs in this process, so nothing checked that this party's engines "
                    "can serve it: one that cannot answers 503 saying why (GET /health). Give "
                    "load_epoch the party's MORPHO_ENGINE_URL to switch through its engine server "
                    "first, so that a switch it cannot make is refused before it is recorded.")
        else:
            self.stdout.write(recorded)


def _pick(*values):
    return next(v for v in values if v is not None)
