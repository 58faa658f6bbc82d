"""Queries from several threads while epochs switch and row updates land: every answer must equal
the NumPy reference for the epoch it names plus an update set it could have seen."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from rest_framework.test import APIClient

from epochs import sync
from epochs.models import Epoch
from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.matrix import ROW_BYTES, load_matrix, write_epoch_metadata, write_matrix_file
from engine.holder import get_engine

PAGES = 64
DOMAIN_BITS = 6
THREADS = 4
MIN_ANSWERS = 40  # answers checked, at the least


@dataclass
class Snapshot:
    """The state after one operator step; servable from `begin` until the next step's `acked`."""

    epoch_id: int
    rows: dict
    begin: float
    acked: float = float("inf")
    _matrix: object = field(default=None, repr=False)

    def matrix(self, paths):
        if self._matrix is None:
            self._matrix = load_matrix(paths[self.epoch_id])
            for row, data in self.rows.items():
                self._matrix.write_row(row, data)
        return self._matrix


@dataclass
class Observed:
    epoch_id: int
    keys: list  # per query, 3 DpfKeys
    pages: list  # per query, 3 answers
    started: float
    ended: float


def _query_loop(stop, results, errors, seed):
    # One client address per thread: each stays under the per-client rate limit.
    client = APIClient(REMOTE_ADDR=f"10.0.0.{seed + 1}")
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        batch = int(rng.integers(1, 3))
        keys = [[gen_keys(int(p), DOMAIN_BITS, rng=rng)[int(rng.integers(0, 2))]
                 for p in rng.integers(0, PAGES, 3)] for _ in range(batch)]
        body = {"queries": [{"keys": [k.to_bytes().hex() for k in q]} for q in keys]}
        started = time.monotonic()
        response = client.post("/query/page/gpu/batch", body, format="json")
        ended = time.monotonic()
        if response.status_code != 200:
            errors.append((response.status_code, response.content[:300]))
            continue
        data = response.json()
        pages = [[bytes.fromhex(p[2:]) for p in r["pages"]] for r in data["results"]]
        results.append(Observed(data["epoch_id"], keys, pages, started, ended))


def test_hammer_queries_while_epochs_switch_and_updates_land(db, serve_matrix, tmp_path):
    paths = {}
    for epoch_id in (1, 2, 3, 4):
        path = write_matrix_file(tmp_path / f"e{epoch_id}.bin", PAGES, seed=epoch_id)
        write_epoch_metadata(path, epoch_id=epoch_id)
        paths[epoch_id] = path
    serve_matrix(paths[1])
    get_engine()
    rng = np.random.default_rng(99)
    snapshots = [Snapshot(1, {}, begin=0.0)]

    def step(epoch_id, rows, action):
        snap = Snapshot(epoch_id, rows, begin=time.monotonic())
        action()
        acked = time.monotonic()
        snapshots[-1].acked = acked  # the previous state may be served until now, not after
        snapshots.append(snap)

    stop = threading.Event()
    results, errors = [], []
    threads = [threading.Thread(target=_query_loop, args=(stop, results, errors, s)) for s in range(THREADS)]
    for thread in threads:
        thread.start()
    try:
        plan = [(2, "absorb", "beside"), (3, "discard", "stop_the_world"), (4, "absorb", "beside")]
        for next_epoch, pending, mode in plan:
            for _ in range(6):
                time.sleep(0.03)
                row = int(rng.integers(0, 48))  # a small range, so rows are overwritten again
                data = rng.integers(0, 256, ROW_BYTES, dtype=np.uint8).tobytes()
                rows = {**snapshots[-1].rows, row: data}
                step(snapshots[-1].epoch_id, rows,
                     lambda row=row, data=data: sync.push_rows([(row, data)]))
            record = Epoch(epoch_id=next_epoch, matrix_path=str(paths[next_epoch]),
                           pending_updates=pending, switch_mode=mode)
            record.full_clean()
            record.save()
            kept = dict(snapshots[-1].rows) if pending == "absorb" else {}
            time.sleep(0.03)
            step(next_epoch, kept, lambda record=record: sync.activate(record))
        # The last state is served from here on: on a loaded machine the plan can end before
        # the threads have asked enough, so they go on until they have (at most 30 s).
        deadline = time.monotonic() + 30
        time.sleep(0.1)
        while len(results) < MIN_ANSWERS and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)

    assert not errors, errors[:3]
    assert len(results) >= MIN_ANSWERS, f"only {len(results)} answers"
    assert {r.epoch_id for r in results} >= {1, 4}
    references = {}
    matched_snapshots = set()
    for observed in results:
        candidates = [
            i for i, s in enumerate(snapshots)
            if s.epoch_id == observed.epoch_id and s.begin <= observed.ended and s.acked >= observed.started
        ]
        assert candidates, f"epoch {observed.epoch_id} answered outside its time"
        flat = [k for q in observed.keys for k in q]
        got = [p for q in observed.pages for p in q]
        for i in candidates:
            key = (i, id(observed))
            references[key] = reference_answers(snapshots[i].matrix(paths), KeyBatch.from_keys(flat))
            if [e.tobytes() for e in references[key]] == got:
                matched_snapshots.add(i)
                break
        else:
            pytest.fail(
                f"answer named epoch {observed.epoch_id} but matches none of the states it could "
                f"have seen ({candidates}); started {observed.started:.3f}, ended {observed.ended:.3f}")
    # The run must actually have exercised updates: answers saw several distinct states.
    assert len(matched_snapshots) >= 6, matched_snapshots
