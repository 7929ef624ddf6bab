"""verifiers 0.4.0 (prime-rl's environment library), in its own venv, against our servers.

    python bench/verifiers_env.py [--venv /tmp/vfenv] [--model DIR] [-n 2] [-r 2]

Installs ``verifiers==0.4.0`` into ``--venv`` (skipped with a message where the install fails) and the
two environments under ``bench/verifiers_envs/`` (sums; ``sr-arith`` offers an ``add`` tool over MCP),
starts ``support-replay serve`` on SmolLM2 (``--chat-template hermes_tools``) and ``support-replay
sessions`` in front of it (top_k 32, the same template), and runs ``vf-eval`` with the ``null``
harness and the subprocess runtime:

1. its eval client against ``serve``'s ``/v1`` (single turn, the tool offered);
2. the same through the session server's ``/v1``: verifiers sends ``X-Session-ID`` per rollout, so every
   rollout must be one session, with no split;
3. its train client (``--client.type train``: ``renderers`` posts token ids to ``/inference/v1/generate``
   and reads ``token_ids``, ``logprobs.content`` and ``sampling_mask``) against ``serve``, on ``sr-plain``
   (renderers' default renderer renders no tools for a model outside its map);
4. the train client through the session server (filtered: the answers carry ``sampling_mask``).

Prints one row per run: rollouts done, with errors, and what the server recorded.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))
from processes import free_port  # noqa: E402
from support_replay.launch import wait_healthy  # noqa: E402
from support_replay.modeling.checkpoints import smollm2_checkpoint  # noqa: E402


def install(venv: Path) -> bool:
    if not (venv / "bin" / "vf-eval").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "verifiers==0.4.0"])
        if done.returncode != 0:
            print(f"skipped: pip install verifiers==0.4.0 into {venv} failed")
            return False
    for env in ("sr_arith", "sr_plain"):
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "-e", str(ROOT / "bench/verifiers_envs" / env)], check=True
        )
    return True


def start(args: list[str], url: str, log: Path):
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_healthy(url, proc, 300, log)
    return proc


def vf_eval(venv: Path, env: str, base_url: str, n: int, r: int, extra: list[str], workdir: Path) -> dict:
    log = workdir / f"{env}-{len(list(workdir.iterdir()))}.log"
    cmd = [str(venv / "bin" / "vf-eval"), env, "-m", "m", "-n", str(n), "-r", str(r), "--client.base-url", base_url]
    cmd += ["--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess", "--no-push", "--no-rich"]
    done = subprocess.run(cmd + extra, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=workdir, timeout=1200)
    text = log.read_text()
    rollouts = re.findall(r"rollout done: .* reward=([0-9.]+) turns=(\d+) stop=(\w+)", text)
    failed = text.count("model call failed")
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return {"rc": done.returncode, "rollouts": rollouts, "failed_calls": failed, "last": last[:160], "log": log}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path("/tmp/vfenv"))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("-r", type=int, default=2)
    args = parser.parse_args()
    if not install(args.venv):
        return
    model = args.model or smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="vf-"))
    cli = [sys.executable, "-m", "support_replay.cli"]
    sport, xport = free_port(), free_port()
    serve_url, sessions_url = f"http://127.0.0.1:{sport}", f"http://127.0.0.1:{xport}"
    serve = start(
        cli + ["serve", "--hf-checkpoint", str(model), "--port", str(sport), "--chat-template", "hermes_tools"],
        serve_url,
        work / "serve.log",
    )
    sessions = start(
        cli
        + ["sessions", "--backend", serve_url, "--tokenizer", str(model), "--port", str(xport), "--top-k", "32"]
        + ["--chat-template", "hermes_tools", "--max-episode-tokens", "2048"],
        sessions_url,
        work / "sessions.log",
    )
    train = ["--client.type", "train", "--client.renderer-model-name", str(model)]
    runs = [
        ("eval client, serve /v1, tool offered", "sr-arith", serve_url + "/v1", []),
        ("eval client, sessions /v1 (X-Session-ID)", "sr-arith", sessions_url + "/v1", []),
        ("train client, serve /inference/v1/generate", "sr-plain", serve_url + "/v1", train),
        ("train client, sessions /inference/v1/generate", "sr-plain", sessions_url + "/v1", train),
    ]
    print(f"\nverifiers 0.4.0, {model.name}, -n {args.n} -r {args.r}, logs in {work}\n")
    print("| run | vf-eval rc | rollouts done | failed model calls | sessions open after | verifiers' last line |")
    print("|---|---:|---:|---:|---:|---|")
    try:
        for name, env, url, extra in runs:
            r = vf_eval(args.venv, env, url, args.n, args.r, extra, work)
            open_sessions = httpx.get(sessions_url + "/health").json()["sessions"]
            last = r["last"].replace("|", "/") if r["rc"] else ""
            print(
                f"| {name} | {r['rc']} | {len(r['rollouts'])} | {r['failed_calls']} | {open_sessions} | {last} |",
                flush=True,
            )
    finally:
        for proc in (sessions, serve):
            proc.terminate()
        for proc in (sessions, serve):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # never leave a server behind to skew the next measurement
                proc.kill()
                proc.wait()
    print(json.dumps({"work": str(work)}))


if __name__ == "__main__":
    main()
