"""`support-replay ray-run` on a Ray cluster of two nodes on this machine (two raylets, Ray's own
``ray.cluster_utils.Cluster``, loopback only): placement, GRPO with --ci-test, an engine killed mid-rollout,
a trainer rank killed and the job resumed."""

import ast
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rewards_for_tests import HOLD_ENV
from stop_gate import environment as stop_gate_environment
from support_replay.ray_launch.placement import Layout, ordered

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only (notes/ray.md)

TESTS = Path(__file__).parent
SMG = ("--ray-router", "smg")
# two simulated devices a node for ray-run (sim_gpu), and two declared GPUs, which Ray hands out as it would real ones
# (CUDA_VISIBLE_DEVICES per actor): what the device test reads
NODE = dict(
    num_cpus=2, num_gpus=2, resources={"sim_gpu": 2}, object_store_memory=128 * 2**20, node_ip_address="127.0.0.1"
)


def test_the_layout_is_slimes():
    apart = Layout(actor_ranks=2, rollout_gpus=4, gpus_per_engine=2, colocate=False)
    assert (apart.bundles, apart.rollout_offset, apart.engines) == (6, 2, 2)
    together = Layout(actor_ranks=4, rollout_gpus=2, gpus_per_engine=1, colocate=True)
    assert (together.bundles, together.rollout_offset, together.engines) == (4, 0, 2)
    # bundles ordered by node address, then node, then device: ranks take the first, engines the rest
    infos = [("127.0.0.1", "b", 0), ("127.0.0.1", "a", 1), ("10.0.0.2", "c", 0), ("127.0.0.1", "a", 0)]
    order = ordered(infos)
    assert order == [2, 3, 1, 0]
    assert [apart.rank_bundle(r, order + [4, 5]) for r in range(2)] == [2, 3]
    assert [apart.engine_bundle(e, order + [4, 5]) for e in range(2)] == [1, 4]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    c.add_node(**NODE)
    c.wait_for_nodes()
    c.seconds = time.monotonic() - started
    yield c
    c.shutdown()


def test_each_engine_actor_takes_the_device_ray_gives_it(cluster):
    """ray-run's engine commands are built on the driver, but Ray shows each actor only its own GPUs, numbered from 0:
    engine 1's ``cuda:1`` (or SGLang's ``--base-gpu-id 1``) named a device its actor cannot see, and a driver without
    CUDA gave none. Each actor now names the first device it sees; one given no GPU keeps its command. Checked in
    actors holding one declared GPU each, without starting an engine."""
    import ray

    from support_replay.ray_launch.actors import on_this_actor

    serve = [sys.executable, "-m", "support_replay.cli", "serve", "--hf-checkpoint", "/m"]
    sglang = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/m", "--base-gpu-id", "1"]
    ray.init(address=cluster.address)
    try:

        @ray.remote(num_cpus=0)
        class Engine:
            def seen(self, command, given=False):
                return (
                    os.environ.get("CUDA_VISIBLE_DEVICES"),
                    ray.get_gpu_ids(),
                    on_this_actor(command, ray.get_gpu_ids(), given),
                )

        held = [Engine.options(num_gpus=1).remote() for _ in range(4)]  # every declared GPU of the two nodes
        seen = ray.get([e.seen.remote(serve) for e in held] + [e.seen.remote(sglang) for e in held])
        assert sorted((visible, tuple(ids)) for visible, ids, _ in seen[:4]) == [
            ("0", (0,)),
            ("0", (0,)),
            ("1", (1,)),
            ("1", (1,)),
        ]
        assert all(command == [*serve, "--device", "cuda:0"] for _, _, command in seen[:4])
        assert all(command[-2:] == ["--base-gpu-id", "0"] and len(command) == len(sglang) for _, _, command in seen[4:])
        given = ray.get(held[0].seen.remote([*serve, "--device", "cpu"], True))[2]
        assert given == [*serve, "--device", "cpu"]  # --ray-engine-device named it
        cpu_only = Engine.options(num_gpus=0, resources={"sim_gpu": 0.5}).remote()
        assert ray.get(cpu_only.seen.remote(serve))[2] == serve
    finally:
        ray.shutdown()


