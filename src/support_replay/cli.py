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
from .modeling.decode_attention import CHOICES as DECODE_ATTENTION_CHOICES
from .modeling.decode_attention import HELP as DECODE_ATTENTION_HELP
from .modeling.linear_kernels import KERNELS, LINEAR_KERNEL_HELP
from .protocol import DEFAULT_SAMPLING_MASK_MAX_TOKENS
from .serving import DEFAULT_ENGINE_PORT, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_ROUTER_PORT, DEFAULT_SESSIONS_PORT
from .serving.connection_limits import ConnectionLimits
from .serving.security import DEFAULT_MAX_WEIGHTS_BYTES


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
    import logging

    from .engine import Engine
    from .engine.kv_budget import available_bytes, fraction_tokens, kv_bytes_per_token
    from .engine.limits import EngineLimits
    from .engine.model_runner import load_model_and_tokenizer
    from .serving.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    limits = EngineLimits(
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        max_capture_ids=args.max_capture_ids,
        max_capture_ids_running=args.max_capture_ids_running,
        max_json_capture_bytes=args.max_json_capture_bytes,
        **{name: getattr(args, name) for name in GRAMMAR_LIMITS},
    )
    keys = _keys(args)
    if args.mem_fraction_static is not None and args.max_total_tokens is not None:
        raise SupportReplayError("serve: give --mem-fraction-static or --max-total-tokens, not both")
    before = available_bytes()
    model, tokenizer = load_model_and_tokenizer(args.hf_checkpoint, dtype, args.device)
    max_total_tokens = args.max_total_tokens
    if args.mem_fraction_static is not None:
        max_total_tokens = fraction_tokens(
            args.mem_fraction_static, before, available_bytes(), kv_bytes_per_token(model)
        )
    engine = Engine(
        model,
        tokenizer,
        device=args.device,
        semantics=args.semantics,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        limits=limits,
        seed=args.seed,
        deterministic=args.deterministic,
        linear_kernel=args.linear_kernel,
        decode_attention=args.decode_attention,
        max_total_tokens=max_total_tokens,
        prefix_cache=not args.disable_radix_cache,
        decode_log_interval=args.decode_log_interval,
        page_size=args.page_size,
    )
    print(f"support-replay engine: {args.hf_checkpoint} on http://{args.host}:{args.port}", flush=True)
    from .rollout.chat import load_template

    serve(
        engine,
        args.host,
        args.port,
        keys=keys,
        max_request_bytes=args.max_request_bytes,
        model_name=str(args.hf_checkpoint),
        weights_dir=args.weights_dir,
        allowed_hosts=args.allowed_host,
        chat_template=load_template(args.chat_template),
        max_weights_bytes=args.max_weights_bytes,
        connections=_connections(args),
    )
    return 0


def _keys(args: argparse.Namespace):
    from .serving.security import Keys

    if getattr(args, "api_key", None):
        print(
            "support-replay: warning: --api-key shows in the process list; prefer --api-key-file or "
            "$SUPPORT_REPLAY_API_KEY",
            file=sys.stderr,
        )
    return Keys.load(args.api_key_file, args.admin_key_file, getattr(args, "api_key", None))


def _add_key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="generation routes need Authorization: Bearer KEY (also $SUPPORT_REPLAY_API_KEY)",
    )
    parser.add_argument(
        "--admin-key-file",
        default=None,
        help="weight, version and cache routes need Authorization: Bearer KEY (also $SUPPORT_REPLAY_ADMIN_KEY)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        help="Host header to answer (repeat; default: the loopback names when bound to loopback)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body, chunked or not (413 beyond)",
    )
    # slow clients (serving/connections.py): every server cuts them off
    slow = ConnectionLimits()
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=slow.header_timeout,
        help="seconds from a connection (or a request's first byte) to the end of its headers; 408",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=slow.body_timeout,
        help="seconds from the end of a request's headers to the end of its body; closed beyond",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=slow.max_connections,
        help="connections held at once (at most the open-file limit less 256); 503 beyond",
    )
    parser.add_argument("--max-connections-per-client", type=int, default=slow.max_connections_per_client,
                        help="connections one address may hold; 503 beyond")  # fmt: skip


def _add_upstream_key_flags(parser: argparse.ArgumentParser) -> None:
    """A hop's own keys for the engines behind it; its clients' key is never sent on."""
    parser.add_argument(
        "--upstream-api-key-file",
        default=None,
        help="key sent to the engines behind (also $SUPPORT_REPLAY_UPSTREAM_API_KEY); none by default",
    )
    parser.add_argument("--upstream-admin-key-file", default=None,
                        help="admin key sent to them (also $SUPPORT_REPLAY_UPSTREAM_ADMIN_KEY)")  # fmt: skip


