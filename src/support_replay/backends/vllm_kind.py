"""vLLM as an engine kind, at ``--rollout-url``: its ``/inference/v1/generate`` or ``/v1/completions``, the support
from its processed log-probs or its native sampling mask, weights through its dev-mode routes.

Its handshake: penalties are replayed for the vLLM version whose code was read; it is not batch-invariant
(true-on-policy mode refuses it), and its native mask carries no log q per support id (score centering
needs the processed log-probs).
"""

from __future__ import annotations

from functools import cached_property

from ..errors import ConfigError
from ..serving.security import Keys
from .base import get_info
from .kind import EngineKind, Needs, WeightRoute
from .weight_push import ADAPTER_NAME

VLLM_PENALTY_VERSION = "0.32."


class VLLMKind(EngineKind):
    name = "vllm"

    @classmethod
    def refusal(cls, settings, *, score_centering: bool):
        if settings.weight_sync_mode in ("retract", "in_place"):
            return (
                "weight_sync_mode",
                settings.weight_sync_mode,
                "SGLang's pause modes, which this project drives on SGLang and on its own serve; with vLLM use wait "
                "or abort (its /pause?mode=wait|abort)",
            )
        if score_centering and settings.vllm_capture == "native":
            return (
                "use_score_centering",
                True,
                "with --vllm-capture native: vLLM 0.32's sampling mask carries no log-prob per support id; use "
                "--vllm-capture processed_logprobs (logprobs >= |S| reveal every id's log q)",
            )
        return None

    @property
    def reveals_whole_support(self) -> bool:
        return self.settings.vllm_capture == "processed_logprobs"  # every id's processed log-prob, when asked

    def connect(self, needs: Needs):
        from .vllm import VLLMBackend

        self.backend = VLLMBackend(
            self.settings.rollout_url,
            needs.vocab_size,
            endpoint=self.settings.vllm_endpoint,
            capture=self.settings.vllm_capture,
            api_key=Keys.load().api,
            routing_shape=needs.routing_shape,
            max_logprobs=needs.vllm_max_logprobs,
            model=ADAPTER_NAME if needs.adapter else None,
        )
        return self.backend

    @cached_property
    def _version(self) -> str:
        """``/version``, asked once: the identity and the penalty check both read it."""
        return str(get_info(self.settings.rollout_url, "/version", Keys.load().header(admin=False)).get("version", ""))

    def identity(self) -> dict:
        return {"name": "vllm", "url": self.settings.rollout_url, "version": self._version, "semantics": "vllm"}

    def penalty_semantics(self, penalties, fallback: str) -> str:
        if not penalties.active:
            return fallback
        version = self._version
        if not version.startswith(VLLM_PENALTY_VERSION):
            raise ConfigError(
                f"vLLM {version} at {self.settings.rollout_url}: penalties ({penalties.setting()}) are replayed for "
                f"vLLM {VLLM_PENALTY_VERSION}x only, whose code was read"
            )
        return "vllm"

    def weight_sync(self, route: WeightRoute):
        from .vllm_weights import VLLMAdapterSync, VLLMSync

        url = self.settings.rollout_url
        if route.lora is not None:
            return VLLMAdapterSync(url, route.staging, route.lora, route.mode)
        return VLLMSync(url, route.staging, route.mode)