class RayRun:
    """``ray-run`` as a process, its output read as it comes."""

    def __init__(self, address: str, train_flags: list[str], out: Path, env: dict | None = None, ray_flags: tuple = ()):
        env = dict(env or {})
        path = [env.pop("PYTHONPATH", ""), str(TESTS), os.environ.get("PYTHONPATH", "")]  # a gate's site first
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), **env}
        command = [sys.executable, "-m", "support_replay.cli", "ray-run", "--address", address, *ray_flags]
        command += ["--", *train_flags]
        self.out, self.lines = out, []
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")))
        self.reader.start()

    def wait(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout)
        self.reader.join()
        return code

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def line(self, start: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [x for x in list(self.lines) if x.strip().startswith(start)]
            if found:
                return found[0].strip()
            assert self.proc.poll() is None, self.text[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"no line {start!r}: {self.text[-3000:]}")

    def pid(self, actor: str) -> int:
        return int(self.line(actor + ":").split(" pid ")[1].split(",")[0])

    def rows(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def flags(checkpoint, out: Path, *more: str, rollouts: int = 3) -> list[str]:
    return [
        *("--hf-checkpoint", str(checkpoint), "--num-rollout", str(rollouts), "--rollout-batch-size", "2"),
        *("--n-samples-per-prompt", "4", "--global-batch-size", "4", "--rollout-max-response-len", "10"),
        *("--lr", "1e-3", "--custom-rm-path", "rewards_for_tests:digit_share"),
        *("--rollout-top-p", "0.8", "--rollout-top-k", "32", "--ci-test", "--no-progress", "--output-dir", str(out)),
        *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2"),
        *("--rollout-num-gpus-per-engine", "1", "--rollout-num-gpus", "2", *more),
    ]


def check_trained(run: RayRun, rollouts: int) -> list[dict]:
    rows = run.rows()
    assert [r["rollout"] for r in rows] == list(range(rollouts)), run.text[-3000:]
    assert all(r["samples"] == 8 and r["failed_samples"] == 0 for r in rows)  # 0 samples lost
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    return rows


@pytest.fixture(scope="module")
def uninterrupted(cluster, tiny_checkpoint, tmp_path_factory):
    """The reference run: engines on one node, trainer ranks on the other, checkpoints every rollout; smg placed as
    the router (the runs below take ours: it rejoins a restarted engine, and the resumed run's final weights equal
    these whichever router sent the requests)."""
    out = tmp_path_factory.mktemp("ray-uninterrupted")
    more = ("--save", str(out / "ckpt"), "--save-interval", "1")
    run = RayRun(cluster.address, flags(tiny_checkpoint, out, *more), out, ray_flags=SMG)
    # while the ranks train: smg's chat path keeps the capture fields (placed before any rank starts, it lives until
    # the run ends)
    router = run.line("router:").rsplit(" ", 1)[1]
    chat = {
        "model": str(tiny_checkpoint),
        "messages": [{"role": "user", "content": "What is 1 plus 2?"}],
        "max_tokens": 4,
        "top_k": 8,
        "top_p": 0.9,
        "return_sampling_mask": True,
        "return_meta_info": True,
    }
    run.chat = httpx.post(router + "/v1/chat/completions", json=chat, timeout=60).json()
    assert run.wait() == 0, run.text[-3000:]
    return run


@pytest.mark.slow
def test_two_nodes_engines_on_one_trainer_ranks_on_the_other(cluster, uninterrupted):
    import psutil

    run = uninterrupted
    rows = check_trained(run, 3)
    # every push, fanned out by smg, reached the engine that sampled after it
    assert all(r["policy_lag_max"] == 0 for r in rows)
    text = run.text
    assert run.line("router:").startswith("router: smg on node ")
    served = ast.literal_eval(text.split("smg's requests per engine ")[1].split("; logs")[0])
    assert len(served) == 2 and min(served.values()) > 0, served
    assert "--enable-rl" in (run.out / "logs" / "router.log").read_text().splitlines()[0]
    assert len(run.chat["choices"][0]["meta_info"]["output_token_sampling_mask"]) == 4, run.chat
    assert f"cluster at {cluster.address} (2 node(s)), dashboard as the cluster was started" in text
    assert "placement group of 4 bundles {'sim_gpu': 1.0, 'CPU': 1.0}, strategy PACK" in text
    node = {a: run.line(a + ":").split(" node ")[1].split(" ")[0] for a in ("trainer rank 0", "trainer rank 1")}
    node |= {a: run.line(a + ":").split(" node ")[1].split(" ")[0] for a in ("engine0", "engine1")}
    assert node["trainer rank 0"] == node["trainer rank 1"] != node["engine0"] == node["engine1"]
    assert {p.name for p in (run.out / "logs").iterdir()} == {f"{a}.log" for a in ("engine0", "engine1", "router")} | {
        "rank0.log",
        "rank1.log",
    }
    # every Ray process of the cluster listens on loopback alone, and every actor advertised it
    placed = [run.line(a + ":") for a in ("trainer rank 0", "trainer rank 1", "engine0", "engine1", "router")]
    addresses = {line.split(" node ")[1].split("(")[1].split(")")[0] for line in placed}
    assert addresses == {"127.0.0.1"}, addresses
    listening = {}
    for proc in psutil.Process().children(recursive=True):
        try:  # Ray's processes alone (gcs_server, raylets, ray::* workers and agents, its Python monitors): servers
            # other tests of the session left running are not the cluster's
            if not (
                proc.name() in ("gcs_server", "raylet") or "ray::" in proc.name() or "/ray/" in " ".join(proc.cmdline())
            ):
                continue
            listening |= {c.laddr.ip: proc.name() for c in proc.net_connections() if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    assert listening and set(listening) <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


def kill_with_a_request_in_flight(run: RayRun, pid: int, router: str, url: str) -> None:
    """SIGKILL the engine while the router waits on its answer. A request seen outstanding may be answered before
    the kill lands (a short one takes milliseconds), so the engine is frozen first: one still outstanding after a
    pause in which a stopped process can answer nothing is in flight when it dies."""

    def in_flight() -> bool:
        return any(w["url"] == url and w.get("outstanding", 0) > 0 for w in httpx.get(router + "/workers").json())

    while True:
        while not in_flight():
            assert run.proc.poll() is None, run.text[-3000:]
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.3)  # an answer already on its way reaches the router
        if in_flight():
            break
        os.kill(pid, signal.SIGCONT)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_an_engine_killed_mid_rollout_is_restarted_and_rejoins_at_the_current_weights(
    cluster, tiny_checkpoint, tmp_path
):
    out, hold = tmp_path / "run", tmp_path / "hold"
    # the rollouts are held (in the reward) from the kill until the engine is back, so that the run outlasts the
    # restart on a loaded machine too (40 unheld rollouts once ended before it, the restart took over 13 s)
    held = ("--custom-rm-path", "rewards_for_tests:digit_share_unless_held")  # given after flags()' own: it wins
    more = ("--async-rollout", "--max-policy-lag", "1", *held)
    env = {HOLD_ENV: str(hold)}
    run = RayRun(cluster.address, flags(tiny_checkpoint, out, *more, rollouts=12), out, env=env)
    pid, router = run.pid("engine0"), run.line("router:").rsplit(" ", 1)[1]
    url = run.line("engine0:").rsplit(" ", 1)[1]
    while len(run.rows()) < 1:  # after the first push: the engine that comes back must load a newer version
        assert run.proc.poll() is None, run.text[-3000:]
        time.sleep(0.02)
    kill_with_a_request_in_flight(run, pid, router, url)
    hold.touch()
    deadline = time.monotonic() + 300
    while not any("rejoined the router" in x for x in list(run.lines)):
        assert run.proc.poll() is None and time.monotonic() < deadline, run.text[-3000:]
        time.sleep(0.05)
    hold.unlink()
    assert run.wait() == 0, run.text[-3000:]
    rows = check_trained(run, 12)
    assert "ray-run: engine0 died" in run.text
    rejoined = [x for x in run.lines if "rejoined the router" in x]
    assert len(rejoined) == 1, run.text[-3000:]
    version = rejoined[0].split("weight_version ")[1].strip().strip("'")
    assert int(version) >= 1  # a pushed version, not the checkpoint's
    # the requests in flight on the killed engine were answered by the other one: none unserved, none failed
    assert "engine restarts 1; router retries " in run.text and ", unserved 0," in run.text
    assert int(run.text.split("router retries ")[1].split(",")[0]) >= 1
    new_url = "http" + rejoined[0].split(" at http")[1].split(";")[0]
    served = ast.literal_eval(run.text.split("engines in rotation ")[1].split("; logs")[0])
    assert served[new_url] > 0 and url not in served  # its second life served requests, its first is gone
    assert sum(r["failed_samples"] for r in rows) == 0


@pytest.mark.slow
def test_a_trainer_rank_killed_stops_the_job_and_the_resumed_job_ends_at_the_same_weights(
    cluster, tiny_checkpoint, uninterrupted, tmp_path
):
    out = tmp_path / "run"
    more = ("--save", str(out / "ckpt"), "--save-interval", "1")
    run = RayRun(cluster.address, flags(tiny_checkpoint, out, *more), out)
    pid = run.pid("trainer rank 1")
    while not (out / "ckpt" / "rollout_000001").exists():
        assert run.proc.poll() is None, run.text[-3000:]
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    assert run.wait() == 1
    assert "trainer rank 1" in run.text and "died" in run.text and "run it again with --resume" in run.text
    resumed = RayRun(cluster.address, flags(tiny_checkpoint, out, *more, "--resume"), out)
    assert resumed.wait() == 0, resumed.text[-3000:]
    final = "ckpt/rollout_000003/model.safetensors"
    a, b = load_file(str(uninterrupted.out / final)), load_file(str(out / final))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_partial_rollouts_on_two_nodes(cluster, tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    # 4 groups sent, the first 2 to finish train; the stop gate in each engine actor (tests/stop_gate.py, through
    # tests/gate_site) holds the requests of the highest fresh group it was sent until the rollout's stop, so the stop
    # always finds some unfinished: they are kept, and continued after the push (before the gate, 48 tokens and two
    # requests decoded at a time were meant to outlast the stop, and at 12 tokens often did not). Lag 2: a group kept
    # at the first rollout's end may finish in the third (at lag 1 its tokens of the first version were masked and
    # some samples dropped)
    more = ("--partial-rollout", "--over-sampling-batch-size", "4", "--max-policy-lag", "2", "--rollout-ignore-eos")
    more += ("--rollout-max-response-len", "16", "--max-running-requests", "2")
    run = RayRun(cluster.address, flags(tiny_checkpoint, out, *more), out, env=stop_gate_environment(4))
    assert run.wait() == 0, run.text[-3000:]
    rows = check_trained(run, 3)
    assert all(r["stopped_requests"] > 0 for r in rows), rows
    assert sum(r["straddling_samples"] for r in rows[1:]) > 0  # kept samples continued under a later version
    generated = sum(r["generated_tokens"] for r in rows)
    assert generated == sum(r["trained_tokens"] for r in rows) + rows[-1]["kept_tokens"]  # 0 thrown away


def test_engine_restarts_need_our_router(capsys):
    from support_replay.cli import main

    assert main(["ray-run", "--ray-router", "smg", "--ray-engine-restarts", "2", "--", "--num-rollout", "1"]) == 2
    assert "--ray-engine-restarts=2: with --ray-router smg an engine that dies leaves smg" in capsys.readouterr().err
