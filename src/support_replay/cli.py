"""``support-replay`` command line.

train    GRPO on the replayed support (no flags: the SmolLM2 arithmetic demo)
serve    the embedded engine behind an SGLang-compatible /generate and an OpenAI-compatible
         /v1/chat/completions, capturing S_t and log mu on request
router   forwards raw request bodies over several engines
sessions multi-turn OpenAI chat sessions for agents, recorded token in, token out, in front of
         any engine or router (support, log mu and loss mask per token)
audit    measure an engine's training-inference mismatch, split it by cause (truncation, penalties,
         numerics), look for settings drift, and certify the setup (exit status 0: pass, 1: fail)
demo     sample with top-k / top-p / min-p, capture S_t and log mu, ship the support over the
         wire codec, score it back, and show why replay matters: the importance ratio of a
         full-vocabulary scorer against the replayed one
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import SEMANTICS, SamplingParams, SupportReplayError, full_logprobs, sample_tokens, support_logprobs, wire
from .core.losses import logprob_mismatch_metrics, support_size_metrics
from .engine.limits import EngineLimits
from .serving import DEFAULT_ROUTER_PORT, DEFAULT_SESSIONS_PORT
from .serving.flags import add_key_flags, add_upstream_key_flags, connections_from_args, keys_from_args, upstream_keys


def _dense_reference(logits: torch.Tensor, tokens: torch.Tensor, support, temperature: float) -> torch.Tensor:
    """log mu by the definition, in float64 over a dense mask: an independent check of the sampler's value."""
    z = logits.double() / temperature
    rows = torch.repeat_interleave(torch.arange(support.num_rows), torch.from_numpy(support.sizes()))
    mask = torch.zeros_like(z, dtype=torch.bool)
    mask[rows, torch.from_numpy(support.ids).long()] = True
    return torch.log_softmax(z.masked_fill(~mask, float("-inf")), dim=-1).gather(1, tokens[:, None]).squeeze(1)


