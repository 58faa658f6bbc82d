"""Online measurements the slo batcher plans with: launch cost t(b) = a + c*b (per key format) and arrival rate."""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Iterable, Optional, Tuple


@dataclass(frozen=True)
class CostFit:
    """t(b) = intercept_s + per_query_s * b, seconds for one launch of b queries."""

    intercept_s: float = 0.0
    per_query_s: float = 0.0
    samples: int = 0  # launches the fit is made from
    rmse_s: float = 0.0  # root mean square residual of the fit, seconds

    def predict(self, batch: int) -> float:
        # Never zero: plans divide by it, and no launch is free.
        return max(1e-6, self.intercept_s + self.per_query_s * batch)


@dataclass
class LineSums:
    """The sums a least-squares line needs, kept as launches come and go (O(1) per launch: the
    fit is read on every scheduling decision, and refitting 128 points in Python took 45 to 90 µs
    of device idle per launch: docs/PERFORMANCE.md)."""

    n: int = 0
    b: float = 0.0
    t: float = 0.0
    bb: float = 0.0
    bt: float = 0.0
    tt: float = 0.0

    def add(self, batch: int, seconds: float, sign: int = 1) -> None:
        self.n += sign
        self.b += sign * batch
        self.t += sign * seconds
        self.bb += sign * batch * batch
        self.bt += sign * batch * seconds
        self.tt += sign * seconds * seconds

    def fit(self) -> CostFit:
        """Least squares t = a + c*b with a, c >= 0 (a negative one is dropped and the other refitted)."""
        n = self.n
        if n <= 0:
            return CostFit()
        denom = n * self.bb - self.b * self.b
        if denom > 0:  # batch sizes are integers: these sums are exact
            c = (n * self.bt - self.b * self.t) / denom
            a = (self.t - c * self.b) / n
        else:  # every launch had the same size: the split between a and c is unknown
            a, c = self.t / n, 0.0
        if c < 0:  # noise on a flat curve: a constant fits better than a falling line
            a, c = self.t / n, 0.0
        elif a < 0:  # cost proportional to the batch: a line through the origin
            a, c = 0.0, self.bt / self.bb
        # sum of (a + c b - t)^2, expanded; rounding may leave it a hair below zero
        sse = (n * a * a + c * c * self.bb + self.tt + 2 * a * c * self.b
               - 2 * a * self.t - 2 * c * self.bt)
        return CostFit(a, c, n, math.sqrt(max(0.0, sse) / n))


def fit_line(points: "Deque[Tuple[int, float]] | list") -> CostFit:
    """The least-squares fit of (batch, seconds) points (see LineSums.fit)."""
    sums = LineSums()
    for batch, seconds in points:
        sums.add(batch, seconds)
    return sums.fit()


class CostModel:
    """The last `window` measured launches and their least-squares fit, refitted on each one."""

    def __init__(self, window: int = 128) -> None:
        self._points: Deque[Tuple[int, float]] = deque(maxlen=window)
        self._sums = LineSums()
        self._since_exact = 0  # launches since the sums were last recomputed from the points
        self._lock = threading.Lock()
        self._fit = CostFit()

    def observe(self, batch: int, seconds: float) -> None:
        if batch <= 0 or not seconds >= 0:
            return
        with self._lock:
            if len(self._points) == self._points.maxlen:
                self._sums.add(*self._points[0], sign=-1)
            self._points.append((batch, seconds))
            self._sums.add(batch, seconds)
            self._since_exact += 1
            if self._since_exact >= self._points.maxlen:  # adding and taking away drifts: start afresh
                self._sums, self._since_exact = LineSums(), 0
                for point in self._points:
                    self._sums.add(*point)
            self._fit = self._sums.fit()

    def fit(self) -> CostFit:
        return self._fit  # an immutable value: readers need no lock


# Queries a launch is compared at, where the dearer of two fits is wanted: the batch of the
# engine's classic cap (MAX_BATCH_QUERIES), where the formats' costs differ most in absolute terms
REFERENCE_BATCH = 32


class FormatCosts:
    """A CostModel per key format: a launch of v1 keys costs several times one of v2 keys (6x over
    the fragments layout on an H100, docs/SCANS.md), so one line through both
    would plan every batch with a mixture of the two. A launch of several formats (they queue
    together) is counted in each format's model: its time is what a launch of those keys took."""

    def __init__(self, window: int = 128) -> None:
        self._window = window
        # (format, model) pairs, replaced whole when a format first launches: read without a lock
        # on every scheduling decision
        self._models: Tuple[Tuple[int, CostModel], ...] = ()
        self._lock = threading.Lock()

    def _model(self, key_format: int) -> CostModel:
        for fmt, model in self._models:
            if fmt == key_format:
                return model
        with self._lock:
            models = dict(self._models)
            model = models.setdefault(key_format, CostModel(self._window))
            self._models = tuple(sorted(models.items()))
            return model

    def observe(self, key_formats: Iterable[int], batch: int, seconds: float) -> None:
        for key_format in set(key_formats):
            self._model(key_format).observe(batch, seconds)

    def by_format(self) -> Dict[int, CostFit]:
        """Each format's fit, of the formats that have launched."""
        return {key_format: model.fit() for key_format, model in self._models}

    def fit(self, key_formats: Optional[Iterable[int]] = None) -> CostFit:
        """The fit to plan a launch of `key_formats` with (all formats seen when None): the dearest
        at REFERENCE_BATCH of theirs that have samples, else the dearest of any (a format not yet
        launched is planned like the others), else no fit."""
        fits = [(fmt, model.fit()) for fmt, model in self._models]
        fits = [(fmt, fit) for fmt, fit in fits if fit.samples]
        if key_formats is not None:
            wanted = set(key_formats)
            fits = [(fmt, fit) for fmt, fit in fits if fmt in wanted] or fits
        return max((fit for _, fit in fits), key=lambda fit: fit.predict(REFERENCE_BATCH), default=CostFit())


class RateMeter:
    """Exponentially weighted arrival rate (events per second) with time constant `tau_s`.

    Each arrival of n adds n/tau, and the sum decays as exp(-dt/tau); for Poisson arrivals
    its mean is the arrival rate, and after an idle spell it falls to zero rather than
    remembering the last burst."""

    def __init__(self, tau_s: float = 2.0) -> None:
        self.tau_s = tau_s
        self._rate = 0.0
        self._at: Optional[float] = None

    def add(self, count: float, now: float) -> None:
        self._rate = self.rate(now) + count / self.tau_s
        self._at = now

    def since_last(self, now: float) -> float:
        """Seconds since the latest arrival (inf before the first)."""
        return math.inf if self._at is None else max(0.0, now - self._at)

    def rate(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._at) / self.tau_s)
