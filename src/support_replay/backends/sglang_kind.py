"""SGLang's protocol as an engine kind: SGLang itself, our ``serve`` and router, smg, at ``--rollout-url``.

Its handshake: our engine says its own semantics (``/server_info`` has ``semantics``); SGLang's penalties are
replayed for the version whose code was read, started with ``--disable-overlap-schedule``; true-on-policy mode
needs our deterministic engine running the trainer's invariant arithmetic in the trainer's dtype.
"""

from __future__ import annotations

from functools import cached_property

from ..errors import ConfigError, SupportReplayError
from ..serving.security import Keys
from .base import get_info
from .kind import EngineKind, Needs, WeightRoute
from .weight_push import ADAPTER_NAME

SGLANG_PENALTY_VERSION = "0.5.23"


def require_deterministic(url: str, dtype: str, headers: dict | None = None) -> None:
    """The engine at ``url`` computes this trainer's bits: deterministic, the same invariant arithmetic (build and
    ISA: kernels/invariant.identity) and compute dtype ``dtype``."""
    from ..kernels import invariant

    info = get_info(url, "/model_info", headers)
    if not info.get("deterministic"):
        raise SupportReplayError(
            f"--true-on-policy-mode: the engine at {url} is not deterministic; start it with `support-replay serve "
            "--deterministic`"
        )
    theirs, mine = info.get("invariant_arithmetic"), invariant.identity()
    if theirs != mine:
        raise SupportReplayError(
            f"--true-on-policy-mode: the engine at {url} runs the invariant arithmetic as {theirs!r}, this trainer as "
            f"{mine!r} (another build, or another vector width: the lane count is part of the order); their logits "
            "would differ: run both from one install on one kind of CPU"
        )
    if info.get("dtype") != dtype:
        raise SupportReplayError(
            f"--true-on-policy-mode: the engine at {url} computes in {info.get('dtype')}, this trainer in {dtype}: "
            f"start it with `--dtype {dtype}` or give this run `--train-dtype {info.get('dtype')}`"
        )


class SGLangKind(EngineKind):
    name = "sglang"
    deterministic = True  # our serve --deterministic (checked at connect)
    started_by_launcher = True
    weights_over_http = True  # our serve and router

    def _headers(self) -> dict:
        return Keys.load().header(admin=False)

    @cached_property
    def _server_info(self) -> dict:
        """``/server_info``, asked once: the identity and the penalty check both read it."""
        return get_info(self.settings.rollout_url, "/server_info", self._headers())

    def connect(self, needs: Needs):
        from .sglang import SGLangBackend

        url = self.settings.rollout_url
        self.backend = SGLangBackend(
            url,
            needs.vocab_size,
            sampling_mask_format=self.settings.sampling_mask_format,
            api_key=Keys.load().api,
            routing_shape=needs.routing_shape,
            concurrency=self.settings.rollout_concurrency,
            lora_path=ADAPTER_NAME if needs.adapter else None,
            per_token_versions=self.settings.weight_sync_mode in ("retract", "in_place"),
        )
        if needs.true_on_policy_dtype is not None:
            require_deterministic(url, needs.true_on_policy_dtype, self._headers())
        return self.backend

    def identity(self) -> dict:
        url, info = self.settings.rollout_url, self._server_info
        ours = "semantics" in info  # our serve (or a router in front of it) says its own
        return {
            "name": "support-replay serve" if ours else "sglang",
            "url": url,
            "version": info.get("version"),
            "semantics": info.get("semantics", "sglang"),
        }

    def penalty_semantics(self, penalties, fallback: str) -> str:
        if not penalties.active:
            return fallback
        url, info = self.settings.rollout_url, self._server_info
        if "semantics" in info:  # our engine (serve, or a router in front of it) says its own
            return info["semantics"]
        version, overlap_off = info.get("version"), info.get("disable_overlap_schedule")
        if version != SGLANG_PENALTY_VERSION or overlap_off is not True:
            raise ConfigError(
                f"SGLang {version} at {url} (disable_overlap_schedule={overlap_off}): penalties "
                f"({penalties.setting()}) are replayed for SGLang {SGLANG_PENALTY_VERSION} started with "
                "--disable-overlap-schedule only (its "
                "overlap scheduler counts the history one token late)"
            )
        if penalties.repetition != 1 and (penalties.frequency or penalties.presence):
            raise ConfigError(
                f"SGLang {version} at {url}: {penalties.setting()}: the repetition penalty with a frequency or "
                "presence penalty has no defined order there: without overlap scheduling SGLang applies its "
                "penalizers one by one in the iteration order of a set of classes (sampling_batch_info.py's "
                "`penalizers={...}`, penaltylib/orchestrator.py), which changes from one server start to the next, "
                "and the repetition penalty's scaling does not commute with the others' subtraction; use one of "
                "them (docs/math.md)"
            )
        return "sglang"

    def weight_sync(self, route: WeightRoute):
        from .sglang_weights import BodySync, SGLangAdapterSync, SGLangSync

        url = self.settings.rollout_url
        if route.lora is not None:
            return SGLangAdapterSync(url, route.staging, route.lora, route.mode)
        if route.transport == "http":
            return BodySync(url, route.mode)
        return SGLangSync(url, route.staging, route.mode)
