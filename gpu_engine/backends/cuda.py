"""The CUDA backend (CuPy): the matrix stays in GPU memory and each batch is one fused scan of it."""
from __future__ import annotations

import collections
import threading
from typing import List, Mapping, Optional, Tuple

import numpy as np

try:
    import cupy
    from cupy_backends.cuda.api import runtime
except ImportError as exc:  # create_backend turns this into BackendUnavailable
    raise ImportError(f"the CUDA backend needs CuPy ({exc})") from exc

import gpu_engine.backends.cuda_plan as cuda_plan
from gpu_engine.backends.base import (
    Backend,
    BackendUnavailable,
    DispatchShape,
    KeysRefused,
    PendingAnswer,
    ProgressFn,
    ResidentMatrix,
)
from gpu_engine.backends.cuda_module import get_kernel, scan_kernel
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, KeyBatch, format_name
from gpu_engine.matrix import PAGE_BYTES, ROWS_PER_PAGE, WORDS_PER_PAGE, PageMatrix, domain_bits_for
from morpho_pir.protocol import MAX_BATCH_QUERIES

UPLOAD_CHUNK_PAGES = 16384  # 64 MiB per pinned staging buffer; two alternate
HEADROOM_BYTES = 256 << 20  # kept free beside the matrix for tree nodes, answers, CUDA itself
# (batch size, dispatch, key format) entries whose buffers and graphs are kept: warm-up makes one
# per batch size (up to the backend's pass_queries, at most MAX_LAUNCH_QUERIES = 74) and key
# format, the bulk lane one more (v1), and room is left for a second dispatch's few
MAX_CACHED_SHAPES = 2 * cuda_plan.MAX_LAUNCH_QUERIES + 16
_H2D, _D2H = 1, 2  # cudaMemcpyKind
_POISON = 0xA5  # byte the pinned answer buffer is filled with before every batch


class _MicroBatch:
    """One micro-batch: its plan, buffers, stream and, once captured, its CUDA graph.

    The key records are plan.padded_keys (whole key groups); the padding repeats the
    micro-batch's last key and its answers are never copied back. dpf_scan_v1_frag runs the batch's
    own keys, split evenly over its groups, and the top stages skip the padding there
    (plan.top_keys).
    """

    def __init__(self, plan: cuda_plan.ScanPlan, start: int, stop: int, stream) -> None:
        self.plan, self.start, self.stop, self.stream = plan, start, stop, stream
        kp = plan.padded_keys
        self.krec = cuda_plan.krec_words(plan.tree_depth)
        self._keys_mem = cupy.cuda.alloc_pinned_memory(kp * self.krec * 4)
        self.keys_host = np.frombuffer(self._keys_mem, np.uint32, kp * self.krec).reshape(kp, self.krec)
        self.keyrec = cupy.empty((kp, self.krec), dtype=np.uint32)
        self.out = cupy.empty((kp, WORDS_PER_PAGE), dtype=np.uint32)
        self.nodes: List[Tuple[cupy.ndarray, cupy.ndarray]] = [
            (cupy.empty((kp, st.live_out, 4), dtype=np.uint32), cupy.empty((kp, st.live_out), dtype=np.uint8))
            for st in plan.stages
        ]
        self.top = get_kernel("dpf_scan.cu", "dpf_expand_top") if plan.stages else None
        self.scan = scan_kernel(plan)
        # the tensor-core scan reads every (key, leaf)'s selection bits, made by dpf_leaf_bits
        self.sel = self.leaf_bits = None
        if plan.tensor_cores:
            self.sel = cupy.empty((kp, plan.padded_leaves, 4), dtype=np.uint32)
            self.leaf_bits = get_kernel("dpf_scan.cu", "dpf_leaf_bits")
        self.graph = None

    def stage_keys(self, records: np.ndarray) -> None:
        """Copy this micro-batch's key records (and the padding) into its pinned buffer."""
        k = self.stop - self.start
        self.keys_host[:k] = records[self.start : self.stop]
        self.keys_host[k:] = records[self.stop - 1]

    def enqueue(self, pages, out_host: np.ndarray) -> None:
        """Queue key upload, tree top, scan and answer download on this micro-batch's stream."""
        plan, kp = self.plan, self.plan.padded_keys
        s = self.stream.ptr
        runtime.memcpyAsync(self.keyrec.data.ptr, self.keys_host.ctypes.data, self.keys_host.nbytes, _H2D, s)
        runtime.memsetAsync(self.out.data.ptr, 0, self.out.nbytes, s)
        with self.stream:
            for i, st in enumerate(plan.stages):
                self.top((st.live_in, plan.top_keys), (cuda_plan.TOP_THREADS,),
                         cuda_plan.top_args(plan, i, self.keyrec, self.nodes))
            if plan.tensor_cores:
                self.leaf_bits((cuda_plan.leaf_bits_grid(plan),), (cuda_plan.MMA_THREADS,),
                               cuda_plan.leaf_bits_args(plan, self.keyrec, self.nodes, self.sel))
                self.scan((plan.grid,), (cuda_plan.MMA_THREADS,),
                          cuda_plan.mma_scan_args(plan, pages, self.sel, self.out),
                          shared_mem=plan.shared_bytes)
            else:
                self.scan((plan.grid,), (plan.scan_threads,),
                          cuda_plan.scan_args(plan, pages, self.keyrec, self.nodes, self.out),
                          shared_mem=plan.shared_bytes)
        runtime.memcpyAsync(out_host[self.start :].ctypes.data, self.out.data.ptr,
                            (self.stop - self.start) * PAGE_BYTES, _D2H, s)

    def run(self, pages, out_host: np.ndarray, use_graph: bool) -> None:
        if not use_graph:
            self.enqueue(pages, out_host)
            return
        if self.graph is None:  # the pinned buffers and device buffers are fixed, so replay is exact
            self.stream.begin_capture()
            try:
                self.enqueue(pages, out_host)
            finally:
                self.graph = self.stream.end_capture()
        self.graph.launch(stream=self.stream)


