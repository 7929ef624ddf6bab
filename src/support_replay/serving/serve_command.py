"""``support-replay serve`` as a function: what the command line runs, and what ray-run's engine actors run on a
thread of their own (ray_launch/actors.py)."""

from __future__ import annotations

import argparse

import torch

from ..errors import SupportReplayError
from .flags import connections_from_args, keys_from_args


def run_serve(args: argparse.Namespace) -> int:
    """``support-replay serve``: load the checkpoint, build the engine, serve it until stopped."""
    import logging

    from ..engine import Engine
    from ..engine.kv_budget import available_bytes, fraction_tokens, kv_bytes_per_token
    from ..engine.model_runner import load_model_and_tokenizer
    from ..rollout.chat import load_template
    from .serve_flags import engine_settings
    from .server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings, keys = engine_settings(args), keys_from_args(args)
    if args.mem_fraction_static is not None and settings.max_total_tokens is not None:
        raise SupportReplayError("serve: give --mem-fraction-static or --max-total-tokens, not both")
    before = available_bytes()
    model, tokenizer = load_model_and_tokenizer(args.hf_checkpoint, getattr(torch, args.dtype), settings.device)
    if args.mem_fraction_static is not None:
        tokens = fraction_tokens(args.mem_fraction_static, before, available_bytes(), kv_bytes_per_token(model))
        settings = settings.but(max_total_tokens=tokens)
    engine = Engine(model, tokenizer, settings)
    print(f"support-replay engine: {args.hf_checkpoint} on http://{args.host}:{args.port}", flush=True)
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
        connections=connections_from_args(args),
    )
    return 0
