"""One epoch over several devices of a host: sharded (each device a range of pages) or replicated."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from gpu_engine.backends.base import (
    Backend,
    DispatchShape,
    KeysRefused,
    PendingAnswer,
    ProgressFn,
    ResidentMatrix,
)
from gpu_engine.backends.cpu import NumpyBackend, default_workers
from gpu_engine.backends.factory import create_backend
from gpu_engine.choices import LabelledChoice
from morpho_pir.dpf import KeyBatch, subtree_keys_many
from gpu_engine.matrix import MatrixShape, PageMatrix
from morpho_pir.protocol import LEAF_PAGES, ROWS_PER_PAGE

log = logging.getLogger(__name__)

# Shard boundaries fall on multiples of a v2 leaf's pages, so every shard's subtrees are whole
# leaves of both key formats (a v2 leaf selects among 128 pages and cannot be split).
GRAIN_PAGES = LEAF_PAGES
# The default boundaries round the even split to 1/(8 x devices) of the pages' own domain: each
# device's pages are then a few aligned subtrees (launches per batch: at most 5 over 1..5000 pages
# and 1..8 devices), and the largest shard holds at most about a quarter more than an even share
# (1.23x measured at 267,192 pages over 8 devices; powers of two split evenly).
SPLITS_PER_DEVICE = 8
BATCHES_PER_DEVICE = 2  # batches a device holds started and not collected (CUDA keeps two buffers)


class Placement(LabelledChoice):
    """How an epoch's pages are placed over an engine's devices (also `load_epoch --placement`)."""

    AUTO = "auto", "auto: shard where one device cannot hold the matrix twice, else replicate"
    SHARD = "shard", "shard: each device holds a range of pages; every batch runs on every device"
    REPLICATE = "replicate", "replicate: each device holds every page; a batch runs on one device"


class PlacementError(ValueError):
    """An epoch cannot be placed over these devices as asked (a matrix too small to shard); the
    message says why and what to choose instead."""


class DeviceFailed(RuntimeError):
    """A device of a group failed; the group answers nothing more (never a partial answer)."""


@dataclass(frozen=True)
class Subtree:
    """Pages [first, stop) under node `index` of tree level `level`: what one launch scans."""

    level: int
    index: int
    first: int
    stop: int


def shard_bounds(num_pages: int, domain_bits: int, devices: int) -> List[int]:
    """Balanced page boundaries [0, b1, ..., num_pages] for `devices` shards: the even split,
    rounded to 1/(SPLITS_PER_DEVICE x devices) of the smallest domain that holds the pages (so a
    domain_bits configured larger changes nothing), or to GRAIN_PAGES where that coarser step
    would leave a device nothing. `domain_bits` is the epoch's, at least the pages' own."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if num_pages > (1 << domain_bits):
        raise ValueError(f"{num_pages} pages do not fit a domain of 2**{domain_bits}")
    own_domain = 1 << max(0, (num_pages - 1).bit_length())  # aligned subtrees do not depend on d
    step = max(GRAIN_PAGES, own_domain // (1 << (SPLITS_PER_DEVICE * devices - 1).bit_length()))
    bounds = [0, *(min(num_pages, round(num_pages * i / devices / step) * step)
                   for i in range(1, devices)), num_pages]
    if any(high <= low for low, high in zip(bounds, bounds[1:])):
        # a few pages a device: whole groups shared out evenly (the last one may be partial)
        groups = -(-num_pages // GRAIN_PAGES)
        bounds = [0, *(min(num_pages, round(groups * i / devices) * GRAIN_PAGES)
                       for i in range(1, devices)), num_pages]
    check_bounds(bounds, num_pages)
    return bounds


def check_bounds(bounds: Sequence[int], num_pages: int) -> None:
    """Boundaries must run from 0 to num_pages, rise, and fall on multiples of GRAIN_PAGES."""
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_pages:
        raise PlacementError(f"shard boundaries must run from 0 to {num_pages}, got {list(bounds)}")
    for low, high in zip(bounds, bounds[1:]):
        if high <= low:
            raise PlacementError(f"{num_pages} pages cannot give each of {len(bounds) - 1} devices "
                             f"a shard of whole {GRAIN_PAGES}-page groups (boundaries "
                             f"{list(bounds)}): replicate it instead")
    if any(b % GRAIN_PAGES for b in bounds[1:-1]):
        raise PlacementError(f"shard boundaries must be multiples of {GRAIN_PAGES} pages, got "
                         f"{list(bounds)}")


def subtrees(first: int, stop: int, num_pages: int, domain_bits: int) -> List[Subtree]:
    """The fewest aligned subtrees that cover pages [first, stop), each of at least GRAIN_PAGES
    pages (or the whole domain): as large as its start's alignment allows, within the range; the
    range that ends the matrix takes the largest its start's alignment allows, since pages past
    num_pages are not held and take no part in an answer. Larger subtrees sit higher in the tree:
    the host derives a subtree's keys one level at a time (about a millisecond a level in NumPy),
    so the tail of the mainnet shape is a level-1 subtree, not a level-9 one."""
    domain = 1 << domain_bits
    out, page = [], first
    while page < stop:
        size = page & -page if page else domain  # the largest subtree aligned at `page`
        if stop != num_pages:
            while page + size > stop:
                size //= 2
        level = domain_bits - size.bit_length() + 1
        out.append(Subtree(level, page // size, page, min(page + size, num_pages)))
        page += size
    return out


class _DeviceClock:
    """Launches and busy seconds of one device: a batch counts from its start, or from the end
    of the batch before it on that device where that came later, to its collection (the rule the
    engine's cost model uses), so batches queued behind each other are not counted twice."""

    def __init__(self) -> None:
        self.launches = 0
        self.busy_s = 0.0
        self._last_end = 0.0
        self._lock = threading.Lock()

    def started(self) -> float:
        with self._lock:
            self.launches += 1
        return time.perf_counter()

    def collected(self, started: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self.busy_s += max(0.0, now - max(started, self._last_end))
            self._last_end = max(self._last_end, now)


class _Xor(PendingAnswer):
    """A batch started on every shard; result() XORs the shards' partial answers."""

    def __init__(self, group: "ShardedResident", parts: List[Tuple[int, float, PendingAnswer]]) -> None:
        self._group, self._parts = group, parts
        self._answers: Optional[np.ndarray] = None

    def result(self) -> np.ndarray:
        if self._answers is None:
            answers = None
            for device, started, pending in self._parts:
                part = self._group.guarded(device, pending.result)
                self._group.clocks[device].collected(started)
                if answers is None:
                    answers = np.array(part, dtype=np.uint8, copy=True)
                else:
                    np.bitwise_xor(answers.view(np.uint64), part.view(np.uint64),
                                   out=answers.view(np.uint64))
            self._answers = answers
        return self._answers


class _OnReplica:
    """One batch placed on one replica: its launches (one per key format) and when it started."""

    def __init__(self, device: int, started: float, launches: int) -> None:
        self.device, self.started, self.left = device, started, launches


class _Placed(PendingAnswer):
    """One launch of a batch on a replica; once the batch's last launch is collected, the replica
    counts one batch fewer outstanding."""

    def __init__(self, group: "ReplicatedResident", batch: _OnReplica, pending: PendingAnswer) -> None:
        self._group, self._batch, self._pending = group, batch, pending
        self._collected = False

    def result(self) -> np.ndarray:
        try:
            return self._group.guarded(self._batch.device, self._pending.result)
        finally:
            if not self._collected:  # counted once, however often its answers are asked for
                self._collected = True
                self._group.collected(self._batch)


class PlacedResident(ResidentMatrix):
    """An epoch's matrix held by a group of devices; one failed device fails every later batch
    with DeviceFailed (a 503 with its reason), never with a partial answer."""

    placement: Placement
    max_in_flight = BATCHES_PER_DEVICE

    def __init__(self, matrix: PageMatrix, names: Sequence[str]) -> None:
        super().__init__(matrix)
        self.shape = MatrixShape(matrix.num_pages, matrix.domain_bits)  # checks row writes
        self.names = list(names)
        self.failure: Optional[str] = None
        self.clocks = [_DeviceClock() for _ in self.names]

    def guarded(self, device: int, action):
        """Run `action` for `device`; a failure marks the group failed and says which device."""
        if self.failure:
            raise DeviceFailed(self.failure)
        try:
            return action()
        except KeysRefused:  # a device's check of the caller's keys: no fault of the device
            raise
        except Exception as exc:
            self.failure = self.failure or f"device {self.names[device]} failed: {exc}"
            log.error("%s; this epoch's devices answer nothing more", self.failure)
            raise DeviceFailed(self.failure) from exc

    def answer(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> np.ndarray:
        return self.start(keys, dispatch).result()

    def release(self) -> None:
        """Free every device's part, each whatever the others do (a lost GPU may fail its own)."""
        for device, resident in self._parts_to_release():
            try:
                resident.release()
            except Exception:  # noqa: BLE001 - the rest must still be freed
                log.exception("releasing this epoch's pages on %s failed", self.names[device])

    def describe(self) -> dict:
        """Where the pages are, as /health and the dashboard show it."""
        return {"placement": self.placement.value, "devices": self.devices(), "failure": self.failure}

    def devices(self) -> List[dict]:
        """Each device: its name, pages [first_page, stop_page), resident bytes, launches and
        busy seconds."""
        return [{"device": name, **self._holds(i), "launches": self.clocks[i].launches,
                 "busy_seconds": self.clocks[i].busy_s} for i, name in enumerate(self.names)]

    def _holds(self, device: int) -> dict:
        raise NotImplementedError


class ShardedResident(PlacedResident):
    """Each device holds a contiguous range of pages; a batch runs on every device with keys for
    its subtrees, and the partial answers are XORed on the host."""

    placement = Placement.SHARD

    def __init__(self, matrix: PageMatrix, devices: Sequence[Backend], names: Sequence[str],
                 bounds: Sequence[int]) -> None:
        """`bounds`: device i holds pages [bounds[i], bounds[i + 1]), as DeviceGroup.plan checked."""
        super().__init__(matrix, names)
        self.bounds = list(bounds)
        # (device, subtree, its pages resident on that device), in page order
        self.parts: List[Tuple[int, Subtree, ResidentMatrix]] = []
        try:
            for device, backend in enumerate(devices):
                for tree in subtrees(bounds[device], bounds[device + 1], matrix.num_pages,
                                     matrix.domain_bits):
                    part = matrix.pages(tree.first, tree.stop, matrix.domain_bits - tree.level)
                    self.parts.append((device, tree, backend.load(part)))
        except Exception:
            self.release()
            raise

    @property
    def nbytes(self) -> int:
        return sum(resident.nbytes for _, _, resident in self.parts)

    def start(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> PendingAnswer:
        self.check_keys(keys)
        started: List[Tuple[int, float, PendingAnswer]] = []
        subs = subtree_keys_many(keys, [(tree.level, tree.index) for _, tree, _ in self.parts])
        for (device, tree, resident), sub in zip(self.parts, subs):
            at = self.clocks[device].started()
            started.append((device, at, self.guarded(device, lambda r=resident, s=sub: r.start(s, dispatch))))
        return _Xor(self, started)

    def write_rows(self, rows: Mapping[int, bytes]) -> None:
        self.shape.check_rows(rows)
        for device, tree, resident in self.parts:
            low, high = tree.first * ROWS_PER_PAGE, tree.stop * ROWS_PER_PAGE
            mine = {row - low: data for row, data in rows.items() if low <= row < high}
            if mine:
                self.guarded(device, lambda r=resident, m=mine: r.write_rows(m))

    def _parts_to_release(self) -> List[Tuple[int, ResidentMatrix]]:
        parts, self.parts = self.parts, []
        return [(device, resident) for device, _, resident in parts]

    def _holds(self, device: int) -> dict:
        held = [r for d, _, r in self.parts if d == device]
        return {"first_page": self.bounds[device], "stop_page": self.bounds[device + 1],
                "resident_bytes": sum(r.nbytes for r in held), "subtrees": len(held)}


class ReplicatedResident(PlacedResident):
    """Every device holds every page; each batch runs on the device that frees first (the one
    with the fewest batches outstanding, then the one whose oldest started first)."""

    placement = Placement.REPLICATE

    def __init__(self, matrix: PageMatrix, devices: Sequence[Backend], names: Sequence[str]) -> None:
        super().__init__(matrix, names)
        self.replicas: List[ResidentMatrix] = []
        try:
            for backend in devices:
                self.replicas.append(backend.load(matrix))
        except Exception:
            self.release()
            raise
        self.max_in_flight = BATCHES_PER_DEVICE * len(self.replicas)
        self._lock = threading.Lock()
        self._outstanding: List[List[_OnReplica]] = [[] for _ in self.replicas]  # oldest first

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.replicas)

    def _pick(self) -> int:
        return min(range(len(self.replicas)), key=lambda i: (
            len(self._outstanding[i]), self._outstanding[i][0].started if self._outstanding[i] else 0.0, i))

    def start(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> PendingAnswer:
        return self.start_parts([keys], dispatch)[0]

    def start_parts(self, parts: Sequence[KeyBatch], dispatch: DispatchShape = DispatchShape()
                    ) -> List[PendingAnswer]:
        """A batch's launches (one per key format) all on one replica: a device then holds at
        most BATCHES_PER_DEVICE batches, as CUDA's buffers per batch shape allow. The replica's
        own check (check_keys) refuses keys it cannot answer."""
        with self._lock:
            device = self._pick()
            batch = _OnReplica(device, self.clocks[device].started(), len(parts))
            self._outstanding[device].append(batch)
        started = []
        try:
            for keys in parts:
                started.append(_Placed(self, batch, self.guarded(
                    device, lambda k=keys: self.replicas[device].start(k, dispatch))))
        except Exception:
            for _ in range(len(parts) - len(started)):
                self.collected(batch)  # the launches that never started
            for placed in started:  # and those that did: collected, whatever they say
                try:
                    placed.result()
                except Exception:  # noqa: BLE001 - the failure raised below says it
                    pass
            raise
        return started

    def collected(self, batch: _OnReplica) -> None:
        with self._lock:
            batch.left -= 1
            if batch.left == 0:
                self.clocks[batch.device].collected(batch.started)
                self._outstanding[batch.device].remove(batch)

    def each_copy(self) -> List[ResidentMatrix]:
        return list(self.replicas)  # a warm-up compiles and captures on every device

    def write_rows(self, rows: Mapping[int, bytes]) -> None:
        # a replica left behind would answer from other pages: its failure fails the group
        self.shape.check_rows(rows)
        rows = dict(rows)
        for device, replica in enumerate(self.replicas):
            self.guarded(device, lambda r=replica: r.write_rows(rows))

    def _parts_to_release(self) -> List[Tuple[int, ResidentMatrix]]:
        replicas, self.replicas = self.replicas, []
        return list(enumerate(replicas))

    def _holds(self, device: int) -> dict:
        held = self.replicas[device].nbytes if device < len(self.replicas) else 0
        return {"first_page": 0, "stop_page": self.num_pages, "resident_bytes": held}


def choose_placement(placement: str, matrix_bytes: int, num_pages: int, domain_bits: int,
                     devices: Sequence[Backend]) -> Placement:
    """The placement `placement` names; for auto, shard where the smallest device cannot hold the
    matrix twice (an epoch switch loads the next one beside it) and the pages split into whole
    groups, else replicate. Devices that do not say their memory (the CPU) replicate."""
    chosen = Placement(placement)
    if chosen is not Placement.AUTO:
        return chosen
    totals = [backend.memory_info().get("total_bytes") for backend in devices]
    if len(devices) < 2 or any(total is None for total in totals):
        return Placement.REPLICATE
    try:
        shard_bounds(num_pages, domain_bits, len(devices))
    except ValueError:
        return Placement.REPLICATE
    return Placement.SHARD if 2 * matrix_bytes > min(totals) else Placement.REPLICATE


class DeviceGroup(Backend):
    """Several devices of one host as one backend: load() places an epoch over them."""

    def __init__(self, devices: Sequence[Backend], names: Sequence[str]) -> None:
        super().__init__()
        if not devices or len(devices) != len(names):
            raise ValueError(f"a device group needs devices, each named: {len(devices)} devices, "
                             f"{len(names)} names")
        self.devices, self.names = list(devices), list(names)
        self.name = devices[0].name
        self.warm_all_shapes = devices[0].warm_all_shapes
        self.key_formats = devices[0].key_formats
        # a launch runs on every device of a shard, or on any one replica: what all of them
        # serve in one pass
        self.pass_queries = min(backend.pass_queries for backend in devices)
        self.fallback_reason = devices[0].fallback_reason
        self.layout, self.layout_reason = devices[0].layout, devices[0].layout_reason

    def plan(self, matrix: PageMatrix, placement: str = Placement.AUTO,
             bounds: Optional[Sequence[int]] = None) -> Tuple[Placement, Optional[List[int]]]:
        """What `placement` comes to for `matrix` over these devices, with a shard's page
        boundaries (`bounds`, else balanced ones); PlacementError where it cannot be made.
        Nothing is loaded or freed."""
        chosen = choose_placement(placement, matrix.nbytes, matrix.num_pages, matrix.domain_bits,
                                  self.devices)
        if chosen is not Placement.SHARD:
            return chosen, None
        bounds = list(bounds) if bounds is not None else shard_bounds(
            matrix.num_pages, matrix.domain_bits, len(self.devices))
        if len(bounds) != len(self.devices) + 1:
            raise PlacementError(f"{len(self.devices)} devices need {len(self.devices) + 1} "
                                 f"boundaries, got {bounds}")
        check_bounds(bounds, matrix.num_pages)
        return chosen, bounds

    def load(self, matrix: PageMatrix, progress: Optional[ProgressFn] = None,
             placement: str = Placement.AUTO, bounds: Optional[Sequence[int]] = None) -> PlacedResident:
        chosen, bounds = self.plan(matrix, placement, bounds)
        log.info("placing %d pages over %s: %s", matrix.num_pages, ", ".join(self.names), chosen.value)
        if chosen is Placement.SHARD:
            resident: PlacedResident = ShardedResident(matrix, self.devices, self.names, bounds)
        else:
            resident = ReplicatedResident(matrix, self.devices, self.names)
        if progress:
            progress(matrix.nbytes, matrix.nbytes)
        return resident

    def memory_info(self) -> dict:
        infos = [backend.memory_info() for backend in self.devices]

        def total(field: str):
            values = [info.get(field) for info in infos]
            return None if any(v is None for v in values) else sum(values)

        return {"device": ", ".join(f"{name}: {info['device']}" for name, info in zip(self.names, infos)),
                "used_bytes": total("used_bytes"), "total_bytes": total("total_bytes"),
                "devices": [{**info, "device": name, "model": info["device"]}
                            for name, info in zip(self.names, infos)]}


def check_placeable(backend: Backend, epoch) -> None:
    """Raise PlacementError where `epoch` cannot be placed over `backend`'s devices as it asks,
    before anything is freed or loaded (a stop-the-world switch frees the current epoch first)."""
    if isinstance(backend, DeviceGroup):
        backend.plan(epoch.matrix, epoch.placement)


def load_placed(backend: Backend, epoch) -> ResidentMatrix:
    """Make a ServedEpoch's matrix resident: over a DeviceGroup's devices as its placement says,
    else on the backend's one device (where every placement is the same)."""
    placement = Placement(epoch.placement)  # a bad value is refused wherever it is served
    if isinstance(backend, DeviceGroup):
        return backend.load(epoch.matrix, placement=placement)
    return backend.load(epoch.matrix)


def describe_placement(resident: ResidentMatrix) -> dict:
    """Where a resident matrix's pages are: a group's describe(), or one device."""
    if isinstance(resident, PlacedResident):
        return resident.describe()
    return {"placement": "single", "devices": [], "failure": None}


def parse_devices(text: str) -> List[int]:
    """Device ids from "0,1,3" (MORPHO_ENGINE_DEVICES, serve_engine --devices); [] for ""."""
    if not text.strip():
        return []
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"expected device ids separated by commas, e.g. 0,1, got {text!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"expected distinct device ids >= 0, got {text!r}")
    return ids


def create_device_group(backend_name: str, ids: Sequence[int], v2_scan: str = "auto",
                        layout: str = "auto") -> DeviceGroup:
    """One backend per device id as a DeviceGroup: GPUs cuda:ID for CUDA; for the CPU backend,
    as many simulated devices (the host's scan threads shared among them), so the placement
    logic runs, and is tested, where there is no GPU."""
    if not ids:
        raise ValueError("a device group needs at least one device id")
    first = create_backend(backend_name, device=ids[0], v2_scan=v2_scan, layout=layout)
    if first.name == "cpu":
        workers = max(1, default_workers() // len(ids))
        devices: List[Backend] = [NumpyBackend(workers) for _ in ids]
        devices[0].fallback_reason = first.fallback_reason
    else:
        devices = [first] + [create_backend("cuda", device=i, v2_scan=v2_scan, layout=layout)
                              for i in ids[1:]]
    return DeviceGroup(devices, [f"{first.name}:{i}" for i in ids])