class _DispatchState:
    """The pinned answer buffer and micro-batches of one (batch size, dispatch shape), kept for reuse."""

    def __init__(self, plans: List[cuda_plan.ScanPlan], ranges, streams) -> None:
        total = ranges[-1][1]
        self._out_mem = cupy.cuda.alloc_pinned_memory(total * PAGE_BYTES)
        self.out_host = np.frombuffer(self._out_mem, np.uint32, total * WORDS_PER_PAGE).reshape(total, WORDS_PER_PAGE)
        self.micro_batches = [
            _MicroBatch(plan, start, stop, streams[i % len(streams)])
            for i, (plan, (start, stop)) in enumerate(zip(plans, ranges))
        ]
        self.streams = list({id(item.stream): item.stream for item in self.micro_batches}.values())
        # recorded on each stream behind this batch's last copy: collecting the batch waits for
        # these, not for the streams, where a batch started behind it may already be queued
        self.done = [cupy.cuda.Event(disable_timing=True) for _ in self.streams]


class _Started(PendingAnswer):
    """A batch queued on the device; result() waits for its streams and copies its answers out."""

    def __init__(self, resident: "CudaResident", key: tuple, state: _DispatchState) -> None:
        self._resident, self._key, self._state = resident, key, state
        self._answers: Optional[np.ndarray] = None

    def result(self) -> np.ndarray:
        if self._answers is None:
            self._answers = self._resident._collect(self._key, self._state)
        return self._answers

    def done(self) -> bool:
        """Whether the device has finished this batch (its answers are in the pinned buffer)."""
        return self._answers is not None or all(event.done for event in self._state.done)