def _demo(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    temperature = params.temperature if params.temperature > 0 else 1.0
    gen = torch.Generator().manual_seed(args.seed)
    # peaked, heavy-tailed logits, as a language model's tend to be
    logits = torch.randn(args.tokens, args.vocab, generator=gen) * args.logit_scale
    print(
        f"support-replay demo: {args.tokens} tokens, V={args.vocab}, temperature={params.temperature}, "
        f"top_k={params.top_k}, top_p={params.top_p}, min_p={params.min_p}"
    )
    print(
        "\n| semantics | mean |S| | singletons | wire B/token | ratio full-vocab | outside [0.9,1.1] | ratio replay | "
        "outside | log mu vs float64 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for semantics in args.semantics:
        out = sample_tokens(logits, params, semantics, generator=gen)
        blob = wire.encode(out.support, args.vocab, out.tokens)
        support = wire.decode(blob, out.tokens, vocab_size=args.vocab)  # what the trainer receives
        if support != out.support:
            raise SupportReplayError(f"{semantics}: the support changed on its way through the wire codec")
        mask = torch.ones(1, args.tokens)
        replay = support_logprobs(logits, out.tokens, support, temperature)  # the trainer's score, same logits
        full = full_logprobs(logits, out.tokens, temperature)
        error = float((out.log_mu.double() - _dense_reference(logits, out.tokens, support, temperature)).abs().max())
        m_full = logprob_mismatch_metrics(full[None], out.log_mu[None], mask)
        m_rep = logprob_mismatch_metrics(replay[None], out.log_mu[None], mask)
        sizes = support_size_metrics(support.sizes())
        print(
            f"| {semantics} | {sizes['support_mean']:.1f} | {sizes['singleton_share']:.0%} | "
            f"{len(blob) / args.tokens:.1f} | {m_full['ratio_mean']:.3f} | {m_full['ratio_outside_10pct']:.1%} | "
            f"{m_rep['ratio_mean']:.3f} | {m_rep['ratio_outside_10pct']:.1%} | {error:.1e} |"
        )
    print(
        "\nreplay ratio = pi/mu on the captured support: exactly 1 when the trainer's logits equal the engine's."
        "\nlog mu vs float64: the sampler's log mu against log_softmax over the support computed densely in float64."
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .serving.serve_command import run_serve

    return run_serve(args)


def _train(args: argparse.Namespace) -> int:
    from .train.config import config_from_args

    cfg = config_from_args(args)
    print(
        f"support-replay train: replay={'on' if cfg.rollout.use_sampling_support_replay else 'off'} "
        f"(top_p={cfg.rollout.rollout_top_p}, top_k={cfg.rollout.rollout_top_k}, min_p={cfg.rollout.rollout_min_p}, "
        f"T={cfg.rollout.rollout_temperature}), "
        f"{cfg.rollout.num_rollout} rollouts of {cfg.rollout.rollout_batch_size}x{cfg.rollout.n_samples_per_prompt}, "
        f"output {cfg.output.output_dir}",
        flush=True,
    )
    rows = _with_started_engines(cfg, _run_train)
    if rows:
        print(f"done: metrics in {cfg.output.output_dir}/metrics.jsonl, plot in {cfg.output.output_dir}/metrics.png")
    return 0


def _run_train(cfg, as_given):
    from .train import train

    return train(cfg, as_given=as_given)


def _with_started_engines(cfg, run):
    """``run(cfg, as_given)``, through the engines the run starts when it starts any (started_engines.py)."""
    if not cfg.launch.starts_engines:
        return run(cfg, cfg)
    from .started_engines import started_engines

    with started_engines(cfg) as running:
        return run(running, cfg)


def _audit(args: argparse.Namespace) -> int:
    from .audit import AuditSettings, run_audit, summary
    from .audit.settings import audit_config

    cfg, left_out = audit_config(args)
    if left_out:
        print(f"the audit does not train; left out: {', '.join(left_out)}", file=sys.stderr, flush=True)
    given = {k: getattr(args, k) for k in AuditSettings.model_fields if getattr(args, k) is not None}
    settings = AuditSettings.from_flags(**given)
    report = _with_started_engines(cfg, lambda running, _: run_audit(running, settings))
    print(summary(report))
    print(f"report: {cfg.output.output_dir}/audit.json, plot: {cfg.output.output_dir}/audit.png", flush=True)
    return 0 if report["verdict"]["pass"] else 1


def _router(args: argparse.Namespace) -> int:
    from .serving.router import run_router

    print(f"support-replay router on http://{args.host}:{args.port} over {len(args.engine)} engine(s)", flush=True)
    run_router(
        args.engine,
        args.host,
        args.port,
        args.health_interval,
        request_timeout=args.request_timeout,
        keys=keys_from_args(args),
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=args.allowed_host,
        connections=connections_from_args(args),
        upstream=upstream_keys(args),
    )
    return 0


def _sessions(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from .rollout.chat import ChatRenderer, load_template
    from .rollout.session import SessionStore
    from .rollout.text_bound import TextBound
    from .serving.sessions import serve_sessions

    keys = keys_from_args(args)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    settings = _session_settings(args)
    store = SessionStore(
        _sessions_backend(args, args.vocab_size or len(tokenizer)),
        # a session's prompt text that cannot fit an engine's default prompt limit is refused before it is rendered
        ChatRenderer(
            tokenizer, load_template(args.chat_template), TextBound.of(tokenizer, EngineLimits().max_prompt_tokens)
        ),
        settings,
        max_sessions=args.max_sessions,
        max_sessions_per_caller=args.max_sessions_per_key,
    )
    print(
        f"support-replay sessions on http://{args.host}:{args.port} in front of {args.backend_engine} "
        f"at {args.backend} (capture {'on' if settings.capture else 'off'})",
        flush=True,
    )
    serve_sessions(
        store,
        args.host,
        args.port,
        keys=keys,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=args.allowed_host,
        connections=connections_from_args(args),
    )
    return 0


def _sessions_backend(args: argparse.Namespace, vocab: int):
    """The client of the engine or router the sessions generate with, in the protocol it speaks."""
    if args.backend_engine == "vllm":
        from .backends.vllm import VLLMBackend

        return VLLMBackend(
            args.backend, vocab, endpoint=args.vllm_endpoint, capture=args.vllm_capture, api_key=upstream_keys(args).api
        )
    from .backends.sglang import SGLangBackend

    return SGLangBackend(args.backend, vocab, api_key=upstream_keys(args).api)


def _session_settings(args: argparse.Namespace):
    """The run's sampling and penalties every turn carries, and the sessions' limits."""
    import json
    from pathlib import Path

    from .core.penalties import Penalties
    from .core.sampling import SamplingParams
    from .rollout.session import SessionSettings

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    bias = json.loads(Path(args.logit_bias).read_text()) if args.logit_bias else None
    return SessionSettings(
        params,
        capture=not args.no_capture and (params.top_k > 0 or params.top_p < 1 or params.min_p > 0),
        max_turns=args.max_turns,
        max_episode_tokens=args.max_episode_tokens,
        max_new_tokens=args.max_new_tokens,
        history_policy=args.history_policy,
        ttl=args.ttl,
        penalties=Penalties.with_bias(args.frequency_penalty, args.presence_penalty, args.repetition_penalty, bias),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="support-replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_demo,
        _add_train,
        _add_audit,
        _add_serve,
        _add_sessions,
        _add_router,
        _add_local_run,
        _add_ray_run,
    ):
        add(sub)
    return parser


def _add_demo(sub) -> None:
    """The `demo` command: capture, transport and replay on synthetic logits."""
    demo = sub.add_parser("demo", help="capture, transport and replay the sampling support on synthetic logits")
    demo.add_argument("--tokens", type=int, default=4096)
    demo.add_argument("--vocab", type=int, default=49152)
    demo.add_argument("--logit-scale", type=float, default=3.0)
    demo.add_argument("--temperature", "--rollout-temperature", type=float, default=1.0)
    demo.add_argument("--top-k", "--rollout-top-k", type=int, default=32)
    demo.add_argument("--top-p", "--rollout-top-p", type=float, default=0.8)
    demo.add_argument("--min-p", type=float, default=0.0)
    demo.add_argument("--semantics", nargs="+", choices=SEMANTICS, default=list(SEMANTICS))
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)


def _add_train(sub) -> None:
    """The `train` command: every RunConfig flag, grouped by section."""
    tr = sub.add_parser("train", help="GRPO with sampling-support replay (no flags: the built-in demo)")
    from .train.config import add_run_flags

    add_run_flags(tr)
    tr.set_defaults(func=_train)


def _add_audit(sub) -> None:
    """The `audit` command: train's flags (the run audited) and the certificate's."""
    au = sub.add_parser(
        "audit",
        help="measure the training-inference mismatch of a setup, split it by cause, certify it (exit 0: pass)",
        description="support-replay audit [train flags] [--max-mismatch-kl X] [--max-abs-logprob-diff Y] "
        "[--expected-weight-version V]: samples with the run's settings from its rollout source, scores every "
        "token with the trainer's forward, writes audit.json and audit.png to --output-dir (docs/audit.md)",
    )
    from .audit.settings import AuditSettings
    from .train.config import add_run_flags, field_flags

    add_run_flags(au)
    field_flags(au.add_argument_group("the certificate"), AuditSettings)
    au.set_defaults(func=_audit, output_dir="runs/audit")


def _add_serve(sub) -> None:
    """The `serve` command: the engine server, its engine's settings and limits (serving/serve_flags.py)."""
    from .serving.serve_flags import add_serve_flags

    srv = sub.add_parser("serve", help="run the engine server (SGLang /generate, OpenAI chat completions)")
    add_serve_flags(srv)
    srv.set_defaults(func=_serve)


def _add_sessions(sub) -> None:
    """The `sessions` command: multi-turn sessions in front of an engine or router."""
    ss = sub.add_parser(
        "sessions", help="multi-turn OpenAI sessions recorded token in, token out, in front of any engine or router"
    )
    _add_sessions_backend(ss)
    ss.add_argument("--host", default="127.0.0.1")
    ss.add_argument("--port", type=int, default=DEFAULT_SESSIONS_PORT)
    _add_sessions_sampling(ss)
    _add_sessions_limits(ss)
    ss.add_argument("--api-key", default=None, help="as --api-key-file, but visible in the process list")
    add_key_flags(ss)
    add_upstream_key_flags(ss)
    ss.set_defaults(func=_sessions)


def _add_sessions_backend(ss) -> None:
    """Where the sessions generate, and the tokenizer that renders their messages."""
    ss.add_argument("--backend", required=True, help="URL of the engine or router the sessions generate with")
    ss.add_argument(
        "--backend-engine",
        choices=["sglang", "vllm"],
        default="sglang",
        help="its protocol: sglang (SGLang, our serve and router, smg) or vllm",
    )
    ss.add_argument("--vllm-endpoint", choices=["generate", "completions"], default="generate")
    ss.add_argument("--vllm-capture", choices=["processed_logprobs", "native"], default="processed_logprobs")
    ss.add_argument(
        "--tokenizer",
        required=True,
        help="Hugging Face checkpoint or tokenizer directory (renders and tokenizes messages)",
    )
    ss.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary size, when it exceeds the tokenizer's length",
    )


def _add_sessions_sampling(ss) -> None:
    """The run's sampling and penalties, sent with every turn."""
    ss.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the run's rollout temperature (a turn asking another is refused)",
    )
    ss.add_argument("--top-p", type=float, default=0.8)
    ss.add_argument("--top-k", type=int, default=32)
    ss.add_argument("--min-p", type=float, default=0.0)
    ss.add_argument("--no-capture", action="store_true", help="do not capture the support (evaluation)")
    ss.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="the run's penalties, sent with every turn (a client asking others is refused)",
    )
    ss.add_argument("--presence-penalty", type=float, default=0.0)
    ss.add_argument("--repetition-penalty", type=float, default=1.0)
    ss.add_argument("--logit-bias", default=None, help="JSON file {token id: bias}")


