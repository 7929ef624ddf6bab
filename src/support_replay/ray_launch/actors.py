"""The actors ray-run places: a probe per bundle, an engine, the router (ours or smg), a trainer rank.

Each writes its output to its own log in the run's ``logs/`` (appending: a restarted engine's second life follows
its first) and works in the driver's directory when the node has it. An engine is our ``serve`` on a thread of its
actor (a server process of its own for ``--launch-server sglang`` or ``vllm``, which dies with the actor), listening
on a fresh port of its node at every start: a restarted engine is a new address the router admits only through a
rejoin (router_membership.py), never the old one answering with the checkpoint's weights.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import ray


def _settle(log: Path, cwd: str, env: dict[str, str]) -> None:
    """Output to ``log``, the driver's directory and environment (what a flag's relative path means)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    if os.path.isdir(cwd):
        os.chdir(cwd)
    # the interpreter started before this environment: its PYTHONPATH (a reward module's folder) and the driver's
    # directory join the import path by hand
    for entry in [cwd, *env.get("PYTHONPATH", "").split(os.pathsep)][::-1]:
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)


def _where() -> dict:
    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "address": ray.util.get_node_ip_address(), "pid": os.getpid()}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
class BundleProbe:
    """Where a bundle landed: (node address, node id, device id)."""

    def where(self) -> tuple[str, str, int]:
        gpus = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), int(gpus[0]) if gpus else 0


