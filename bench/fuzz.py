"""Fuzzing at full counts (docs/reliability.md): the wire decoder (100,000 mutated streams per
mode, peak memory per input byte), the SGLang and vLLM payload parsers (10,000 each), and every
HTTP endpoint of the engine server (10,000 schema-driven requests in all). Prints a table.

    python bench/fuzz.py [--scale 1.0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from fuzzing import fuzz_http, fuzz_sglang, fuzz_vllm, fuzz_wire, worst_case_decode_memory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every count (0.01 for a quick look)")
    args = ap.parse_args()
    n = lambda count: max(1, int(count * args.scale))  # noqa: E731
    rows = []

    def run(name, fn, *a, **kw):
        start = time.perf_counter()
        result = fn(*a, **kw)
        rows.append((name, result, time.perf_counter() - start))
        print(f"{name}: {result} ({rows[-1][2]:.0f} s)", flush=True)

    print(f"wire decoder, worst case: {worst_case_decode_memory()}", flush=True)
    run("wire decoder, absolute", fuzz_wire, n(100_000), True, False)
    run("wire decoder, relative to a_t", fuzz_wire, n(100_000), True, True)
    run("SGLang meta_info", fuzz_sglang, n(10_000))
    run("vLLM choices", fuzz_vllm, n(10_000))

    import tempfile

    from support_replay.engine import Engine, EngineSettings
    from support_replay.engine.limits import EngineLimits
    from support_replay.serving.server import create_app
    from tiny_model import build_tiny_checkpoint

    engine = Engine.from_pretrained(
        build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny"),
        EngineSettings(limits=EngineLimits(max_new_tokens=8, max_prompt_tokens=128)),
    ).start()
    run("HTTP endpoints (10 operations; the 4 with a body 2,500 each)", fuzz_http, create_app(engine), n(2_500))
    engine.shutdown()
    print("\n| target | inputs | outcome | s |")
    print("|---|---:|---|---:|")
    for name, result, seconds in rows:
        total = sum(v for k, v in (result["answers"] if "answers" in result else result).items() if isinstance(v, int))
        outcome = (
            ", ".join(f"{k} {v}" for k, v in result.items() if k != "answers")
            if "answers" not in result
            else (
                f"no 5xx; slowest answer {result['slowest_s']} s; statuses "
                + ", ".join(sorted({str(s) for _, s in result["answers"]}))
            )
        )
        print(f"| {name} | {total} | {outcome} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