def _upstream(args: argparse.Namespace):
    from .serving.security import Keys

    return Keys.load_upstream(args.upstream_api_key_file, args.upstream_admin_key_file)


def _connections(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        args.header_timeout, args.body_timeout, args.max_connections, args.max_connections_per_client
    )


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
    from .train.config import config_from_args

    cfg = config_from_args(args)
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
        keys=_keys(args),
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=args.allowed_host,
        connections=_connections(args),
        upstream=_upstream(args),
    )
    return 0


def _sessions(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from .core.penalties import Penalties
    from .core.sampling import SamplingParams
    from .engine.limits import EngineLimits
    from .rollout.chat import ChatRenderer, load_template
    from .rollout.session import SessionSettings, SessionStore
    from .rollout.text_bound import TextBound
    from .serving.sessions import serve_sessions

    keys = _keys(args)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = args.vocab_size or len(tokenizer)
    if args.backend_engine == "vllm":
        from .backends.vllm import VLLMBackend

        backend = VLLMBackend(
            args.backend, vocab, endpoint=args.vllm_endpoint, capture=args.vllm_capture, api_key=_upstream(args).api
        )
    else:
        from .backends.sglang import SGLangBackend

        backend = SGLangBackend(args.backend, vocab, api_key=_upstream(args).api)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    bias = json.loads(Path(args.logit_bias).read_text()) if args.logit_bias else None
    penalties = Penalties.with_bias(args.frequency_penalty, args.presence_penalty, args.repetition_penalty, bias)
    capture = not args.no_capture and (params.top_k > 0 or params.top_p < 1 or params.min_p > 0)
    settings = SessionSettings(
        params,
        capture=capture,
        max_turns=args.max_turns,
        max_episode_tokens=args.max_episode_tokens,
        max_new_tokens=args.max_new_tokens,
        history_policy=args.history_policy,
        ttl=args.ttl,
        penalties=penalties,
    )
    store = SessionStore(
        backend,
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
        f"at {args.backend} (capture {'on' if capture else 'off'})",
        flush=True,
    )
    serve_sessions(
        store,
        args.host,
        args.port,
        keys=keys,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=args.allowed_host,
        connections=_connections(args),
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="support-replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_train, _add_audit, _add_serve, _add_sessions, _add_router, _add_local_run):
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


# serve's flags with SGLang's names and meanings: what a run's --sglang-* flags may give the engines it starts
SERVE_SGLANG_FLAGS = (
    "--mem-fraction-static",
    "--max-total-tokens",
    "--page-size",
    "--max-running-requests",
    "--enable-deterministic-inference",
    "--attention-backend",
    "--disable-radix-cache",
    "--decode-log-interval",
    "--chat-template",
)


# structured outputs' bounds (engine/grammar.py): serve flags named as the EngineLimits fields they set
GRAMMAR_LIMITS = {
    "max_grammar_requests": "grammar-constrained requests one body may carry; 400 beyond",
    "max_grammars_cached": "distinct compiled grammars kept (an LRU); a request copies its grammar's matcher",
    "grammar_compile_ms": "a grammar's compile in the grammar worker process; past it the process is killed, 400",
    "max_grammar_compiles_waiting": "grammars waiting for the grammar worker process; 503 beyond",
}


def _add_serve(sub) -> None:
    """The `serve` command: the engine server and its limits."""
    srv = sub.add_parser("serve", help="run the engine server (SGLang /generate, OpenAI chat completions)")
    srv.add_argument("--hf-checkpoint", required=True, help="Hugging Face checkpoint directory (safetensors)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=DEFAULT_ENGINE_PORT)
    srv.add_argument("--semantics", choices=SEMANTICS, default="sglang", help="filter semantics of the sampler")
    srv.add_argument(
        "--sampling-mask-max-tokens",
        type=int,
        default=DEFAULT_SAMPLING_MASK_MAX_TOKENS,
        help="largest support a request may capture",
    )
    defaults = EngineLimits()
    srv.add_argument(
        "--max-batch-size",
        "--max-running-requests",
        dest="max_batch_size",
        type=int,
        default=defaults.max_batch_size,
        help="sequences decoded together (SGLang's --max-running-requests)",
    )
    srv.add_argument(
        "--max-queue",
        type=int,
        default=defaults.max_queue,
        help="requests waiting for a slot (503 with Retry-After beyond)",
    )
    srv.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV positions the engine may hold at its peak, as SGLang's flag counts them; a request waits until "
        "it fits (default: half the memory available at start)",
    )
    srv.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="KV positions per block of the engine's pool (SGLang's flag; vLLM's --block-size): a row holds its own "
        "length in whole blocks, and a prefix is shared by whole blocks",
    )
    srv.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="SGLang's: the share of the memory free at start for the weights and the KV pool (the pool: what is "
        "free after loading less (1 - F) of what was free before); instead of --max-total-tokens",
    )
    srv.add_argument(
        "--max-new-tokens", type=int, default=defaults.max_new_tokens, help="largest max_new_tokens a request may ask"
    )
    srv.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=defaults.max_prompt_tokens,
        help="longest prompt (at most the model's context length)",
    )
    srv.add_argument(
        "--max-capture-ids",
        type=int,
        default=defaults.max_capture_ids,
        help="support ids one body (all its n samples) may capture at most: max_new_tokens x top_k (or x "
        "--sampling-mask-max-tokens where no top_k bounds a row), summed; 400 beyond",
    )
    srv.add_argument(
        "--max-capture-ids-running",
        type=int,
        default=defaults.max_capture_ids_running,
        help="support ids the running requests may hold captured at once; past it new requests wait",
    )
    srv.add_argument(
        "--max-json-capture-bytes",
        type=int,
        default=defaults.max_json_capture_bytes,
        help="an answer's captured support as JSON id lists; 400 beyond, naming sampling_mask_format=binary",
    )
    for name, help in GRAMMAR_LIMITS.items():
        srv.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name), help=help)
    srv.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings)
    srv.add_argument("--max-stop-string-length", type=int, default=defaults.max_stop_string_length)
    srv.add_argument(
        "--weights-dir",
        default=None,
        help="/update_weights_from_disk loads safetensors from under this directory only (off without it)",
    )
    srv.add_argument(
        "--max-weights-bytes",
        type=int,
        default=DEFAULT_MAX_WEIGHTS_BYTES,
        help="largest body of /update_weights_from_safetensors (needs the admin key)",
    )
    srv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    srv.add_argument("--device", default="cpu")
    srv.add_argument("--api-key", default=None, help="as --api-key-file, but visible in the process list")
    _add_key_flags(srv)
    srv.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed of their own")
    srv.add_argument(
        "--chat-template",
        default=None,
        help="Jinja file or built-in name (hermes_tools) for chat requests; default: the tokenizer's",
    )
    srv.add_argument(
        "--deterministic",
        "--enable-deterministic-inference",
        dest="deterministic",
        action="store_true",
        help="batch-invariant forward: a sequence's logits do not depend on its batch (true-on-policy; SGLang's "
        "--enable-deterministic-inference)",
    )
    srv.add_argument(
        "--attention-backend",
        choices=["torch_native"],
        default="torch_native",
        help="the model's torch attention over the rows' gathered blocks (SGLang's torch_native; batch-invariant with "
        "--deterministic); FlashAttention and FlashInfer backends need CUDA kernels this engine does not run",
    )
    srv.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="keep no finished sequences' keys and values for later prompts (the prefix cache; SGLang's flag)",
    )
    srv.add_argument(
        "--decode-log-interval",
        type=int,
        default=0,
        help="log SGLang's decode line (running requests, KV use, throughput, queue) every N decode steps (0: off)",
    )
    srv.add_argument("--linear-kernel", choices=KERNELS, default="auto", help=LINEAR_KERNEL_HELP)
    srv.add_argument("--decode-attention", choices=DECODE_ATTENTION_CHOICES, default="auto", help=DECODE_ATTENTION_HELP)
    srv.set_defaults(func=_serve)


