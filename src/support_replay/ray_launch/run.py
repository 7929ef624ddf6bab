"""The driver of ``support-replay ray-run``: connect to (or start) a Ray cluster, place the run, watch it.

1. One placement group (placement.py), its bundles ordered by node and device, each actor printed with its node.
2. The engines (``EngineActor``, ``max_restarts``), then the router in front of them (on the driver's node), then
   the trainer ranks (``TrainerRank``), which form their torch.distributed group at rank 0's address and train
   ``train``'s config with rollouts through the router and weights pushed through it.
3. Until the ranks end: the engines watched (supervisor.py); a rank that dies stops the job (every actor killed,
   exit status 1, how to resume printed); a rank that fails, likewise with its error.

Started without ``--address``, the cluster is one node on loopback (dashboard off unless asked). Every Ray
process binds and advertises 127.0.0.1 there, and on a cluster whose address is loopback:
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before Ray is imported (Ray's single-host mode: its
``get_node_ip_address()`` answers the loopback address instead of the interface's; notes/ray.md). A cluster of
other hosts keeps Ray's default.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .placement import ENGINE_SHARE, RANK_SHARE, SIM_GPU, STRATEGIES, Layout, bundle, ordered

LOOPBACK_ENV_NAME = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_ENV = {LOOPBACK_ENV_NAME: "0"}
# the driver's environment the actors need: where modules are found, the kernels they may use, our own settings
FORWARDED = ("PYTHONPATH", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
FORWARDED_PREFIXES = ("SUPPORT_REPLAY_", "HF_", "TRANSFORMERS_", "SGLANG_", "VLLM_")


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: start a one-node cluster on loopback
    strategy: str = "PACK"
    gpu_resource: str | None = None  # None: GPU with CUDA, else SIM_GPU
    cpus_per_bundle: float = 1.0
    engine_restarts: int | None = None  # None: 3 with our router, 0 with smg
    router: str = "support-replay"  # or smg
    engine_device: str | None = None  # None: what the engines a run starts use (CUDA where there is one)
    dashboard: bool = False
    object_store_mb: int = 256


def _with_restarts(options: RayOptions, cfg) -> RayOptions:
    """The engine restarts the router can take: a restarted engine rejoins our router, which replays it the weight
    loads it broadcast (router_membership.py); smg's RL fan-out keeps no such record, so with smg none restarts."""
    from dataclasses import replace

    if options.router not in ("support-replay", "smg"):
        raise ConfigError(f"--ray-router={options.router}: support-replay or smg")
    if options.router == "smg":
        if options.engine_restarts:
            raise ConfigError(
                f"--ray-engine-restarts={options.engine_restarts}: with --ray-router smg an engine that dies leaves "
                "smg and is not restarted (a restarted engine would come back at the checkpoint's weights: only our "
                "router replays it the loads it missed); give 0 or use --ray-router support-replay"
            )
        if cfg.launch.launch_server == "vllm":
            raise ConfigError(
                "--ray-router smg: the trainer's weight sync for vLLM (pause, reload_weights, resume) goes through our "
                "router's broadcast; smg's RL fan-out is used for SGLang's routes only here"
            )
        return replace(options, engine_restarts=0)
    return replace(options, engine_restarts=3 if options.engine_restarts is None else options.engine_restarts)


def layout_of(cfg) -> Layout:
    """The launch section's own count (Miles' rule, checked when the config was built); without
    --rollout-num-gpus-per-engine, one device per engine and one engine (the actor's ranks with --colocate)."""
    ranks, per, colocate = cfg.parallel.actor_ranks or 1, cfg.launch.rollout_num_gpus_per_engine, cfg.engine.colocate
    if per is None:
        return Layout(ranks, ranks if colocate else 1, 1, colocate)
    return Layout(ranks, cfg.launch.engine_count(ranks, colocate) * per, per, colocate)


