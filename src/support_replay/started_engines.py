"""The engines a training run starts itself: Miles' launch path, on local-run's processes.

``train --rollout-num-gpus-per-engine G`` (train/launch_config.py) starts ``rollout_num_gpus / G``
engines beside the trainer, each a server process on a free loopback port, our router in front of
them, and trains through the router as with ``--rollout-url``; they stop when the run ends. Rank 0
starts them; every rank hears the router's address (or why they did not start). The server is
``support-replay serve`` or SGLang's ``python -m sglang.launch_server``. Its command line is the
launch's flags (the model, the port, the device, ``--rollout-dtype``, ``--rollout-seed``, the rollout's
sampler and capture, ``--deterministic`` under ``--true-on-policy-mode``), then the ``--sglang-*``
flags without their prefix. Before anything starts, that command line is parsed by the server's own
parser: ours (serve takes the SGLang names of the flags it implements, ``SERVE_SGLANG_FLAGS``), or
SGLang's ``prepare_server_args`` (the function its ``launch_server`` calls), run from the SGLang this
Python has. ``--launch-server vllm`` starts vLLM's OpenAI server instead, its command line made from the run
(``vllm_command``) in dev mode (``VLLM_SERVER_DEV_MODE=1``: its weight routes); the trainer speaks vLLM's protocol
to it through the router, which broadcasts vLLM's pause, reload and resume to every engine. Weights reach the
engines as they reach any ``--rollout-url`` engine (``/update_weights_from_disk`` or vLLM's ``reload_weights``
from the run's directory, or their body with ``--weight-transport http`` for serve).
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from .errors import ConfigError
from .launch import engines_behind_router, free_port
from .serving.serve_flags import engine_args
from .train.config import RunConfig
from .train.launch_config import SGLANG_PREFIX, VLLM_PREFIX

# SGLang flags the launch sets from the run itself (Miles sets the same ones: its prefixed flags skip them)
LAUNCH_SETS = {
    "model-path": "the engines load --hf-checkpoint",
    "tp-size": "each engine's tensor-parallel size is --rollout-num-gpus-per-engine",
    "host": "the engines listen on loopback; --sglang-router-ip places the router",
    "port": "each engine gets a free port; --sglang-router-port places the router",
    "base-gpu-id": "engine i starts at device i x --rollout-num-gpus-per-engine",
    "dtype": "the engines run --rollout-dtype",
    "random-seed": "the engines are seeded by --rollout-seed",
    "enable-return-routed-experts": "set by --use-rollout-routing-replay",
    "rl-on-policy-target": "set by --true-on-policy-mode (with --enable-deterministic-inference)",
}
CHECK_SGLANG = "import sys\nfrom sglang.srt.server_args import prepare_server_args\nprepare_server_args(sys.argv[1:])\n"
# vLLM 0.32's own parse and check of its server's command line (entrypoints/launchers/api_server/entry.py's main)
CHECK_VLLM = (
    "import sys\nfrom vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "validate_parsed_serve_args(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]))\n"
)
# vLLM flags the launch sets from the run itself
VLLM_LAUNCH_SETS = {
    "model": "the engines load --hf-checkpoint",
    "host": "the engines listen on loopback; --sglang-router-ip places the router",
    "port": "each engine gets a free port",
    "tensor-parallel-size": "each engine's tensor-parallel size is --rollout-num-gpus-per-engine",
    "dtype": "the engines run --rollout-dtype",
    "seed": "the engines are seeded by --rollout-seed",
    "logprobs-mode": "log mu is vLLM's processed log-probs (processed_logprobs)",
    "max-logprobs": "every id of the support is returned (-1)",
    "enable-scale-out": "set by --vllm-endpoint generate (/inference/v1/generate)",
    "return-sampling-mask": "set by --vllm-capture native",
    "enable-return-routed-experts": "set by --use-rollout-routing-replay",
    "max-num-seqs": "set by --max-running-requests",
    "enable-lora": "set by --lora-rank with --lora-sync adapter",
    "max-lora-rank": "set by --lora-rank with --lora-sync adapter",
}
ENGINE_START_TIMEOUT = 900.0  # seconds: a large checkpoint loads before /health answers


def server_flags(given: tuple[str, ...], prefix: str = SGLANG_PREFIX, sets: dict = LAUNCH_SETS) -> list[str]:
    """The ``--sglang-*`` (``--vllm-*``) flags without their prefix; one the launch sets itself is refused by name."""
    out = []
    for token in given:
        if token.startswith(prefix):
            name = token[len(prefix) :].split("=", 1)[0]
            if name in sets:
                raise ConfigError(f"{prefix}{name}: {sets[name]}")
            token = "--" + token[len(prefix) :]
        out.append(token)
    return out


def engine_command(
    cfg: RunConfig, checkpoint: str, port: int, index: int, weights_dir: Path, pick_device: bool = True
) -> list[str]:
    """The command line of engine ``index`` on ``port``; ``pick_device``: our serve on this machine's CUDA device
    ``index`` when it has one (ray-run's actors take the device Ray gives them instead: ray_launch/actors.py)."""
    launch, rollout, replay = cfg.launch, cfg.rollout, cfg.replay
    per = launch.rollout_num_gpus_per_engine
    extra = server_flags(launch.sglang_server_args)
    if launch.launch_server == "sglang":
        command = [launch.launch_python or sys.executable, "-m", "sglang.launch_server", "--model-path", checkpoint]
        command += ["--host", "127.0.0.1", "--port", str(port), "--tp-size", str(per)]
        command += ["--base-gpu-id", str(index * per), "--dtype", replay.rollout_dtype]
        command += ["--random-seed", str(rollout.rollout_seed)]
        if replay.use_rollout_routing_replay:
            command.append("--enable-return-routed-experts")
        limit = cfg.engine.max_running_requests
        if limit is not None:  # train's own limit, which partial rollouts' over-sampling queues behind
            if any(token.split("=", 1)[0] == "--max-running-requests" for token in extra):
                raise ConfigError(
                    f"--sglang-max-running-requests: given beside --max-running-requests {limit}, which SGLang "
                    "takes from the run: give one"
                )
            command += ["--max-running-requests", str(limit)]
        return command + extra
    if launch.launch_server == "vllm":
        return vllm_command(cfg, checkpoint, port)
    settings = cfg.in_process_engine(checkpoint).settings  # the engine a run without --rollout-url builds
    if pick_device and torch.cuda.is_available():
        settings = settings.but(device=f"cuda:{index % torch.cuda.device_count()}")
    if "--enable-deterministic-inference" in extra:  # given by its SGLang name
        settings = settings.but(deterministic=False)
    command = [sys.executable, "-m", "support_replay.cli", "serve", "--hf-checkpoint", checkpoint]
    command += ["--host", "127.0.0.1", "--port", str(port), "--weights-dir", str(weights_dir)]
    command += ["--dtype", replay.rollout_dtype, *engine_args(settings)]
    return command + extra


def vllm_command(cfg: RunConfig, checkpoint: str, port: int) -> list[str]:
    """vLLM's OpenAI server as the trainer's vLLM client needs it (docs/engines.md): log mu from its processed
    log-probs with every id of the support returned, or its native mask; the token-in/token-out endpoint; routed
    experts and run-time adapters when the run replays routing or syncs LoRA adapters."""
    launch, rollout, engine, replay = cfg.launch, cfg.rollout, cfg.engine, cfg.replay
    command = [launch.launch_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", checkpoint, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--tensor-parallel-size", str(launch.rollout_num_gpus_per_engine), "--dtype", replay.rollout_dtype]
    command += ["--seed", str(rollout.rollout_seed), "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    if engine.vllm_endpoint == "generate":
        command.append("--enable-scale-out")  # /inference/v1/generate
    if engine.vllm_capture == "native":
        command.append("--return-sampling-mask")
    if replay.use_rollout_routing_replay:
        command.append("--enable-return-routed-experts")
    if engine.max_running_requests is not None:
        command += ["--max-num-seqs", str(engine.max_running_requests)]
    if cfg.lora_rank and cfg.lora_sync == "adapter":
        command += ["--enable-lora", "--max-lora-rank", str(cfg.lora_rank), "--max-loras", "1"]
    return command + server_flags(launch.vllm_server_args, VLLM_PREFIX, VLLM_LAUNCH_SETS)


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """What a started engine's environment needs beyond the trainer's: vLLM's weight and adapter routes."""
    if cfg.launch.launch_server != "vllm":
        return {}
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if cfg.lora_rank and cfg.lora_sync == "adapter":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


SERVER_FLAGS = {"--hf-checkpoint", "--host", "--port", "--weights-dir", "--dtype"}  # what engine_command gives serve


def check_serve_command(command: list[str]) -> None:
    """Parse ``command`` with serve's own parser; a flag it does not take is refused by its ``--sglang-`` name."""
    from .serving.serve_flags import SERVE_SGLANG_FLAGS, engine_flag_names, serve_parser

    at, given_by_the_run = command.index("serve"), SERVER_FLAGS | engine_flag_names()
    for token in command[at + 1 :]:
        name = token.split("=", 1)[0]
        if name.startswith("--") and name not in SERVE_SGLANG_FLAGS and name not in given_by_the_run:
            raise ConfigError(
                f"{SGLANG_PREFIX}{name[2:]}: a flag of SGLang's server that support-replay serve does not implement "
                f"(it takes {', '.join(SGLANG_PREFIX + f[2:] for f in SERVE_SGLANG_FLAGS)}); --launch-server "
                "sglang starts SGLang with it on a machine that has SGLang"
            )
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            serve_parser().parse_args(command[at + 1 :])
    except SystemExit:
        said = err.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]  # "argument --x/--y: why"
        names, _, why = said.removeprefix("argument ").partition(": ")
        sglang = [n for n in names.split("/") if n in SERVE_SGLANG_FLAGS]
        where = f"{SGLANG_PREFIX}{sglang[0][2:]}" if sglang else names
        raise ConfigError(f"{where}: {why} (support-replay serve's parser, for the engines this run starts)") from None


def check_sglang_command(command: list[str]) -> None:
    """Parse ``command`` with SGLang's ``prepare_server_args``, in the Python that will run it (``--launch-python``,
    or this one); its error is the refusal."""
    hint = "e.g. make sglang's .venv-sglang/bin/python; or use --launch-server support-replay"
    _parse_in_its_python(command, CHECK_SGLANG, "sglang", "SGLang", hint)


def check_vllm_command(command: list[str]) -> None:
    """Parse ``command`` with vLLM's own parser and check, in the Python that will run it; its error is the
    refusal."""
    _parse_in_its_python(command, CHECK_VLLM, "vllm", "vLLM", "e.g. make vllm's .venv-vllm/bin/python")


def _parse_in_its_python(command: list[str], script: str, module: str, server: str, hint: str) -> None:
    """``script`` run with ``command``'s arguments by ``command``'s own Python: a missing server package, or the
    server's own parser's last word, refused by name."""
    done = subprocess.run([command[0], "-c", script, *command[3:]], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return
    if f"No module named '{module}" in done.stderr:
        raise ConfigError(
            f"--launch-server={module}: {server} is not installed in {command[0]} (--launch-python names one that "
            f"has it, {hint})"
        )
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    raise ConfigError(f"{server}'s parser refuses the engines' command line: {lines[-1] if lines else done.returncode}")


def check_command(cfg: RunConfig, command: list[str]) -> None:
    if cfg.launch.launch_server == "sglang":
        check_sglang_command(command)
    elif cfg.launch.launch_server == "vllm":
        check_vllm_command(command)
    else:
        check_serve_command(command)


def start(cfg: RunConfig, stack: ExitStack, engines: int) -> str:
    """Start ``engines`` servers and the router in ``stack``; the router's URL, once every engine is healthy."""
    from .modeling.checkpoints import smollm2_checkpoint

    checkpoint = cfg.data.hf_checkpoint or str(smollm2_checkpoint())
    output = Path(cfg.output.output_dir).resolve()
    logs = output / "logs"
    ports = [free_port() for _ in range(engines)]
    commands = [engine_command(cfg, checkpoint, port, i, output) for i, port in enumerate(ports)]
    check_command(cfg, commands[0])  # every engine's differs only in its port and device
    launch = cfg.launch
    urls, router = engines_behind_router(
        stack,
        commands,
        ports,
        logs,
        host=launch.sglang_router_ip,
        router_port=launch.sglang_router_port,
        request_timeout=launch.sglang_router_request_timeout_secs,
        start_timeout=ENGINE_START_TIMEOUT,
        env=engine_env(cfg),
    )
    print(
        f"started {engines} {launch.launch_server} engine(s) {urls} behind the router {router}; logs in {logs}",
        flush=True,
    )
    return router


@contextmanager
def started_engines(cfg: RunConfig):
    """``cfg`` as it runs with the engines it starts (rank 0 starts them; they stop at the end of the block)."""
    from .train.dist import close_distributed, init_distributed, on_main

    ctx = init_distributed()
    stack = ExitStack()
    try:
        cfg.parallel.check_world(ctx.world)
        try:
            engines = cfg.launch.engine_count(ctx.world, cfg.engine.colocate)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        url = on_main(lambda: start(cfg, stack, engines), ctx)
        yield cfg.with_rollout_url(url, engines)
    finally:
        stack.close()
        close_distributed(ctx)
