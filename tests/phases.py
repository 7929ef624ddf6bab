"""The wall time of each phase of ``make test``, printed at its end (the Makefile writes a line as a phase begins and
as it ends: ``begin|end <epoch seconds> <phase>``). Phases that ran side by side overlap; start and end are seconds
from the first line. Plain Python: it runs before any venv exists.

    python3 tests/phases.py .phases
"""

from __future__ import annotations

import sys
from pathlib import Path


def table(lines: list[str]) -> list[str]:
    begins: dict[str, float] = {}
    rows: list[tuple[str, float, float | None]] = []
    for line in lines:
        parts = line.split(maxsplit=2)
        if len(parts) != 3 or parts[0] not in ("begin", "end"):
            continue  # not a phase line (a shell's noise)
        try:
            event, at, name = parts[0], float(parts[1]), parts[2]
        except ValueError:
            continue
        if event == "begin":
            begins[name] = at
        elif event == "end" and name in begins:
            rows.append((name, begins.pop(name), at))
    rows += [(name, at, None) for name, at in begins.items()]  # begun, never ended: it failed or was stopped
    if not rows:
        return ["make test: no phase was recorded"]
    zero = min(start for _, start, _ in rows)
    rows.sort(key=lambda row: row[1])
    width = max(len(name) for name, _, _ in rows)
    out = ["make test: wall time per phase (seconds from its start; phases side by side overlap)"]
    out.append(f"  {'phase':<{width}}  {'start':>6}  {'end':>6}  {'wall':>6}")
    for name, start, end in rows:
        ended = f"{end - zero:6.0f}" if end is not None else "   ---"
        wall = f"{end - start:6.0f}" if end is not None else " (not ended)"
        out.append(f"  {name:<{width}}  {start - zero:6.0f}  {ended}  {wall}")
    return out


if __name__ == "__main__":
    path = Path(sys.argv[1])
    print("\n".join(table(path.read_text().splitlines() if path.exists() else [])))