def ray_run(cfg, options: RayOptions) -> int:
    """``cfg`` (train's config) on Ray; the job's exit status."""
    if options.strategy not in STRATEGIES:
        raise ConfigError(f"--ray-placement-strategy={options.strategy}: one of {', '.join(STRATEGIES)}")
    if cfg.engine.rollout_url:
        raise ConfigError("ray-run: --rollout-url is the router ray-run starts; leave it out of the trainer's flags")
    options = _with_restarts(options, cfg)
    # a cluster on this host alone: Ray's loopback mode, set before Ray is imported (it reads it once). Never for a
    # cluster of other hosts, whose nodes must advertise the addresses they reach each other at
    loopback = options.address is None or _loopback(options.address)
    if loopback:
        os.environ.update(LOOPBACK_ENV)
    import ray

    layout = layout_of(cfg)
    output = Path(cfg.output.output_dir).resolve()
    logs = output / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    gpu = _connect(ray, options, layout, loopback)
    env = _actor_env(loopback)
    try:
        return _run(ray, cfg, options, layout, gpu, env, output, logs, began)
    finally:
        ray.shutdown()


def _connect(ray, options: RayOptions, layout: Layout, loopback: bool) -> str:
    """Connect (or start one node), and the resource name a bundle's device is."""
    import torch

    cuda = torch.cuda.is_available()
    gpu = options.gpu_resource or ("GPU" if cuda else SIM_GPU)
    common = dict(log_to_driver=False, runtime_env={"env_vars": {**LOOPBACK_ENV}} if loopback else None)
    if options.address:
        ray.init(address=options.address, _node_ip_address="127.0.0.1" if loopback else None, **common)
    else:
        resources = {} if gpu == "GPU" else {gpu: float(layout.bundles)}
        ray.init(
            _node_ip_address="127.0.0.1",
            num_cpus=max(int(layout.bundles * options.cpus_per_bundle + 0.999), 1),
            resources=resources,
            include_dashboard=options.dashboard,
            object_store_memory=options.object_store_mb * 2**20,
            **common,
        )
    head = ray.get_runtime_context().gcs_address
    dashboard = "as the cluster was started" if options.address else ("on" if options.dashboard else "off")
    print(
        f"ray-run: Ray {ray.__version__}, cluster at {head} ({len(ray.nodes())} node(s)), dashboard {dashboard}",
        flush=True,
    )
    have = ray.cluster_resources().get(gpu, 0)
    if have < layout.bundles:
        raise ConfigError(
            f"ray-run: the run needs {layout.bundles} bundles of {{{gpu}: 1, CPU: {options.cpus_per_bundle:g}}} "
            f"({layout.actor_ranks} trainer ranks, {layout.rollout_gpus} engine devices"
            f"{', colocated' if layout.colocate else ''}); the cluster declares {have:g} {gpu}"
            + ("" if gpu == "GPU" else f" (start its nodes with --resources '{{\"{gpu}\": N}}')")
        )
    return gpu


def _loopback(address: str) -> bool:
    return address.split(":")[0] in ("127.0.0.1", "localhost")


def _actor_env(loopback: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}
    env.pop(LOOPBACK_ENV_NAME, None)
    return {**env, **(LOOPBACK_ENV if loopback else {}), "PYTHONUNBUFFERED": "1"}


class Placement:
    """The placement group, its bundles in slime's order, and how an actor asks for its share of one."""

    def __init__(self, ray, options: RayOptions, layout: Layout, gpu: str):
        from ray.util.placement_group import placement_group

        from .actors import BundleProbe

        self.options, self.layout, self.gpu = options, layout, gpu
        self.group = placement_group([bundle(gpu, options.cpus_per_bundle)] * layout.bundles, options.strategy)
        ray.get(self.group.ready(), timeout=600)
        probes = [BundleProbe.options(scheduling_strategy=self.bundle(i)).remote() for i in range(layout.bundles)]
        self.order = ordered(ray.get([p.where.remote() for p in probes]))
        for p in probes:
            ray.kill(p)

    def bundle(self, index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=index)

    def share(self, device_share: float) -> dict:
        """An actor's options: its bundle's CPUs halved (colocated, an engine and a rank share one) and its share
        of the device (slime's fractions)."""
        device = {"num_gpus": device_share} if self.gpu == "GPU" else {"resources": {self.gpu: device_share}}
        return {"num_cpus": self.options.cpus_per_bundle / 2, **device}


