"""``support-replay serve``'s flags: the server's own, and the engine's generated from its records
(``engine/settings.py``, ``engine/limits.py``) so that serve, the trainer's in-process engine and the engines a
run starts are built from one description. ``started_engines.py`` parses a started engine's command with it."""

from __future__ import annotations

import argparse

from ..engine.limits import EngineLimits
from ..engine.settings import EngineSettings
from ..record_flags import add_record_flags, flag_names, record_args, record_from_args
from . import DEFAULT_ENGINE_PORT
from .flags import add_key_flags
from .security import DEFAULT_MAX_WEIGHTS_BYTES

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
DTYPES = ("float32", "bfloat16", "float16")


def add_serve_flags(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--hf-checkpoint", required=True, help="Hugging Face checkpoint directory (safetensors)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=DEFAULT_ENGINE_PORT)
    srv.add_argument("--dtype", choices=DTYPES, default="float32")
    add_record_flags(srv.add_argument_group("the engine"), EngineSettings)
    add_record_flags(srv.add_argument_group("what one request and the queue may hold"), EngineLimits)
    srv.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="SGLang's: the share of the memory free at start for the weights and the KV pool (the pool: what is "
        "free after loading less (1 - F) of what was free before); instead of --max-total-tokens",
    )
    srv.add_argument(
        "--attention-backend",
        choices=["torch_native"],
        default="torch_native",
        help="the model's torch attention over the rows' gathered blocks (SGLang's torch_native; batch-invariant with "
        "--deterministic); FlashAttention and FlashInfer backends need CUDA kernels this engine does not run",
    )
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
    srv.add_argument("--api-key", default=None, help="as --api-key-file, but visible in the process list")
    add_key_flags(srv)
    srv.add_argument(
        "--chat-template",
        default=None,
        help="Jinja file or built-in name (hermes_tools) for chat requests; default: the tokenizer's",
    )


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="support-replay serve")
    add_serve_flags(parser)
    return parser


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    return record_from_args(EngineSettings, args, limits=record_from_args(EngineLimits, args))


def engine_args(settings: EngineSettings) -> list[str]:
    """serve's flags for ``settings`` (those that differ from serve's defaults)."""
    return record_args(settings) + record_args(settings.limits)


def engine_flag_names() -> set[str]:
    """The flags ``engine_args`` may write."""
    return flag_names(EngineSettings) | flag_names(EngineLimits)