class CudaResident(ResidentMatrix):
    """One epoch's pages in GPU memory: a (num_pages, 1024) u32 array in the "pages" layout; in
    the "fragments" layout (cuda_plan.MATRIX_LAYOUTS) a (chunks * slices, fragment words) one,
    which both key formats read as it is, on the tensor cores."""

    def __init__(self, backend: "CudaBackend", pages, num_pages: int, domain_bits: int) -> None:
        self.num_pages = num_pages
        self.domain_bits = domain_bits
        self._backend = backend
        self._pages = pages
        self._streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(8)]
        self._states: "collections.OrderedDict[tuple, _DispatchState]" = collections.OrderedDict()
        self._started: set = set()  # keys of the states whose batch is started and not collected
        self._lock = threading.Lock()
        # scan tuning; the benchmarks vary these, the engine keeps the defaults
        self.max_group_keys = cuda_plan.DEFAULT_MAX_GROUP_KEYS
        self.chunk_levels = cuda_plan.DEFAULT_CHUNK_LEVELS
        # v2 keys: "auto" (tensor cores from MMA_MIN_KEYS keys), "mma" or "alu" (cuda_plan.V2_SCANS)
        self.v2_scan = backend.v2_scan
        self.mma_chunks_per_block: Optional[int] = None  # None: the plan's (by key tiles)
        self.layout = backend.layout

    @property
    def nbytes(self) -> int:
        return 0 if self._pages is None else int(self._pages.nbytes)

    def _live(self):
        if self._pages is None:
            raise RuntimeError("this resident matrix was released")
        return self._pages

    def plan(self, num_keys: int, key_format: int = KEY_FORMAT_V1) -> cuda_plan.ScanPlan:
        tensor_cores = cuda_plan.use_tensor_cores(self.v2_scan, key_format, num_keys, self.layout)
        return cuda_plan.plan_scan(self.num_pages, self.domain_bits, num_keys, self.max_group_keys,
                                self.chunk_levels, self._backend.resident_blocks, key_format,
                                tensor_cores=tensor_cores, mma_chunks_per_block=self.mma_chunks_per_block,
                                mma_max_tiles=self._backend.mma_max_tiles, layout=self.layout,
                                wgmma=self._backend.wgmma, v1_pairs=self._backend.v1_pairs)

    def check_keys(self, keys: KeyBatch) -> None:
        try:
            cuda_plan.check_key_batch(keys, self.domain_bits)  # the base checks, then the arrays'
        except ValueError as exc:
            raise KeysRefused(str(exc)) from None
        if keys.key_format not in self._backend.key_formats:
            raise KeysRefused(f"a matrix in the {self.layout} layout answers "
                              f"{' and '.join(format_name(f) for f in self._backend.key_formats)} "
                              f"keys only, got {format_name(keys.key_format)} keys")

    def _state(self, num_keys: int, dispatch: DispatchShape,
               key_format: int) -> Tuple[tuple, _DispatchState]:
        """The buffers (and graphs) of this batch shape that no started batch is using: a second
        set where the engine starts a batch while one of the same shape still runs."""
        shape = (num_keys, dispatch, self.max_group_keys, self.chunk_levels, key_format,
                 self.v2_scan, self.mma_chunks_per_block, self._backend.mma_max_tiles, self._backend.wgmma,
                 self._backend.v1_pairs)
        key = shape + (1 if shape + (0,) in self._started else 0,)
        if key in self._started:
            raise RuntimeError(f"two batches of {num_keys} keys are running already; collect one first")
        state = self._states.get(key)
        if state is None:
            ranges = cuda_plan.split_micro_batches(num_keys, dispatch.micro_batch)
            plans = [self.plan(stop - start, key_format) for start, stop in ranges]
            streams = self._streams[: dispatch.streams]
            try:
                state = _DispatchState(plans, ranges, streams)
            except cupy.cuda.memory.OutOfMemoryError:
                # buffers kept for other batch shapes may be what fills the GPU: drop them, retry once
                for stream in self._streams:
                    stream.synchronize()
                self._states.clear()
                cupy.get_default_memory_pool().free_all_blocks()
                state = _DispatchState(plans, ranges, streams)
            self._states[key] = state
            while len(self._states) > MAX_CACHED_SHAPES:
                self._states.popitem(last=False)
        self._states.move_to_end(key)
        return key, state

    def answer(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> np.ndarray:
        return self.start(keys, dispatch).result()

    def start(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> "_Started":
        """Queue the batch on its streams and return without waiting for the device."""
        self.check_keys(keys)
        records = cuda_plan.pack_key_records(keys.root_seed, keys.root_t, keys.cw_seed, keys.cw_t, keys.final_cw)
        with self._lock, self._backend.on_device():
            pages = self._live()
            key, state = self._state(len(keys), dispatch, keys.key_format)
            state.out_host.view(np.uint8)[...] = _POISON  # a launch that never lands shows as poison
            for item in state.micro_batches:
                item.stage_keys(records)
                item.run(pages, state.out_host, dispatch.graph)
            for stream, event in zip(state.streams, state.done):
                stream.record(event)
            self._started.add(key)
        return _Started(self, key, state)

    def _collect(self, key: tuple, state: _DispatchState) -> np.ndarray:
        try:
            with self._backend.on_device():
                for event in state.done:
                    event.synchronize()
            # one copy out of the pinned buffer, which the next batch of this shape reuses; keys
            # the kernels never wrote are still poison there (filled by start)
            return state.out_host.view(np.uint8).copy()
        finally:
            with self._lock:
                self._started.discard(key)

    def write_rows(self, rows: Mapping[int, bytes]) -> None:
        idx, data = cuda_plan.check_rows(rows, self.num_pages * ROWS_PER_PAGE)
        if not len(idx):
            return
        with self._lock, self._backend.on_device():
            stream = self._streams[0]
            with stream:  # answers run on these streams; finishing here orders the write before them
                if self.layout == "pages":
                    by_row = self._live().reshape(-1, WORDS_PER_PAGE // ROWS_PER_PAGE)
                    by_row[cupy.asarray(idx)] = cupy.asarray(data)
                else:  # each chunk a row falls in: back to pages, the rows written, to fragments
                    chunk_rows = cuda_plan.MMA_CHUNK_PAGES * ROWS_PER_PAGE
                    order = np.argsort(idx, kind="stable")  # rows grouped by chunk, in one sort
                    idx, data = idx[order], data[order]
                    chunks, starts = np.unique(idx // chunk_rows, return_index=True)
                    for chunk, start, stop in zip(chunks.tolist(), starts, [*starts[1:], len(idx)]):
                        pages = self._chunk_pages(chunk)
                        pages.reshape(-1, WORDS_PER_PAGE // ROWS_PER_PAGE)[
                            cupy.asarray(idx[start:stop] - chunk * chunk_rows)] = cupy.asarray(data[start:stop])
                        self._backend.to_fragments(pages, self._live(), chunk,
                                                   self.num_pages - chunk * cuda_plan.MMA_CHUNK_PAGES)
            stream.synchronize()

    def _chunk_pages(self, chunk: int):
        """Chunk `chunk` of a matrix in the fragments layout as (MMA_CHUNK_PAGES, 1024) u32 pages,
        on the current stream (the pages past num_pages are zeros)."""
        pages = cupy.empty((cuda_plan.MMA_CHUNK_PAGES, WORDS_PER_PAGE), dtype=np.uint32)
        frags = self._live()[chunk * cuda_plan.MMA_SLICES:]
        get_kernel("dpf_scan_mma.cu", "fragments_to_pages")((cuda_plan.MMA_SLICES,), (cuda_plan.MMA_THREADS,),
                                                             (frags, pages))
        return pages

    def read_page(self, index: int) -> bytes:
        """Page `index` as it is in GPU memory (row writes included)."""
        if not 0 <= index < self.num_pages:
            raise ValueError(f"page {index} is outside [0, {self.num_pages})")
        with self._backend.on_device():
            if self.layout == "pages":
                return cupy.asnumpy(self._live()[index]).astype("<u4").tobytes()
            with self._lock:  # a row write waits until the chunk is read back whole
                page = self._chunk_pages(index // cuda_plan.MMA_CHUNK_PAGES)[index % cuda_plan.MMA_CHUNK_PAGES]
                return cupy.asnumpy(page).astype("<u4").tobytes()

    def release(self) -> None:
        with self._lock, self._backend.on_device():
            for stream in self._streams:
                stream.synchronize()
            self._states.clear()
            self._pages = None
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()


class CudaBackend(Backend):
    """One GPU (the current CuPy device). Raises BackendUnavailable where none can be used."""

    name = "cuda"
    warm_all_shapes = True

    def __init__(self, device: Optional[int] = None, v2_scan: str = "auto", layout: str = "pages",
                 wgmma: Optional[bool] = None) -> None:
        super().__init__()
        if layout != "auto":
            cuda_plan.check_layout(layout)
        try:
            count = runtime.getDeviceCount()
        except Exception as exc:  # CuPy present, driver or GPU missing
            raise BackendUnavailable(f"CuPy is installed but no CUDA GPU is usable: {exc}") from exc
        if count < 1:
            raise BackendUnavailable("CuPy is installed but sees no CUDA GPU")
        if device is not None and not 0 <= device < count:
            raise BackendUnavailable(f"there is no GPU {device}: CUDA sees {count} "
                                     f"(ids 0..{count - 1})")
        self.device = cupy.cuda.Device(device if device is not None else cupy.cuda.runtime.getDevice())
        self.device.use()
        props = runtime.getDeviceProperties(self.device.id)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.sm_count = int(props["multiProcessorCount"])
        self.compute_capability = (int(props["major"]), int(props["minor"]))
        # key tiles a block of the tensor-core scan may hold: what a block's shared memory fits
        # (sm_80 fewer than sm_90: more key groups a launch; sm_86/89 not one tile)
        shared_limit = int(props.get("sharedMemPerBlockOptin", cuda_plan.MAX_SHARED_BYTES))
        # the layout of the matrices it loads from now on (both answer v1 and v2 keys), and why
        if layout == "auto":
            layout, self.layout_reason = cuda_plan.auto_layout(self.compute_capability, shared_limit)
        else:
            self.layout_reason = f"MORPHO_MATRIX_LAYOUT={layout}"
        self.layout = layout
        # the fragments layout on sm_90: Hopper's warpgroup products (dpf_scan_wgmma_frag, 1.55x
        # mma.sync's rate, up to 224 keys a block); wgmma=False keeps mma.sync (for comparison)
        can_wgmma = layout == "fragments" and self.compute_capability == cuda_plan.WGMMA_CAPABILITY
        if wgmma and not can_wgmma:
            raise BackendUnavailable(f"the wgmma scan reads the fragments layout on sm_90 (sm_90a); this backend "
                                     f"stores the {layout} layout on {self.device_name}, "
                                     f"sm_{self.compute_capability[0]}{self.compute_capability[1]}")
        self.wgmma = can_wgmma if wgmma is None else bool(wgmma)
        # v1 keys over the fragments layout in pairs of key groups, thread-block clusters
        # (dpf_scan_v1_pair), on sm_90 (sm_90a, where it was measured; other GPUs with clusters
        # build it with one row in flight, untimed); False keeps a block a group (dpf_scan_v1_frag)
        self.v1_pairs = can_wgmma
        self.mma_max_tiles = cuda_plan.mma_max_tiles(shared_limit, layout, self.wgmma)
        self.tensor_cores = self.compute_capability >= cuda_plan.MMA_MIN_CAPABILITY and self.mma_max_tiles > 0
        if layout == "fragments":
            # v2 keys' scan and v1 keys' (dpf_scan_v1_frag) must both fit a block
            need = max(cuda_plan.mma_shared_bytes(1, layout),
                       cuda_plan.v1_frag_shared_bytes())
            if not self.tensor_cores or need > shared_limit:
                raise BackendUnavailable(
                    f"the fragments layout is read by the tensor cores (1-bit products, sm_80 or later, and "
                    f"{need} bytes of shared memory a block); {self.device_name} "
                    f"is sm_{self.compute_capability[0]}{self.compute_capability[1]} with {shared_limit}: "
                    f"use the pages layout")
        # the v2 scan of the matrices it loads from now on (cuda_plan.V2_SCANS)
        if v2_scan == "mma" and not self.tensor_cores:
            raise BackendUnavailable(
                f"v2 keys on the tensor cores need 1-bit products (sm_80 or later) and "
                f"{cuda_plan.mma_shared_bytes(1)} bytes of shared memory a block; {self.device_name} is "
                f"sm_{self.compute_capability[0]}{self.compute_capability[1]} with {shared_limit}: "
                f"scan them as auto or alu")
        self.v2_scan = v2_scan if self.tensor_cores else "alu"
        # the queries a launch serves in one pass over the matrix: one key group of the tensor-core
        # scan (the fragments layout's, or v2 keys' in the pages layout unless scanned on the ALU;
        # v1 keys' scans, dpf_scan and dpf_scan_v1_frag, read each run of pages from memory once
        # for all their key groups, adjacent in the grid): 74 with wgmma, 58 on
        # mma.sync's 11 tiles, fewer on sm_80. Never fewer than a request's queries: a request is
        # not split, so where a pass holds less (sm_80's pages layout, 26) one launches whole as
        # two key groups, and its buffers are reserved and warmed up
        scans_tiles = self.tensor_cores and (layout == "fragments" or self.v2_scan != "alu")
        self.pass_queries = max(MAX_BATCH_QUERIES, cuda_plan.pass_queries(self.mma_max_tiles if scans_tiles else 0))
        self.resident_blocks = self.sm_count * 2  # dpf_scan's __launch_bounds__ minimum

    def on_device(self):
        """A context in which CUDA calls go to this backend's GPU. A new Device object each time:
        one keeps the device to go back to on its own stack, which threads must not share."""
        return cupy.cuda.Device(self.device.id)

    def memory_info(self) -> dict:
        with self.on_device():  # the figures of this backend's GPU, whichever is current
            free, total = runtime.memGetInfo()
        return {"device": f"{self.device_name} (cuda:{self.device.id}, sm_{self.compute_capability[0]}{self.compute_capability[1]})",
                "used_bytes": int(total - free), "total_bytes": int(total)}

    def _allocate(self, num_pages: int, domain_bits: int):
        fragments = self.layout == "fragments"
        chunks = cuda_plan.mma_chunks(num_pages)
        # fragments: whole chunks (under 4 MiB more), and a device buffer the upload goes through
        need = chunks * cuda_plan.MMA_CHUNK_PAGES * PAGE_BYTES if fragments else num_pages * PAGE_BYTES
        # room for two of the largest launches the engine makes (pass_queries queries) of either
        # key format beside the matrix: the engine starts the next batch while one runs
        scans = [(KEY_FORMAT_V1, False), (KEY_FORMAT_V2, True)] if fragments else (
            [(KEY_FORMAT_V1, False), (KEY_FORMAT_V2, False)] + [(KEY_FORMAT_V2, True)] * self.tensor_cores)
        working = HEADROOM_BYTES + 2 * max(cuda_plan.workspace_bytes(
            cuda_plan.plan_scan(num_pages, domain_bits, self.pass_queries * cuda_plan.KEYS_PER_QUERY, resident_blocks=self.resident_blocks,
                                key_format=key_format, tensor_cores=tensor_cores, mma_max_tiles=self.mma_max_tiles,
                                layout=self.layout, wgmma=self.wgmma))
            for key_format, tensor_cores in scans) + fragments * UPLOAD_CHUNK_PAGES * PAGE_BYTES
        free, total = runtime.memGetInfo()
        if need + working > free:
            raise BackendUnavailable(
                f"the matrix needs {cuda_plan.sizes_text(need)} plus {cuda_plan.sizes_text(working)} of "
                f"working space, but {self.device_name} has {cuda_plan.sizes_text(free)} free "
                f"of {cuda_plan.sizes_text(total)}"
            )
        try:
            if fragments:
                return cupy.empty((chunks * cuda_plan.MMA_SLICES, cuda_plan.MMA_FRAGMENT_WORDS), dtype=np.uint32)
            return cupy.empty((num_pages, WORDS_PER_PAGE), dtype=np.uint32)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            raise BackendUnavailable(f"the matrix needs {cuda_plan.sizes_text(need)}: {exc}") from exc

    def load(self, matrix: PageMatrix, progress: Optional[ProgressFn] = None) -> CudaResident:
        """Upload in 64 MiB pieces through two pinned buffers, so reading the (memory-mapped)
        file overlaps the copy of the previous piece."""
        with self.on_device():  # its pages, streams and buffers on this backend's GPU
            return self._load(matrix, progress)

    def _load(self, matrix: PageMatrix, progress: Optional[ProgressFn]) -> CudaResident:
        pages = self._allocate(matrix.num_pages, matrix.domain_bits)
        stream = cupy.cuda.Stream(non_blocking=True)
        staging = [cupy.cuda.alloc_pinned_memory(UPLOAD_CHUNK_PAGES * PAGE_BYTES) for _ in range(2)]
        # fragments: each piece lands here, then is transposed into place (on the same stream)
        piece = self._piece_buffer()
        done_events = [None, None]
        total = matrix.nbytes
        for n, (first, block) in enumerate(matrix.iter_blocks(UPLOAD_CHUNK_PAGES)):
            slot = n % 2
            if done_events[slot] is not None:
                done_events[slot].synchronize()
            view = np.frombuffer(staging[slot], np.uint32, block.size).reshape(block.shape)
            np.copyto(view, block)
            if piece is None:
                runtime.memcpyAsync(pages[first:].data.ptr, view.ctypes.data, block.nbytes, _H2D, stream.ptr)
            else:
                runtime.memcpyAsync(piece.data.ptr, view.ctypes.data, block.nbytes, _H2D, stream.ptr)
                with stream:
                    self.to_fragments(piece, pages, first // cuda_plan.MMA_CHUNK_PAGES, block.shape[0])
            done_events[slot] = stream.record()
            if progress:
                progress(min(total, (first + block.shape[0]) * PAGE_BYTES), total)
        stream.synchronize()
        return CudaResident(self, pages, matrix.num_pages, matrix.domain_bits)

    def generate(self, num_pages: int, seed: int, domain_bits: Optional[int] = None,
                 progress: Optional[ProgressFn] = None) -> CudaResident:
        """A pseudo-random matrix made in GPU memory (matrix_fill.cu), for benchmarks at sizes
        the host cannot feed; cuda_module.fill_reference recomputes any page on the host."""
        with self.on_device():
            return self._generate(num_pages, seed, domain_bits, progress)

    def _generate(self, num_pages: int, seed: int, domain_bits: Optional[int],
                  progress: Optional[ProgressFn]) -> CudaResident:
        d = domain_bits_for(num_pages, domain_bits)
        pages = self._allocate(num_pages, d)
        fill = get_kernel("matrix_fill.cu", "fill_pages")
        piece = self._piece_buffer()
        # fragments: pieces of UPLOAD_CHUNK_PAGES pages filled, then transposed into place
        target = pages if piece is None else piece
        pairs = target.reshape(-1).view(np.uint64)
        total = num_pages * WORDS_PER_PAGE // 2
        step = (1 << 30) if piece is None else pairs.size  # 8 GiB per launch, so progress moves
        for first in range(0, total, step):
            count = min(step, total - first)
            out = pairs[first:] if piece is None else pairs
            fill((self.sm_count * 8,), (256,), (out, np.uint64(first), np.uint64(count), np.uint64(seed)))
            if piece is not None:
                first_page = first * 2 // WORDS_PER_PAGE
                self.to_fragments(piece, pages, first_page // cuda_plan.MMA_CHUNK_PAGES, count * 2 // WORDS_PER_PAGE)
            cupy.cuda.Device().synchronize()
            if progress:
                progress((first + count) * 8, num_pages * PAGE_BYTES)
        return CudaResident(self, pages, num_pages, d)

    def _piece_buffer(self):
        """The device buffer pages go through on their way into the fragments layout (None in the
        pages layout, where they are copied into place)."""
        if self.layout == "pages":
            return None
        return cupy.empty((UPLOAD_CHUNK_PAGES, WORDS_PER_PAGE), dtype=np.uint32)

    def to_fragments(self, pages, frags, first_chunk: int, valid_pages: int) -> None:
        """Transpose `pages` (whole chunks of page-major pages, the first valid_pages of them real)
        into the fragments layout `frags` from chunk first_chunk on, on the current stream."""
        chunks = min(pages.shape[0] // cuda_plan.MMA_CHUNK_PAGES, frags.shape[0] // cuda_plan.MMA_SLICES - first_chunk)
        get_kernel("dpf_scan_mma.cu", "pages_to_fragments")(
            (chunks * cuda_plan.MMA_SLICES,), (cuda_plan.MMA_THREADS,),
            (pages, np.int64(valid_pages), frags[first_chunk * cuda_plan.MMA_SLICES:]))