def _run(ray, cfg, options, layout, gpu, env, output, logs, began) -> int:
    from ray.util.placement_group import remove_placement_group

    from .supervisor import Supervisor

    placement = Placement(ray, options, layout, gpu)
    placed = time.monotonic()
    engines, infos = _start_engines(ray, cfg, placement, env, output, logs)
    router, router_info = _start_router(ray, cfg, options, infos, env, logs)
    ranks, rank_infos = _start_ranks(ray, placement, env, logs)
    started = time.monotonic()
    _print_placement(placement, infos, router_info, rank_infos, cfg, output, logs)
    print(f"ray-run: cluster and placement {placed - began:.1f} s, actors up {started - placed:.1f} s", flush=True)
    running = cfg.with_rollout_url(router_info["url"], layout.engines)
    master = ray.get(ranks[0].rendezvous.remote())
    futures = {ranks[r].train.remote(running, cfg, layout.actor_ranks, master): r for r in range(layout.actor_ranks)}
    supervisor = Supervisor(router, [(f"engine{i}", e, info) for i, (e, info) in enumerate(zip(engines, infos))])
    status = _until_done(ray, futures, supervisor, rank_infos, cfg)
    counts = ray.get(router.counts.remote())
    router_counts = (
        f"smg's requests per engine {counts['served']}"
        if options.router == "smg"
        else f"router retries {counts['retries']}, unserved {counts['unserved']}, requests served by the engines in "
        f"rotation {counts['served']}"
    )
    print(
        f"ray-run: trained in {time.monotonic() - started:.1f} s; engine restarts {supervisor.restarts}; "
        f"{router_counts}; logs in {logs}",
        flush=True,
    )
    if options.router == "smg":
        ray.get(router.stop.remote())
    for actor in ranks:
        ray.kill(actor, no_restart=True)
    ray.wait([e.stop.remote() for e in engines], num_returns=len(engines), timeout=30)
    for actor in [router, *engines]:
        ray.kill(actor, no_restart=True)
    remove_placement_group(placement.group)
    return status


def _start_engines(ray, cfg, placement: Placement, env, output: Path, logs: Path):
    """Every engine actor in the bundle of its first device, each healthy: (actors, their info)."""
    from ..started_engines import ENGINE_START_TIMEOUT, check_command, engine_command, engine_env
    from .actors import EngineActor

    checkpoint = cfg.data.hf_checkpoint or _default_checkpoint()
    if placement.options.engine_device is not None and cfg.launch.launch_server == "vllm":
        raise ConfigError(
            f"--ray-engine-device={placement.options.engine_device}: vLLM's server takes its device from its build "
            "and the devices Ray gives its actor, not from a flag; leave it out with --launch-server vllm"
        )
    env = {**env, **engine_env(cfg)}

    def command(i: int) -> list[str]:  # port 0: each start takes a fresh one on its node
        line = engine_command(cfg, checkpoint, 0, i, output, pick_device=False)  # the actor takes Ray's
        device = placement.options.engine_device
        if device is None:
            return line
        if "--device" in line:
            at = line.index("--device")
            return [*line[:at], *line[at + 2 :], "--device", device]
        return [*line, "--device", device]

    check_command(cfg, command(0))
    engines = [
        EngineActor.options(
            scheduling_strategy=placement.bundle(placement.layout.engine_bundle(i, placement.order)),
            max_restarts=placement.options.engine_restarts,
            max_task_retries=0,
            **placement.share(ENGINE_SHARE),
        ).remote(
            f"engine{i}",
            command(i),
            str(logs / f"engine{i}.log"),
            os.getcwd(),
            env,
            ENGINE_START_TIMEOUT,
            placement.options.engine_device is not None,
        )
        for i in range(placement.layout.engines)
    ]
    return engines, ray.get([e.info.remote() for e in engines])


