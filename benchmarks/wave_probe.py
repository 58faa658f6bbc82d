"""Probe (not kept): Q=8 scan times rep by rep, with the SM clock, for waves and builds."""
import subprocess, sys, time, statistics
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel_times import time_kernels
from gpu_engine.backends import DispatchShape, create_backend, cuda_module, cuda_plan
from gpu_engine.dpf import KeyBatch, format_by_name, gen_keys
from gpu_engine.matrix import domain_bits_for
import cupy

def smi():
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()

events = []
time_kernels(events)
pages = 16817159
d = domain_bits_for(pages, None)
resident = create_backend("cuda", layout="fragments").generate(pages, seed=5, domain_bits=d)
rng = np.random.default_rng(5)
fmt = format_by_name("v1")
keys = KeyBatch.from_keys([gen_keys(int(rng.integers(pages)), d, rng, key_format=fmt)[0] for _ in range(24)])
out = open(sys.argv[1], "w")
out.write("config,rep,scan_ms,smi\n")
ref = None
for config in sys.argv[2:]:
    opts = dict(o.split("=") for o in config.split(",")) if config != "default" else {}
    cuda_plan.V1_FRAG_WAVES = int(opts.pop("waves", 2))
    reps = int(opts.pop("reps", 14))
    cuda_module._VARIANT_DEFINES = ()
    cuda_module.add_defines([f"{k}={v}" for k, v in opts.items()])
    cuda_module._module.cache_clear()
    resident._states.clear()
    times = []
    for rep in range(reps):
        events.clear()
        ans = resident.answer(keys, DispatchShape())
        ms = sum(cupy.cuda.get_elapsed_time(a, b) for n, a, b in events if n == "scan")
        s = smi() if rep % 3 == 0 else ""
        times.append(ms)
        out.write(f"{config},{rep},{ms:.3f},\"{s}\"\n")
        out.flush()
        if ref is None:
            ref = ans
        assert np.array_equal(ref, ans), config
    print(config, " ".join(f"{t:.1f}" for t in times), "| median", f"{statistics.median(times[1:]):.2f}", smi(), flush=True)