def _add_sessions(sub) -> None:
    """The `sessions` command: multi-turn sessions in front of an engine or router."""
    ss = sub.add_parser(
        "sessions", help="multi-turn OpenAI sessions recorded token in, token out, in front of any engine or router"
    )
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
    ss.add_argument("--host", default="127.0.0.1")
    ss.add_argument("--port", type=int, default=DEFAULT_SESSIONS_PORT)
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
    ss.add_argument("--api-key", default=None, help="as --api-key-file, but visible in the process list")
    _add_key_flags(ss)
    _add_upstream_key_flags(ss)
    ss.set_defaults(func=_sessions)


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
    _add_key_flags(rt)
    _add_upstream_key_flags(rt)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    server_args: list[str] = []
    if argv[:1] in (["train"], ["audit"]):
        from .train.launch_config import LaunchConfig, split_server_args
        from .train.reference_flags import refusals

        refused = refusals(argv[1:])
        if refused:  # the reference implementation's flags this trainer does not take: all of them, at once
            lines = "\n".join(f"  {r}" for r in refused)
            print(f"support-replay: error: flags this trainer does not take (remove them):\n{lines}", file=sys.stderr)
            return 2
        # the --sglang-* flags that are not ours go, as given, to the servers of the engines the run starts
        known = {"--" + name.replace("_", "-") for name in LaunchConfig.model_fields}
        rest, server_args = split_server_args(argv[1:], known)
        argv = argv[:1] + rest
    args = build_parser().parse_args(argv)
    if server_args:
        args.sglang_server_args = tuple(server_args)
    try:
        return args.func(args)
    except SupportReplayError as exc:
        print(f"support-replay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