def _start_router(ray, cfg, options: RayOptions, infos, env, logs: Path):
    """The router (ours, or smg) on the driver's node, in front of the engines."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .actors import RouterActor, SmgRouterActor

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = SmgRouterActor if options.router == "smg" else RouterActor
    router = actor.options(scheduling_strategy=here).remote(
        [i["url"] for i in infos],
        cfg.launch.sglang_router_request_timeout_secs,
        str(logs / "router.log"),
        os.getcwd(),
        env,
    )
    return router, ray.get(router.info.remote())


def _start_ranks(ray, placement: Placement, env, logs: Path):
    from .actors import TrainerRank

    ranks = [
        TrainerRank.options(
            scheduling_strategy=placement.bundle(placement.layout.rank_bundle(r, placement.order)),
            **placement.share(RANK_SHARE),
        ).remote(r, str(logs / f"rank{r}.log"), os.getcwd(), env)
        for r in range(placement.layout.actor_ranks)
    ]
    return ranks, ray.get([r.info.remote() for r in ranks])


def _until_done(ray, futures: dict, supervisor, rank_infos, cfg) -> int:
    from ray.exceptions import RayActorError, RayTaskError

    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, timeout=0.2)
        for ref in done:
            rank = futures[ref]
            try:
                ray.get(ref)
            except RayActorError as exc:
                where = rank_infos[rank]
                print(
                    f"ray-run: trainer rank {rank} (pid {where['pid']}, node {where['node_id'][:12]}) died: "
                    f"{str(exc).strip().splitlines()[0][:300]}",
                    file=sys.stderr,
                    flush=True,
                )
                return _stopped(cfg)
            except RayTaskError as exc:
                print(f"ray-run: trainer rank {rank} failed: {exc.cause!r}", file=sys.stderr, flush=True)
                return _stopped(cfg)
        supervisor.check()
    return 0


def _stopped(cfg) -> int:
    save = cfg.output.save
    how = (
        f"run it again with --resume to continue from the last checkpoint under {save}"
        if save
        else "nothing to resume from: give --save (and --save-interval) to keep checkpoints"
    )
    print(f"ray-run: the job stops: every actor is killed; {how}", file=sys.stderr, flush=True)
    return 1


def _print_placement(placement: Placement, infos, router_info, rank_infos, cfg, output, logs) -> None:
    options, layout, gpu, order = placement.options, placement.layout, placement.gpu, placement.order
    cores = os.cpu_count() or 1
    logical = layout.bundles * options.cpus_per_bundle
    print(
        f"ray-run: placement group of {layout.bundles} bundles {bundle(gpu, options.cpus_per_bundle)}, strategy "
        f"{options.strategy}; {logical:g} logical CPUs declared on this machine's {cores} cores "
        f"({logical / cores:.1f}x)",
        flush=True,
    )
    for r, where in enumerate(rank_infos):
        print(
            f"  trainer rank {r}: bundle {layout.rank_bundle(r, order)}, node {where['node_id'][:12]} "
            f"({where['address']}), pid {where['pid']}",
            flush=True,
        )
    for i, info in enumerate(infos):
        print(
            f"  engine{i}: bundle {layout.engine_bundle(i, order)}, node {info['node_id'][:12]} ({info['address']}), "
            f"pid {info['pid']}, {info['url']}",
            flush=True,
        )
    print(
        f"  router: {router_info.get('router', 'support-replay')} on node {router_info['node_id'][:12]} "
        f"({router_info['address']}), pid {router_info['pid']}, {router_info['url']}",
        flush=True,
    )
    if cfg.engine.weight_transport == "http":
        weights = "in the body of each push, through the router to every engine (no shared filesystem needed)"
    else:
        load = "vLLM's reload_weights" if cfg.launch.launch_server == "vllm" else "/update_weights_from_disk"
        weights = f"through the directory {output} ({load}: every node must see this path)"
    print(f"  weights: {weights}; logs per actor in {logs}", flush=True)


def _default_checkpoint() -> str:
    from ..modeling.checkpoints import smollm2_checkpoint

    return str(smollm2_checkpoint())
