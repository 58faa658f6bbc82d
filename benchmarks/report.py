"""What every benchmark's CSV starts with: the machine, then its rows (shared by the scripts here)."""
from __future__ import annotations

import csv
import platform
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple


def cpu_model() -> str:
    """The processor's name as /proc/cpuinfo gives it (else what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_csv(path, comments: Iterable[str], fieldnames: Sequence[str],
              rows: Iterable[Mapping]) -> None:
    """`# ...` comment lines (machine, shape, command, date), then a header and the rows."""
    with open(path, "w", newline="") as fh:
        for line in comments:
            fh.write(line + "\n")
        writer = csv.DictWriter(fh, fieldnames=list(fieldnames))
        writer.writeheader()
        writer.writerows(rows)


def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend: no display), imported only by the
    scripts that plot, when they plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_csv(path) -> Tuple[Dict[str, str], List[dict]]:
    """({name: value} of the `# name: value` comment lines, the rows) of a CSV write_csv wrote."""
    header: Dict[str, str] = {}
    lines = []
    with open(path) as fh:
        for line in fh:
            if line.startswith("#"):
                name, _, value = line[1:].strip().partition(": ")
                header[name] = value
            else:
                lines.append(line)
    return header, list(csv.DictReader(lines, skipinitialspace=True))