def _add_sessions_limits(ss) -> None:
    """A session's length, its history rule, how long it is kept and how many are open."""
    ss.add_argument("--max-turns", type=int, default=8)
    ss.add_argument("--max-episode-tokens", type=int, default=1024)
    ss.add_argument("--max-new-tokens", type=int, default=256, help="per turn, when a request gives no max_tokens")
    ss.add_argument("--history-policy", choices=["split", "reject"], default="split")
    ss.add_argument(
        "--chat-template", default=None, help="Jinja file or built-in name (hermes_tools); default: the tokenizer's"
    )
    ss.add_argument("--ttl", type=float, default=900.0, help="seconds an unused session is kept")
    ss.add_argument("--max-sessions", type=int, default=4096, help="sessions open at once (503 beyond)")
    ss.add_argument(
        "--max-sessions-per-key",
        type=int,
        default=1024,
        help="conversations one API key may name with X-Session-ID at once (429 beyond); one key per line of "
        "--api-key-file, each its own namespace of ids",
    )


def _add_router(sub) -> None:
    """The `router` command."""
    rt = sub.add_parser("router", help="forward raw request bodies over several engines")
    rt.add_argument("--engine", action="append", required=True, help="engine URL (repeat for more)")
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT)
    rt.add_argument("--health-interval", type=float, default=5.0)
    rt.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one engine may take to answer; then the request goes elsewhere",
    )
    add_key_flags(rt)
    add_upstream_key_flags(rt)
    rt.set_defaults(func=_router)


