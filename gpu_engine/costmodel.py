"""Online measurements the slo batcher plans with: launch cost t(b) = a + c*b and arrival rate."""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Tuple


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


def fit_line(points: "Deque[Tuple[int, float]] | list") -> CostFit:
    """Least squares t = a + c*b with a, c >= 0 (a negative one is dropped and the other refitted)."""
    n = len(points)
    if n == 0:
        return CostFit()
    sb = sum(b for b, _ in points)
    st = sum(t for _, t in points)
    sbb = sum(b * b for b, _ in points)
    sbt = sum(b * t for b, t in points)
    denom = n * sbb - sb * sb
    if denom > 0:
        c = (n * sbt - sb * st) / denom
        a = (st - c * sb) / n
    else:  # every launch had the same size: the split between a and c is unknown
        a, c = st / n, 0.0
    if c < 0:  # noise on a flat curve: a constant fits better than a falling line
        a, c = st / n, 0.0
    elif a < 0:  # cost proportional to the batch: a line through the origin
        a, c = 0.0, sbt / sbb
    rmse = math.sqrt(sum((a + c * b - t) ** 2 for b, t in points) / n)
    return CostFit(a, c, n, rmse)


class CostModel:
    """The last `window` measured launches and their least-squares fit, refitted on each one."""

    def __init__(self, window: int = 128) -> None:
        self._points: Deque[Tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._fit = CostFit()

    def observe(self, batch: int, seconds: float) -> None:
        if batch <= 0 or not seconds >= 0:
            return
        with self._lock:
            self._points.append((batch, seconds))
            self._fit = fit_line(self._points)

    def fit(self) -> CostFit:
        return self._fit  # an immutable value: readers need no lock


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

    def rate(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._at) / self.tau_s)
