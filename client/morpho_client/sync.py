"""The blocking PIR client: AsyncPirClient run on an event loop of its own, in its own thread."""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from morpho_pir.records import Record

from morpho_client.aio import AsyncPirClient
from morpho_client.core import Answer, EpochInfo
from morpho_client.plan import Window


class PirClient:
    """The same methods as AsyncPirClient, blocking: a thin layer that runs each call on a
    private event loop. Its pipelining (requests in flight, keys made ahead) is the async
    client's own, so the two fetch at the same rate."""

    def __init__(self, server_a: str, server_b: str, **options) -> None:
        self.core = AsyncPirClient(server_a, server_b, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pir-client",
                                        daemon=True)
        self._thread.start()

    def _run(self, coroutine):
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:  # Ctrl-C as it waits: the call ends on the loop too, not later
            future.cancel()
            raise

    def _iterate(self, agen) -> Iterator:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(_closed(agen))

    # The options and what the last fetch used, read and set on the core.
    def __getattr__(self, name: str):
        if name in ("core", "_loop", "_thread"):
            raise AttributeError(name)
        return getattr(self.core, name)

    def epoch(self) -> EpochInfo:
        return self._run(self.core.epoch())

    def call(self, base: str, path: str, body: Optional[dict] = None):
        """The parsed JSON of a GET of base + path, or of a POST of `body` there."""
        return self._run(self.core.get_json(base, path, body))[0]

    def health(self) -> list[dict]:
        return self._run(self.core.health())

    def ask(self, window: Window, first: int = 0, last: Optional[int] = None,
            batch: bool = True) -> Answer:
        return self._run(self.core.ask(window, first, last, batch))

    def fetch_pages(self, pages: Sequence[int]) -> Answer:
        return self._run(self.core.fetch_pages(pages))

    def fetch_rows(self, rows: Sequence[int], batch: bool = True) -> list[bytes]:
        return self._run(self.core.fetch_rows(rows, batch))

    def fetch_row(self, row: int) -> bytes:
        return self._run(self.core.fetch_row(row))

    def lookup(self, key: bytes) -> Optional[bytes]:
        return self._run(self.core.lookup(key))

    def lookup_many(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        return self._run(self.core.lookup_many(keys))

    def lookup_records(self, keys: Sequence[bytes]) -> list[Optional[Record]]:
        return self._run(self.core.lookup_records(keys))

    def iter_lookups(self, keys: Iterable[bytes]
                     ) -> Iterator[tuple[list[bytes], list[Optional[Record]]]]:
        return self._iterate(self.core.iter_lookups(keys))

    def iter_answers(self, rows: Iterable[int], batch: bool = True
                     ) -> Iterator[tuple[np.ndarray, list[bytes]]]:
        # request by request: one hop between threads per request, not per row
        return self._iterate(self.core.iter_answers(rows, batch))

    def iter_rows(self, rows: Iterable[int], batch: bool = True) -> Iterator[tuple[int, bytes]]:
        for asked, data in self.iter_answers(rows, batch):
            yield from zip(asked.tolist(), data)

    def fetch_rows_bulk(self, rows: Sequence[int], tokens: Sequence[Optional[str]] = (None, None),
                        state_path=None, progress: Optional[Callable] = None,
                        poll_interval: float = 2.0) -> list[bytes]:
        return self._run(self.core.fetch_rows_bulk(rows, tokens, state_path, progress,
                                                   poll_interval))

    def iter_rows_bulk(self, rows: Sequence[int], tokens: Sequence[Optional[str]] = (None, None),
                       state_path=None, progress: Optional[Callable] = None,
                       poll_interval: float = 2.0) -> Iterator[tuple[int, bytes]]:
        return self._iterate(self.core.iter_rows_bulk(rows, tokens, state_path, progress,
                                                      poll_interval))

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self.core.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        if not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> "PirClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _closed(agen) -> None:
    """agen.aclose(), once a step of it that was cancelled (Ctrl-C as it waited) has run its
    cleanup: closing a generator still in a step is a RuntimeError that would hide the
    interrupt."""
    while agen.ag_running:
        await asyncio.sleep(0.005)
    await agen.aclose()
