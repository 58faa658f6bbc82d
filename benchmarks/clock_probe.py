"""WIP probe: where dpf_scan_v1_pair's teams spend their cycles (-DV1P_CLOCKS=1: clock() spans kept in
registers over a run, one atomic a warp and run), at mainnet for the Q given (default 8, 32, 6, 10)."""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy  # noqa: E402

from gpu_engine.backends import DispatchShape, create_backend, cuda_module  # noqa: E402
from gpu_engine.dpf import KeyBatch, format_by_name, gen_keys  # noqa: E402

NAMES = ["mult READY wait", "mult loop", "prod loop", "tops levels 0-2", "copy and levels 3-5", "levels 6-7",
         "FREE wait", "transposes", "READY + barrier"]
pages, d = 16817159, 25
qs = [int(x) for x in sys.argv[1:]] or [8, 32, 6, 10]
cuda_module.add_defines(["V1P_CLOCKS=1"])
resident = create_backend("cuda", layout="fragments").generate(pages, seed=5, domain_bits=d)
rng = np.random.default_rng(5)
print("q,wall_ms," + ",".join(n.replace(" ", "_") + "_pct" for n in NAMES[0:1] + NAMES[3:]), flush=True)
for q in qs:
    keys = KeyBatch.from_keys([gen_keys(int(rng.integers(pages)), d, rng, key_format=format_by_name("v1"))[0]
                               for _ in range(3 * q)])
    resident.answer(keys, DispatchShape())
    mod = cuda_module._module("dpf_scan.cu", resident._backend.compute_capability)
    clocks = cupy.ndarray((16,), cupy.uint64, mod.get_global("v1p_clocks"))
    clocks[...] = 0
    cupy.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    for _ in range(3):
        resident.answer(keys, DispatchShape())
    cupy.cuda.runtime.deviceSynchronize()
    ms = (time.perf_counter() - t) * 1e3 / 3
    c = cupy.asnumpy(clocks).astype(float)
    mult, prod = c[1], c[2]
    shares = [c[0] / mult] + [c[k] / prod for k in range(3, 9)]
    print(f"{q},{ms:.2f}," + ",".join(f"{100 * x:.1f}" for x in shares), f"# prod/mult {prod / mult:.3f}", flush=True)