@ray.remote
class EngineActor:
    def __init__(
        self,
        name: str,
        command: list[str],
        log: str,
        cwd: str,
        env: dict[str, str],
        timeout: float,
        device_given: bool = False,
    ):
        from ..launch import wait_healthy

        _settle(Path(log), cwd, env)
        host = ray.util.get_node_ip_address()
        port = _free_port(host)
        command = on_this_actor(command, ray.get_gpu_ids(), device_given)
        command = _with(command, "--host", host)
        command = _with(command, "--port", str(port))
        self.url, self.started = f"http://{host}:{port}", time.time()
        print(f"== {name} (pid {os.getpid()}) on {self.url}: {' '.join(command)}", flush=True)
        self.process = None
        if command[1:4] == ["-m", "support_replay.cli", "serve"]:
            self._serve_on_a_thread(command[4:])
        else:  # SGLang's or vLLM's server: its own process group, which ends with this actor
            self.process = _child(command)
        wait_healthy(self.url, self.process, timeout, Path(log))

    def _serve_on_a_thread(self, argv: list[str]) -> None:
        from ..serving.serve_command import run_serve
        from ..serving.serve_flags import serve_parser

        args = serve_parser().parse_args(argv)

        def serve():
            try:
                run_serve(args)
                print("serve ended: the actor ends with it", flush=True)
            except BaseException as exc:  # noqa: BLE001 - whatever stopped it, the actor must not outlive its engine
                print(f"serve failed: {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)

        threading.Thread(target=serve, name="serve", daemon=True).start()

    def info(self) -> dict:
        return {"url": self.url, "started": self.started, **_where()}

    def stop(self) -> None:
        """SGLang's or vLLM's server and its children stopped as local-run stops them (its process group, SIGTERM then
        SIGKILL); our serve ends with the actor."""
        from ..launch import stop_group

        if self.process is not None:
            stop_group(self.process)


@ray.remote(num_cpus=0, max_restarts=0)
class RouterActor:
    def __init__(self, engine_urls: list[str], request_timeout: float, log: str, cwd: str, env: dict[str, str]):
        from ..launch import wait_healthy
        from ..serving.router import Router, create_router_app
        from ..serving.router_membership import Membership
        from ..serving.security import Keys
        from ..serving.server import allowed_hosts_for
        from ..serving.threaded import ThreadedServer

        _settle(Path(log), cwd, env)
        host = ray.util.get_node_ip_address()
        # the keys of the environment ray-run forwards ($SUPPORT_REPLAY_ADMIN_KEY..., $SUPPORT_REPLAY_UPSTREAM_*: what a
        # cluster whose nodes reach each other off loopback needs, docs/scaling.md)
        self.router = Router(
            engine_urls,
            health_interval=1.0,
            request_timeout=request_timeout,
            keys=Keys.load(),
            upstream=Keys.load_upstream(),
            membership=Membership(),
        )
        app = create_router_app(self.router, allowed_hosts=allowed_hosts_for(host, None))
        self.server = ThreadedServer(app, host, _free_port(host), lifespan="on").start()
        self.url = self.server.url
        wait_healthy(self.url)
        print(f"== router (pid {os.getpid()}) on {self.url} in front of {engine_urls}", flush=True)

    def info(self) -> dict:
        return {"url": self.url, **_where()}

    def drop(self, url: str) -> None:
        self.router.loop.call_soon_threadsafe(self.router.drop, url)

    def rejoin(self, url: str, replacing: str | None) -> str | None:
        import asyncio

        done = asyncio.run_coroutine_threadsafe(self.router.rejoin(url, replacing), self.router.loop)
        version = done.result(timeout=600)
        print(f"== {url} rejoined (in place of {replacing}) at weight_version {version!r}", flush=True)
        return version

    def counts(self) -> dict:
        """Requests retried on another engine, requests no engine served, requests each engine in rotation served."""
        r = self.router
        served = {w.url: w.served for w in r.workers}
        return {"retries": r.retries, "unserved": r.unserved, "served": served}

    def left(self) -> list[str]:
        """The engines out of rotation (dropped, or unreachable in a broadcast) until they rejoin."""
        return sorted(self.router.membership.left)


@ray.remote(num_cpus=0, max_restarts=0)
class SmgRouterActor:
    """smg (PyPI, the maintained SGLang router) in front of the engines, a process of this actor that dies with it:
    round robin, its RL control plane on (``--enable-rl``: the trainer's weight loads fan out through it,
    backends/sglang_weights.py), every address and its metrics on the node's. An engine that dies is removed from
    it; none rejoins (ray-run starts its engines without restarts under smg)."""

    def __init__(self, engine_urls: list[str], request_timeout: float, log: str, cwd: str, env: dict[str, str]):
        from ..launch import wait_healthy, wait_smg_workers

        _settle(Path(log), cwd, env)
        host = ray.util.get_node_ip_address()
        port, metrics = _free_port(host), _free_port(host)
        command = [sys.executable, "-m", "smg", "launch", "--host", host, "--port", str(port)]
        command += ["--worker-urls", *engine_urls, "--policy", "round_robin", "--enable-rl"]
        command += ["--prometheus-host", host, "--prometheus-port", str(metrics)]
        # its first look at the workers after 1 s, not its default 30
        command += ["--worker-startup-check-interval", "1", "--request-timeout-secs", str(int(request_timeout))]
        print(f"== smg router (pid {os.getpid()}): {' '.join(command)}", flush=True)
        self.process = _child(command)
        self.url, self.metrics = f"http://{host}:{port}", f"http://{host}:{metrics}/metrics"
        wait_healthy(self.url, self.process, 120, Path(log))
        wait_smg_workers(self.url, len(engine_urls), self.process, Path(log))  # every engine before any request
        print(f"== smg router on {self.url} in front of {engine_urls}", flush=True)

    def info(self) -> dict:
        return {"url": self.url, "router": "smg", **_where()}

    def drop(self, url: str) -> None:
        """The dead engine out of smg, so that no request waits on it: its id from the RL control plane's worker list
        (smg's own client, ``smg/rl.py``, reads ``id`` and ``url`` there), removed at ``/workers/{id}`` (the location
        smg 1.13 answers when a worker is added). If smg refuses, its own health checks take the engine out."""
        import httpx

        try:
            for w in httpx.get(self.url + "/v1/rl/workers", timeout=5).json().get("workers", []):
                if str(w.get("url", "")).rstrip("/") == url.rstrip("/"):
                    reply = httpx.delete(f"{self.url}/workers/{w['id']}", timeout=5)
                    print(f"== smg: {url} removed (HTTP {reply.status_code}: {reply.text[:200]})", flush=True)
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as exc:
            print(f"== smg: {url} not removed ({type(exc).__name__}: {exc}); its health checks drop it", flush=True)

    def rejoin(self, url: str, replacing: str | None) -> str | None:
        raise RuntimeError("smg: an engine does not rejoin (ray-run starts engines without restarts under smg)")

    def counts(self) -> dict:
        """smg's own count of the requests each engine answered, read from its metrics."""
        import httpx

        served: dict[str, int] = {}
        for line in httpx.get(self.metrics, timeout=5).text.splitlines():
            if line.startswith("smg_worker_requests_total{") and 'worker="' in line:
                worker = line.split('worker="', 1)[1].split('"', 1)[0]
                served[worker] = served.get(worker, 0) + int(float(line.rsplit(" ", 1)[1]))
        return {"retries": None, "unserved": None, "served": served}

    def left(self) -> list[str]:
        """None to readmit: a dead engine leaves smg for good."""
        return []

    def stop(self) -> None:
        from ..launch import stop_group

        stop_group(self.process)


@ray.remote(max_restarts=0)
class TrainerRank:
    def __init__(self, rank: int, log: str, cwd: str, env: dict[str, str]):
        _settle(Path(log), cwd, env)
        self.rank = rank

    def info(self) -> dict:
        return _where()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on it, where the others meet it (torch.distributed's TCP store)."""
        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def train(self, cfg, as_given, world: int, master: tuple[str, int]) -> int:
        """This rank of ``cfg`` (rollouts through the router), in a torch.distributed group formed here: gloo on a
        CPU, NCCL on CUDA (train/dist.py). Returns how many metrics rows it wrote (rank 0; the others none)."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",  # Ray gives each rank its own device (CUDA_VISIBLE_DEVICES): the first it sees
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        from ..train.loop import train

        print(
            f"== trainer rank {self.rank} of {world} (pid {os.getpid()}), group at {master[0]}:{master[1]}", flush=True
        )
        return len(train(cfg, as_given=as_given) or [])


def on_this_actor(command: list[str], gpu_ids: list, device_given: bool = False) -> list[str]:
    """An engine's command with the devices Ray gave its actor. Ray shows an actor only its own GPUs
    (``CUDA_VISIBLE_DEVICES``, numbered from 0 inside it), so a device the driver picked (``cuda:i``, SGLang's
    ``--base-gpu-id i x per``) names one the actor may not see, and a driver without CUDA picked none at all: our
    serve takes the actor's first (``cuda:0``) unless ``--ray-engine-device`` named one (``device_given``), SGLang
    starts at its first (``--base-gpu-id 0``, as slime's engines take their base GPU from their actor's), and vLLM
    reads ``CUDA_VISIBLE_DEVICES`` itself. An actor Ray gave no GPU (a CPU cluster's ``sim_gpu``) keeps the command."""
    if not gpu_ids:
        return command
    if command[1:4] == ["-m", "support_replay.cli", "serve"]:
        return command if device_given else _with(command, "--device", "cuda:0")
    if command[1:3] == ["-m", "sglang.launch_server"]:
        return _with(command, "--base-gpu-id", "0")
    return command


def _with(command: list[str], flag: str, value: str) -> list[str]:
    if flag in command:
        i = command.index(flag)
        return [*command[: i + 1], value, *command[i + 2 :]]
    return [*command, flag, value]


def _child(command: list[str]):
    """A server process that dies with this actor (``PR_SET_PDEATHSIG``, Linux): a SIGKILL of the actor leaves no
    engine behind listening."""
    import ctypes
    import signal
    import subprocess

    def die_with_parent():
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return subprocess.Popen(
        command, stdout=sys.stdout, stderr=sys.stderr, preexec_fn=die_with_parent, start_new_session=True
    )