def _add_local_run(sub) -> None:
    """The `local-run` command: a multi-process run on this machine."""
    lr = sub.add_parser(
        "local-run",
        help="engines, a router and torchrun trainer ranks as local processes (testing a multi-process run)",
        description="support-replay local-run --engines 2 --nproc-per-node 2 -- [train flags]",
    )
    lr.add_argument("--engines", type=int, default=2, help="support-replay serve processes behind the router")
    lr.add_argument("--nproc-per-node", type=int, default=2, help="trainer ranks (torchrun)")
    lr.add_argument("--serve-arg", action="append", default=[], help="one more flag for every serve process (repeat)")
    lr.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the trainer's flags (train's own)")
    lr.set_defaults(func=_local_run)


def _local_run(args) -> int:
    from .launch import local_run

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return local_run(train_args, engines=args.engines, nproc_per_node=args.nproc_per_node, serve_args=args.serve_arg)


def _parsed(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; for train and audit, the reference implementation's flags this trainer does not take are
    refused (all of them, at once) and the ``--sglang-*`` and ``--vllm-*`` flags that are not ours set aside for the
    servers of the engines the run starts."""
    server_args: list[str] = []
    vllm_args: list[str] = []
    if argv[:1] in (["train"], ["audit"]):
        from .train.config import FIELD_SECTION
        from .train.launch_config import VLLM_PREFIX, LaunchConfig, split_server_args
        from .train.reference_flags import refusals

        refused = refusals(argv[1:])
        if refused:
            lines = "\n".join(f"  {r}" for r in refused)
            raise SupportReplayError(f"flags this trainer does not take (remove them):\n{lines}")
        known = {"--" + name.replace("_", "-") for name in LaunchConfig.model_fields}
        rest, server_args = split_server_args(argv[1:], known)
        ours = {"--" + name.replace("_", "-") for name in FIELD_SECTION}  # --vllm-endpoint, --vllm-capture
        rest, vllm_args = split_server_args(rest, ours, VLLM_PREFIX)
        argv = argv[:1] + rest
    args = build_parser().parse_args(argv)
    if server_args:
        args.sglang_server_args = tuple(server_args)
    if vllm_args:
        args.vllm_server_args = tuple(vllm_args)
    return args


def _add_ray_run(sub) -> None:
    """The `ray-run` command: the run placed and restarted by Ray (ray_launch/)."""
    from .ray_launch.placement import SIM_GPU, STRATEGIES

    rr = sub.add_parser(
        "ray-run",
        help="engines, router and trainer ranks as Ray actors in one placement group (a Ray cluster, or one node)",
        description="support-replay ray-run [--address HEAD] -- [train flags, with Miles' placement flags: "
        "--actor-num-nodes, --actor-num-gpus-per-node, --rollout-num-gpus, --rollout-num-gpus-per-engine, --colocate]",
    )
    rr.add_argument(
        "--address",
        default=None,
        help="the Ray cluster's head (ip:port, or auto); default: start one node on loopback for this run",
    )
    rr.add_argument(
        "--ray-placement-strategy",
        default="PACK",
        choices=STRATEGIES,
        help="how the placement group's bundles spread over the nodes (slime's and Miles': PACK)",
    )
    rr.add_argument(
        "--ray-gpu-resource",
        default=None,
        help=f"the resource a bundle's device is (default: GPU with "
        f"CUDA, else the custom resource {SIM_GPU}, which each node declares)",
    )
    rr.add_argument("--ray-cpus-per-bundle", type=float, default=1.0, help="CPUs each bundle reserves")
    rr.add_argument(
        "--ray-engine-restarts",
        type=int,
        default=None,
        help="times Ray restarts an engine actor that dies (it rejoins our router at the current weights); default 3, "
        "0 with --ray-router smg",
    )
    rr.add_argument(
        "--ray-router",
        default="support-replay",
        choices=("support-replay", "smg"),
        help="the router actor in front of the engines: ours, or smg (PyPI; its RL control plane fans the weight "
        "loads out; a dead engine leaves it, none rejoins)",
    )
    rr.add_argument(
        "--ray-engine-device",
        default=None,
        help="the device of every engine (serve --device: cpu keeps our engines on their node's CPU beside GPU trainer "
        "ranks); default: a GPU where CUDA is, else the CPU",
    )
    rr.add_argument("--ray-dashboard", action="store_true", help="with the one-node cluster: start Ray's dashboard")
    rr.add_argument("--ray-object-store-mb", type=int, default=256, help="with the one-node cluster: its object store")
    rr.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the trainer's flags (train's own)")
    rr.set_defaults(func=_ray_run)


def _ray_run(args) -> int:
    from .ray_launch.run import RayOptions, ray_run
    from .train.config import config_from_args

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    cfg = config_from_args(_parsed(["train", *train_args]))
    options = RayOptions(
        address=args.address,
        strategy=args.ray_placement_strategy,
        gpu_resource=args.ray_gpu_resource,
        cpus_per_bundle=args.ray_cpus_per_bundle,
        engine_restarts=args.ray_engine_restarts,
        router=args.ray_router,
        engine_device=args.ray_engine_device,
        dashboard=args.ray_dashboard,
        object_store_mb=args.ray_object_store_mb,
    )
    return ray_run(cfg, options)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parsed(argv)
        return args.func(args)
    except SupportReplayError as exc:
        print(f"support-replay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
