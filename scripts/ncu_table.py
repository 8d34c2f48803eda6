"""Summarise Nsight Compute's raw CSV page (`ncu --import R --csv --page raw`) as a Markdown table per kernel name.

    python scripts/ncu_table.py ncu_raw.csv > ncu.md

Launches of the same kernel are averaged. Columns: launches, grid and block size, registers per thread, duration,
DRAM bytes moved (read and written: dram__bytes.sum, or the DRAM rate times the duration) and DRAM throughput
(% of peak), SM throughput, achieved occupancy, issue-slot use, the warp cycles between two issued instructions, and the largest
stall reasons as warp cycles per issued instruction (they add up to about that column: ncu's WarpStateStats).
Where ncu versions name a metric differently, the first name the report has is used; a metric the report lacks
shows as "-". Under ncu the clocks are locked to base and the caches flushed before each kernel (its defaults), so
durations are longer than in a traced step.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict

COLUMNS = [  # (title, metric names in order of preference, scale to the shown unit by the metric's unit)
    ("grid", ("launch__grid_size",), None),
    ("block", ("launch__block_size",), None),
    ("regs", ("launch__registers_per_thread",), None),
    ("us", ("gpu__time_duration.sum",), "time"),
    ("DRAM MB", ("dram__bytes.sum",), "bytes"),  # with_dram_bytes derives it where the report lacks it
    ("DRAM %", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"), None),
    ("SM %", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",), None),
    ("occupancy %", ("sm__warps_active.avg.pct_of_peak_sustained_active",), None),
    ("issue active", ("smsp__issue_active.avg.per_cycle_active",), None),
    ("cycles / issue", ("smsp__average_warps_active_per_issue_active.ratio",
                        "smsp__average_warp_latency_per_inst_issued.ratio"), None),
]
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
TIME_TO_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
BYTES_TO_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
RATE_TO_MB_PER_US = {"byte/s": 1e-12, "Kbyte/s": 1e-9, "Mbyte/s": 1e-6, "Gbyte/s": 1e-3, "Tbyte/s": 1.0}


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read(path: str):
    """(header, units, rows) of a raw CSV page; the second line holds the units where its kernel name is empty."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]  # ncu's own messages ("==PROF==", "==WARNING==")
    table = list(csv.reader(lines))
    if len(table) < 2 or "Kernel Name" not in table[0]:
        raise SystemExit(f"{path}: not an ncu raw CSV page (no 'Kernel Name' column in its first line)")
    header = table[0]
    name_col = header.index("Kernel Name")
    if table[1][name_col:name_col + 1] == [""]:  # the units line (ncu writes one after the header)
        return header, table[1], table[2:]
    return header, [""] * len(header), table[1:]


def with_dram_bytes(header, units, rows):
    """Adds dram__bytes.sum (in Mbyte) where the report has only its rate (ncu 2025.3): the rate times the duration."""
    if "dram__bytes.sum" in header or not {"dram__bytes.sum.per_second", "gpu__time_duration.sum"} <= set(header):
        return header, units, rows
    rate_col, time_col = header.index("dram__bytes.sum.per_second"), header.index("gpu__time_duration.sum")

    def megabytes(row):
        rate, t = number(row[rate_col]), number(row[time_col])
        if rate is None or t is None:
            return ""
        return str(rate * RATE_TO_MB_PER_US.get(units[rate_col], 1.0) * t * TIME_TO_US.get(units[time_col], 1.0))

    return header + ["dram__bytes.sum"], units + ["Mbyte"], [row + [megabytes(row)] for row in rows]


def summarise(header, units, rows, top_stalls: int = 4) -> list[str]:
    col = {name: i for i, name in enumerate(header)}
    by_kernel: dict[str, list[list[str]]] = defaultdict(list)
    for row in rows:
        if len(row) == len(header):
            by_kernel[row[col["Kernel Name"]]].append(row)
    stall_cols = [name for name in header if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX)]

    def mean(rows_k, names, scale=None):
        """The launches' mean of the first of `names` the report has, in the shown unit (None: none of them)."""
        name = next((n for n in names if n in col), None)
        if name is None:
            return None
        factor = {"time": TIME_TO_US, "bytes": BYTES_TO_MB}.get(scale, {}).get(units[col[name]], 1.0)
        vals = [v for v in (number(r[col[name]]) for r in rows_k) if v is not None]
        return sum(vals) / len(vals) * factor if vals else None

    titles = ["kernel", "launches"] + [t for t, _, _ in COLUMNS] + ["top stalls (cycles per issue)"]
    out = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    order = sorted(by_kernel, key=lambda k: -(mean(by_kernel[k], ("gpu__time_duration.sum",), "time") or 0))
    for name in order:
        rows_k = by_kernel[name]
        cells = [f"`{name[:60]}`", str(len(rows_k))]
        for _, metrics, scale in COLUMNS:
            v = mean(rows_k, metrics, scale)
            cells.append("-" if v is None else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) < 10
                                                 else f"{v:.1f}"))
        stalls = [(mean(rows_k, (c,)) or 0.0, c[len(STALL_PREFIX):-len(STALL_SUFFIX)]) for c in stall_cols]
        stalls.sort(reverse=True)
        cells.append(", ".join(f"{s} {v:.1f}" for v, s in stalls[:top_stalls] if v > 0) or "-")
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    header, units, rows = with_dram_bytes(*read(argv[0]))
    print("\n".join(summarise(header, units, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
