"""The backend interface: a backend makes a matrix resident on its device and answers key batches."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from gpu_engine.backends.cuda_plan import MAX_LAUNCH_QUERIES
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, KeyBatch
from gpu_engine.matrix import PageMatrix

# progress(done_bytes, total_bytes) while a matrix is made resident
ProgressFn = Callable[[int, int], None]


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no CuPy, no GPU, not enough device memory)."""


class KeysRefused(ValueError):
    """A key batch a resident matrix cannot answer (another domain, a format it does not scan,
    arrays its kernels would misread): the caller's error, not the device's."""


@dataclass(frozen=True)
class DispatchShape:
    """How one batch of keys is cut into launches; chosen by the batching policy, not the backend."""

    micro_batch: int = 0  # keys per launch; 0 = the whole batch in one launch
    streams: int = 1  # CUDA streams the micro-batches are spread over (1..8)
    graph: bool = False  # replay a captured CUDA graph when the same launch shape repeats

    def __post_init__(self) -> None:
        if self.micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0, got {self.micro_batch}")
        if not 1 <= self.streams <= 8:
            raise ValueError(f"streams must be in 1..8, got {self.streams}")


class PendingAnswer:
    """A batch a backend has started; result() waits for it and returns its answers."""

    def __init__(self, answers: np.ndarray) -> None:
        self._answers = answers

    def result(self) -> np.ndarray:
        return self._answers


class ResidentMatrix(ABC):
    """One epoch's matrix held on a backend's device; answers batches of keys against it."""

    # batches started and not yet collected at a time (a CUDA device keeps two sets of buffers)
    max_in_flight = 2

    def __init__(self, matrix: PageMatrix) -> None:
        self.num_pages = matrix.num_pages
        self.domain_bits = matrix.domain_bits

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Device bytes this resident matrix occupies."""

    @abstractmethod
    def answer(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> np.ndarray:
        """Answers for every key: uint8 array of shape (len(keys), PAGE_BYTES)."""

    def start(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> PendingAnswer:
        """Start answering `keys` and return at once where the device runs apart from the host
        (CUDA), so the engine hands out one batch's answers while the next one runs; here the
        answers are computed before it returns. At most max_in_flight batches are started and
        not yet collected at a time."""
        return PendingAnswer(self.answer(keys, dispatch))

    @abstractmethod
    def write_rows(self, rows: Mapping[int, bytes]) -> None:
        """Overwrite rows (row index -> 256 bytes). Callers serialise this with answer()."""

    def start_parts(self, parts: Sequence[KeyBatch], dispatch: DispatchShape = DispatchShape()
                    ) -> List[PendingAnswer]:
        """Start one batch's launches (one per key format, `parts`) together; a resident over
        several devices keeps them on one device. If one fails to start, those started are
        collected before the error is raised, so their buffers serve the next batch."""
        started: List[PendingAnswer] = []
        try:
            for keys in parts:
                started.append(self.start(keys, dispatch))
        except Exception:
            for pending in started:
                pending.result()
            raise
        return started

    def each_copy(self) -> List["ResidentMatrix"]:
        """The residents a warm-up runs on so that every device has compiled and captured each
        batch shape: this one, or each replica of a replicated matrix (gpu_engine.placement)."""
        return [self]

    @abstractmethod
    def release(self) -> None:
        """Free the device memory; the object must not be used afterwards."""

    def check_keys(self, keys: KeyBatch) -> None:
        """Reject a batch this matrix cannot answer, before anything is launched: KeysRefused.

        A resident matrix makes this check once, as it starts a batch (answer, start): keys reach
        it from the engine, which checked their fit to its epoch at submit, but also straight from
        tests and benchmarks, and from the engine's queue across a switch to an epoch of another
        domain. A replicated matrix (gpu_engine.placement) leaves it to the replica that runs the
        batch. CUDA's adds the kernels' array checks (cuda_plan.check_key_batch) and its formats."""
        if len(keys) == 0:
            raise KeysRefused("empty key batch")
        if keys.domain_bits != self.domain_bits:
            raise KeysRefused(
                f"keys have domain_bits {keys.domain_bits}, matrix has {self.domain_bits}"
            )


class Backend(ABC):
    """A compute device that can hold matrices and answer key batches."""

    name: str = "abstract"  # "cpu" | "cuda"
    # True where the first launch of each batch shape compiles kernels or captures graphs, so an
    # engine warms every shape up before it serves (Engine.warm_up)
    warm_all_shapes: bool = False
    # the key formats its matrices answer (docs/PROTOCOL.md section 3): both on every backend
    # today; the engine and the web tier take and advertise what a backend lists
    key_formats: Tuple[int, ...] = (KEY_FORMAT_V1, KEY_FORMAT_V2)
    # the most queries one launch serves in one pass over its matrices: the engine launches no
    # more at once, whatever a policy's max_batch (up to the static MAX_LAUNCH_QUERIES) allows.
    # CudaBackend's comes from its scan's key tiles (cuda_plan.pass_queries); a backend without
    # passes (the CPU's scan serves any batch in one) takes the static bound
    pass_queries: int = MAX_LAUNCH_QUERIES
    # how its matrices are stored (cuda_plan.MATRIX_LAYOUTS) and why: CudaBackend's is asked for
    # or picked by the GPU (cuda_plan.auto_layout); a backend of one layout has pages
    layout: str = "pages"
    layout_reason: str = "this backend scans pages, its one layout"

    def __init__(self) -> None:
        # Why this backend was chosen when another was asked for (auto fallback), else None.
        self.fallback_reason: Optional[str] = None

    @abstractmethod
    def load(self, matrix: PageMatrix, progress: Optional[ProgressFn] = None) -> ResidentMatrix:
        """Make a matrix resident (upload it); raises BackendUnavailable if it cannot fit."""

    @abstractmethod
    def memory_info(self) -> dict:
        """{"device": str, "used_bytes": int, "total_bytes": int} for the device."""

    def describe(self) -> dict:
        info = {"backend": self.name, "fallback_reason": self.fallback_reason,
                "pass_queries": self.pass_queries, "layout": self.layout,
                "layout_reason": self.layout_reason}
        info.update(self.memory_info())
        return info
