"""What ``--linear-kernel auto`` measures and picks on this machine, as it is and with the ISA capped at AVX2
(``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``, a stand-in for an older CPU).

Each probe runs in a process of its own with an empty cache (modeling/kernel_probe.py: MKL's ``F.linear`` against
oneDNN's packed product, 16 rows, three layer shapes, medians of alternating rounds), --repeats times, and the
table shows every measurement and the choice.

    python bench/kernel_probe.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CODE = (
    "import json; from support_replay.modeling.kernel_probe import probe_record, cpu_identity; "
    "print(json.dumps({**probe_record(), 'cpu': cpu_identity()}))"
)


def probe(env: dict) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run(
            [sys.executable, "-c", CODE],
            env={**os.environ, **env, "SUPPORT_REPLAY_CACHE": cache},
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeats):
        for name, env in (("as it is", {}), ("AVX2 caps", AVX2)):
            rows.append((name, probe(env)))
    print(f"\n{rows[0][1]['cpu']}, {rows[0][1]['threads']} threads")
    print("| ISA | MKL F.linear ms | oneDNN packed ms | oneDNN / MKL | auto picks |")
    print("|---|---:|---:|---:|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['torch_ms']:.3f} | {r['onednn_ms']:.3f} | {r['onednn_ms'] / r['torch_ms']:.2f} "
            f"| {r['choice']} |"
        )


if __name__ == "__main__":
    main()
