"""Counts the SASS instructions of a kernel's loops by opcode, without a GPU (nvcc and nvdisasm).

    python3 benchmarks/sass_mix.py dpf_scan.cu dpf_scan_v1_frag --contains BMMA

Builds kernels/<file> as NVRTC gets it (cuda_module.kernel_source, the host's -D options) for
sm_90a with nvcc -cubin, disassembles it with nvdisasm, and prints, for each loop of the kernels
whose mangled name contains `kernel` (a label to the branch back to it), the count of each opcode;
--contains keeps only the loops holding that opcode (BMMA: the tensor-core product loops). Also
prints ptxas's registers and spills. docs/SCANS.md quotes it for dpf_scan_v1_frag's fold.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.variant import add_define_argument, apply_defines  # noqa: E402
from gpu_engine.backends import cuda_module  # noqa: E402

OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def loops(sass: str):
    """(label, [opcode, ...]) of each loop: from a label to a branch back to it."""
    lines = sass.splitlines()
    at = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    for i, line in enumerate(lines):
        m = BRANCH.search(line)
        if m and m.group(1) in at and at[m.group(1)] < i:
            body = lines[at[m.group(1)]:i + 1]
            yield m.group(1), [op.group(1) for op in map(OPCODE.match, body) if op]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a kernel file, e.g. dpf_scan.cu")
    ap.add_argument("kernel", help="part of the kernel's (mangled) name, e.g. dpf_scan_v1_frag")
    ap.add_argument("--contains", default=None, help="only loops holding this opcode (e.g. BMMA)")
    add_define_argument(ap)
    args = ap.parse_args()
    apply_defines(args)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / args.file, Path(tmp) / "k.cubin"
        src.write_text(cuda_module.kernel_source(args.file))
        build = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", *cuda_module.NVRTC_OPTIONS,
                                "-Xptxas", "-v", "-o", str(cubin), str(src)], capture_output=True, text=True,
                               check=True, cwd=tmp)
        sass = subprocess.run(["nvdisasm", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    report = build.stderr.splitlines()
    for i, line in enumerate(report):
        if "Function properties for" in line and args.kernel in line:
            print(line.split("for ")[-1], "|", " ".join(report[i + 1:i + 3]).replace("ptxas info    : ", ""))
    for section in re.split(r"(?m)^\s*\.section\s+", sass):
        name = section.split(",", 1)[0]
        if not name.startswith(".text.") or args.kernel not in name:
            continue
        for label, ops in loops(section):
            if args.contains and args.contains not in ops:
                continue
            counts = collections.Counter(ops)
            print(f"{name[6:]} {label}: {len(ops)} instructions:",
                  ", ".join(f"{n} {op}" for op, n in counts.most_common()))


if __name__ == "__main__":
    main()
