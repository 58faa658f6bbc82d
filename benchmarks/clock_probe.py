"""WIP probe: where dpf_scan_v1_pair's teams spend their cycles (V1P_CLOCKS=1), Q = 8 and 32 at mainnet."""
import sys, time
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy
from gpu_engine.backends import DispatchShape, create_backend, cuda_module
from gpu_engine.dpf import KeyBatch, format_by_name, gen_keys

NAMES = ["mult READY wait", "mult loop", "prod expand", "prod FREE wait", "prod transpose", "prod ready+sync", "prod loop"]
pages, d = 16817159, 25
extra = sys.argv[1:]
cuda_module.add_defines(["V1P_CLOCKS=1"] + extra)
resident = create_backend("cuda", layout="fragments").generate(pages, seed=5, domain_bits=d)
fmt = format_by_name("v1")
rng = np.random.default_rng(5)
for q in (8, 32, 6, 10):
    keys = KeyBatch.from_keys([gen_keys(int(rng.integers(pages)), d, rng, key_format=fmt)[0] for _ in range(3 * q)])
    resident.answer(keys, DispatchShape())
    mod = cuda_module._module("dpf_scan.cu", resident._backend.compute_capability)
    clocks = cupy.ndarray((8,), cupy.uint64, mod.get_global("v1p_clocks"))
    levels = cupy.ndarray((8,), cupy.uint64, mod.get_global("v1p_levels"))
    clocks[...] = 0
    levels[...] = 0
    cupy.cuda.runtime.deviceSynchronize()
    reps = 3
    t = time.perf_counter()
    for _ in range(reps):
        resident.answer(keys, DispatchShape())
    cupy.cuda.runtime.deviceSynchronize()
    ms = (time.perf_counter() - t) * 1e3 / reps
    c = np.concatenate([cupy.asnumpy(clocks), cupy.asnumpy(levels)]).astype(float)
    mult, prod = c[1], c[6]
    print(f"q={q} wall {ms:.2f} ms/batch  " + "  ".join(
        f"{n}: {v / (mult if i < 2 else prod) * 100:.1f}%" for i, (n, v) in enumerate(zip(NAMES, c[:7]))),
        f" prod/mult loop cycles {prod / mult:.3f}", flush=True)
    print("   levels: " + "  ".join(f"l{l}: {c[8 + l] / prod * 100:.1f}%" for l in range(8)), flush=True)
