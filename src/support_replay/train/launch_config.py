"""The engines a run starts itself (Miles' launch flags): how many, which server, and the server's flags.

Miles starts its SGLang engines from ``--rollout-num-gpus-per-engine`` (each engine's tensor-parallel
size), ``--rollout-num-gpus`` (all of them; with ``--colocate``, the actor's) and every SGLang server
flag under a ``--sglang-`` prefix. Here ``--rollout-num-gpus-per-engine`` starts them too, beside the
trainer, behind our router: ``support-replay serve`` (``--launch-server support-replay``, the
default; it takes the SGLang names of the flags it implements), SGLang itself
(``--launch-server sglang``, on a machine that has it) or vLLM's OpenAI server (``--launch-server vllm``,
its command line made from the run's settings). The ``--sglang-*`` flags (``--vllm-*`` for vLLM, but the
trainer's own ``--vllm-endpoint`` and ``--vllm-capture``) are collected as given (``sglang_server_args``,
``vllm_server_args``) and handed to that server without the prefix; the server's own parser checks them
before anything starts (started_engines.py). Miles' own flags for its client
and router (``--sglang-server-concurrency``, ``--sglang-router-*``) are fields here.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .section_base import Section, bad

SGLANG_PREFIX = "--sglang-"
VLLM_PREFIX = "--vllm-"


class LaunchConfig(Section):
    """The engines the trainer starts itself (Miles' launch path)."""

    TITLE: ClassVar[str] = "engines the trainer starts (Miles' launch flags; --sglang-* go to the server)"

    rollout_num_gpus_per_engine: int | None = Field(
        None,
        ge=1,
        description="start the rollout engines beside the trainer, this many devices each (SGLang's --tp-size; "
        "support-replay serve: 1), behind our router",
    )
    rollout_num_gpus: int | None = Field(
        None,
        ge=1,
        description="devices of all the engines started (engines = this / --rollout-num-gpus-per-engine; default: "
        "the actor's ranks with --colocate, else one engine)",
    )
    launch_server: Literal["support-replay", "sglang", "vllm"] = Field(
        "support-replay",
        description="the server started per engine: support-replay serve (takes the SGLang names of the flags it "
        "implements), SGLang's launch_server (a machine with SGLang and its GPUs) or vLLM's OpenAI server (in "
        "dev mode, processed log-probs; the trainer speaks vLLM's protocol to it)",
    )
    launch_python: str | None = Field(
        None,
        description="with --launch-server sglang or vllm: the Python whose environment has that server (its own "
        "venv, e.g. make sglang's .venv-sglang/bin/python or make vllm's .venv-vllm/bin/python; default: this one)",
    )
    sglang_server_args: tuple[str, ...] = Field(
        (),
        description="the --sglang-* flags as given, handed to each engine's server without the prefix",
        json_schema_extra={"flag": False},
    )
    vllm_server_args: tuple[str, ...] = Field(
        (),
        description="the --vllm-* flags as given that are not the trainer's, handed to each vLLM server without the "
        "prefix (--launch-server vllm)",
        json_schema_extra={"flag": False},
    )
    sglang_server_concurrency: int = Field(
        512, ge=1, description="requests in flight per engine from the trainer's rollout client (Miles' flag)"
    )
    sglang_router_ip: str = Field("127.0.0.1", description="address of the router in front of the started engines")
    sglang_router_port: int | None = Field(
        None, ge=1, le=65535, description="port of that router (default: a free one)"
    )
    sglang_router_request_timeout_secs: float = Field(
        14400.0, gt=0, description="seconds an engine may take to answer one request through that router"
    )

    @property
    def starts_engines(self) -> bool:
        return self.rollout_num_gpus_per_engine is not None

    def engine_count(self, actor_ranks: int, colocate: bool) -> int:
        """Miles' count: ``rollout_num_gpus // rollout_num_gpus_per_engine``, all devices defaulting to the
        actor's under ``--colocate`` (slime's and Miles' rule), else those of one engine."""
        per = self.rollout_num_gpus_per_engine
        total = self.rollout_num_gpus or (actor_ranks if colocate else per)
        if total % per:
            bad(
                "rollout_num_gpus",
                total,
                f"must be a multiple of --rollout-num-gpus-per-engine={per}"
                + (" (with --colocate it defaults to the actor's ranks)" if self.rollout_num_gpus is None else ""),
            )
        return total // per

    @model_validator(mode="after")
    def _check(self):
        if self.vllm_server_args and self.launch_server != "vllm":
            first = self.vllm_server_args[0].split("=", 1)[0]
            raise ValueError(f"{first}: a flag of vLLM's server, for --launch-server vllm (not {self.launch_server})")
        if self.starts_engines:
            return self
        defaults = {name: field.default for name, field in type(self).model_fields.items()}
        given = [name for name in type(self).model_fields if getattr(self, name) != defaults[name]]
        if given:
            name = given[0]
            needs = (
                "give --rollout-num-gpus-per-engine too (without it the run uses the in-process engine or "
                "--rollout-url)"
            )
            if name in ("sglang_server_args", "vllm_server_args"):
                first = getattr(self, name)[0].split("=", 1)[0]
                raise ValueError(f"{first}: a flag of the server of the engines this run starts: {needs}")
            bad(name, getattr(self, name), f"sets the engines this run starts: {needs}")
        return self


def split_server_args(argv: list[str], known: set[str], prefix: str = SGLANG_PREFIX) -> tuple[list[str], list[str]]:
    """``(the rest, the flags under prefix that are not in known)`` of ``argv``: each such flag with its value
    when it has one (the next token, unless it is a flag; ``--flag=value`` as one token)."""
    rest, server = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if token == "--":
            rest += argv[i:]
            break
        if name.startswith(prefix) and name not in known:
            server.append(token)
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if "=" not in token and nxt is not None and not (nxt.startswith("--") or nxt == "-"):
                server.append(nxt)
                i += 1
        else:
            rest.append(token)
        i += 1
    return rest, server
