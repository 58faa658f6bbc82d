"""Bulk jobs (docs/PROTOCOL.md section 5.5): one job per party, resumable through a state file,
their result lines combined only where both name one epoch and served state."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import AsyncIterator, Callable, Optional, Sequence

from morpho_pir.http import NDJSON
from morpho_pir.protocol import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE

from morpho_client.core import EpochMismatch, PirError, ServerError, StateMismatch
from morpho_client.plan import BulkState, StateError, parse_result_line

TOKEN_ENV = ("MORPHO_TOKEN_A", "MORPHO_TOKEN_B")  # bulk job tokens when none is passed


def bulk_tokens(tokens: Sequence[Optional[str]]) -> tuple[str, str]:
    chosen = tuple(token or os.environ.get(env, "") for token, env in zip(tokens, TOKEN_ENV))
    missing = [party for party, token in zip("AB", chosen) if not token]
    if missing:
        raise PirError(
            f"bulk jobs need a DRF token for each party; none for {' and '.join(missing)}: "
            f"pass --token-a/--token-b or set {TOKEN_ENV[0]}/{TOKEN_ENV[1]} "
            "(`make superuser` prints one per party)"
        )
    return chosen


def answered(job: dict):
    """Queries a job has answered, launch by launch (its `progress`), else as stored."""
    return (job.get("progress") or {}).get("answered", job.get("answered"))


def line_state(line: dict):
    """(epoch_id, updates, digest) a result line was answered from; its `state` may be absent
    (a server older than per-line states), then the epoch alone."""
    state = line.get("state")
    if isinstance(state, dict):
        return line["epoch_id"], state.get("updates"), str(state.get("digest", "")).lower()
    return line["epoch_id"], None, None


class BulkJobs:
    """The bulk half of AsyncPirClient: submit, poll and read one job at each party."""

    async def fetch_rows_bulk(self, rows: Sequence[int],
                              tokens: Sequence[Optional[str]] = (None, None), state_path=None,
                              progress: Optional[Callable] = None,
                              poll_interval: float = 2.0) -> list[bytes]:
        """The 256-byte rows, through one bulk job at each party; see iter_rows_bulk."""
        return [data async for _, data in self.iter_rows_bulk(rows, tokens, state_path,
                                                              progress, poll_interval)]

    async def iter_rows_bulk(self, rows: Sequence[int],
                             tokens: Sequence[Optional[str]] = (None, None), state_path=None,
                             progress: Optional[Callable] = None,
                             poll_interval: float = 2.0) -> AsyncIterator[tuple[int, bytes]]:
        """(row, 256 bytes) in the order asked, from one bulk job at each party.

        `tokens` are the parties' DRF tokens (default: $MORPHO_TOKEN_A, $MORPHO_TOKEN_B). With a
        `state_path`, the plan (pages and key seeds) and each job id are written there before
        and after each submission, so a rerun after a crash resumes the same jobs; the file is
        removed once every row was read. `progress(job_a, job_b)` gets each polled job body.
        Answers of one query from two different epochs or served states are refused
        (EpochMismatch, StateMismatch). Bulk jobs take v1 keys (docs/PROTOCOL.md section 5.5).
        """
        rows = [int(r) for r in rows]
        if not rows:
            raise ValueError("expected at least one row")
        tokens = bulk_tokens(tokens)
        path = Path(state_path) if state_path is not None else None
        state = None
        if path is not None and path.exists():
            state = BulkState.load(path)
            state.check_resumes(self.servers, rows, path)
        if state is None or None in state.jobs:
            info = await self.settled_epoch()
            # a party that takes v2 keys alone would refuse its half after the other party had
            # started a job nobody reads
            v2_only = [url for url, formats in zip(self.servers, self._key_formats)
                       if "v1" not in formats]
            if v2_only:
                raise ServerError(f"bulk jobs take v1 keys and {' and '.join(v2_only)} takes v2 "
                                  "keys only; fetch these rows as batch queries instead")
            for row in rows:
                if not 0 <= row < info.num_rows:
                    raise ValueError(f"row {row} is outside [0, {info.num_rows})")
            if state is None:
                state = BulkState.plan(self.servers, info.epoch_id, info.num_pages,
                                       info.domain_bits, rows, [r // ROWS_PER_PAGE for r in rows])
                if path is not None:
                    state.save(path)
            elif info.domain_bits != state.domain_bits:
                raise StateError(
                    f"{path}: its keys are for domain_bits {state.domain_bits}, the parties now "
                    f"serve domain_bits {info.domain_bits}; remove it to plan the fetch anew"
                )
        for side, base in enumerate(self.servers):
            if state.jobs[side] is None:
                state.jobs[side] = await self._bulk_submit(base, tokens[side], state, side)
                if path is not None:
                    state.save(path)
        await self._bulk_wait(state, tokens, progress, poll_interval, path)
        async for item in self._bulk_rows(state, tokens, path):
            yield item
        if path is not None:
            path.unlink(missing_ok=True)

    def _bulk_headers(self, token: str, **extra) -> dict:
        return {"Authorization": f"Token {token}", "Accept": f"application/json, {NDJSON}",
                **extra}

    async def _bulk_json(self, base: str, path: str, token: str, **kwargs) -> dict:
        headers = self._bulk_headers(token, **kwargs.pop("headers", {}))
        response = await self.request(kwargs.pop("method", "GET"), base + path, headers=headers,
                                      **kwargs)
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"{base}{path}: the response is not JSON") from None

    async def _bulk_submit(self, base: str, token: str, state: BulkState, side: int) -> str:
        """POST party `side`'s keys as an NDJSON body streamed as it is made; the job id."""
        async def body():
            for chunk in state.ndjson_lines(side):
                yield chunk

        job = await self._bulk_json(base, "/bulk/jobs", token, method="POST", content=body(),
                                    headers={"Content-Type": NDJSON,
                                             "Content-Length": str(state.ndjson_length())})
        if not isinstance(job, dict) or not isinstance(job.get("id"), (str, int)):
            raise ServerError(f"{base}/bulk/jobs: expected a job with an id, got {job!r:.80}")
        return str(job["id"])

    async def _bulk_wait(self, state: BulkState, tokens, progress, poll_interval: float,
                         path: Optional[Path]) -> None:
        """Poll both jobs until both are done; a failed or cancelled job ends the fetch."""
        while True:
            jobs = await self._both(*(self._bulk_json(base, f"/bulk/jobs/{job_id}", token)
                                      for base, job_id, token in zip(self.servers, state.jobs,
                                                                     tokens)))
            if progress is not None:
                progress(*jobs)
            for base, job in zip(self.servers, jobs):
                if job.get("status") in ("failed", "cancelled"):
                    again = f"; remove {path} to submit new jobs" if path is not None else ""
                    raise ServerError(f"{base}: bulk job {job.get('id')} is {job['status']} "
                                      f"({job.get('errors')!r:.200}){again}")
            if all(job.get("status") == "done" for job in jobs):
                return
            await asyncio.sleep(poll_interval)

    async def _bulk_rows(self, state: BulkState, tokens,
                         path: Optional[Path]) -> AsyncIterator[tuple[int, bytes]]:
        """Both jobs' NDJSON results read side by side: XOR of the row's page, line by line."""
        again = f"; remove {path} to submit new jobs" if path is not None else ""
        async with self.http.stream("GET", f"{self.servers[0]}/bulk/jobs/{state.jobs[0]}/results",
                                    headers=self._bulk_headers(tokens[0])) as stream_a, \
                self.http.stream("GET", f"{self.servers[1]}/bulk/jobs/{state.jobs[1]}/results",
                                 headers=self._bulk_headers(tokens[1])) as stream_b:
            streams = (stream_a, stream_b)
            for base, stream in zip(self.servers, streams):
                if stream.status_code >= 400:
                    text = (await stream.aread()).decode("utf-8", "replace")
                    raise ServerError(f"{base}/bulk/jobs/.../results: HTTP {stream.status_code}: "
                                      f"{text:.200}", stream.status_code, text)
            lines = [stream.aiter_lines() for stream in streams]
            count = 0
            for index, (row, slot) in enumerate(zip(state.rows, state.slots.tolist())):
                got = []
                for base, source in zip(self.servers, lines):
                    try:
                        text = await anext(source)
                        got.append(parse_result_line(text.encode(), index, PAGE_BYTES))
                    except StopAsyncIteration:
                        break
                    except ValueError as exc:
                        raise ServerError(f"{base}: {exc}") from None
                if len(got) < 2:
                    break
                check_line_states(self.servers, index, row, got, again)
                offset = 2 + 2 * (row % ROWS_PER_PAGE) * ROW_BYTES  # past "0x", in hex digits
                a, b = (int(g["pages"][slot][offset:offset + 2 * ROW_BYTES], 16) for g in got)
                count += 1
                yield row, (a ^ b).to_bytes(ROW_BYTES, "big")
            if count != len(state.rows):
                raise ServerError(f"expected {len(state.rows)} result lines from each party, "
                                  f"got {count}")


def check_line_states(servers, index: int, row: int, got: list, again: str) -> None:
    """The two parties' result lines of one query name one epoch and one served state."""
    a, b = (line_state(line) for line in got)
    if a[0] != b[0]:
        raise EpochMismatch(
            f"query {index} (row {row}) was answered from epoch {a[0]} by A and epoch {b[0]} "
            f"by B: the jobs ran across an epoch switch and their answers cannot be combined"
            f"{again}"
        )
    if None not in (a[1], b[1]) and a != b:
        raise StateMismatch(
            f"query {index} (row {row}) was answered from different states: A ({servers[0]}) "
            f"epoch {a[0]} with {a[1]} row updates (digest {a[2]}), B ({servers[1]}) epoch "
            f"{b[0]} with {b[1]} row updates (digest {b[2]}): one party took row updates the "
            f"other had not, and their answers cannot be combined{again}"
        )
