"""What every weight push shares: the staged safetensors file, the admin POST and its errors, the adapter's
directory. The pushes of each engine kind are beside it (``in_process.py``, ``sglang_weights.py``,
``vllm_weights.py``).

Requests running when weights arrive either finish on the old weights first (``wait``, the
default of every engine here) or are aborted so the weights apply at once (``abort``: SGLang's
``abort_all_requests``, vLLM's ``/pause?mode=abort``); the aborted responses come back failed
and their groups are regenerated or dropped by ``--failed-group-policy``. Or they go on under the
new weights (``retract`` and ``in_place``, SGLang's ``/pause_generation`` modes: the push pauses,
loads, and continues; engine/pausing.py): ``retract`` recomputes their keys and values under the
new weights, ``in_place`` keeps the old ones (a mismatch ``--ci-test`` names); each token keeps
the version that sampled it (``weight_versions`` spans).

The HTTP pushes stage ``model.safetensors`` in a directory the engine can read (a shared
filesystem); it is written beside its final name and renamed, never read half-written. Without
a shared filesystem (``--weight-transport http``) the same file is the request body.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from ..errors import SupportReplayError
from ..serving.security import Keys

SYNC_TIMEOUT = 600.0


def save_safetensors(state: dict[str, torch.Tensor], directory: Path) -> Path:
    """Write ``model.safetensors`` atomically (tied weights are stored once per name)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(tmp))
    os.replace(tmp, directory / "model.safetensors")
    return directory / "model.safetensors"


def post_admin(url: str, path: str, what: str, hint_404: str = "", **kwargs) -> httpx.Response:
    """POST to an engine's admin route; ``SupportReplayError`` naming the step and the answer unless 200
    (``hint_404``: what to do when the route is not mounted)."""
    try:
        reply = httpx.post(url + path, timeout=SYNC_TIMEOUT, headers=Keys.load().header(admin=True), **kwargs)
    except httpx.HTTPError as exc:
        raise SupportReplayError(f"weight sync to {url}: {what} ({path}) failed: {type(exc).__name__}: {exc}") from exc
    if reply.status_code != 200:
        hint = f"; {hint_404}" if reply.status_code == 404 and hint_404 else ""
        raise SupportReplayError(
            f"weight sync to {url}: {what} ({path}) answered HTTP {reply.status_code}: {reply.text[:300]}{hint}"
        )
    return reply


WEIGHT_SYNC_MODES = ("wait", "abort", "retract", "in_place")
IN_FLIGHT_MODES = ("retract", "in_place")  # the weights change under running requests (SGLang's pause modes)


@contextmanager
def paused_generation(url: str, mode: str, post=None):
    """SGLang's ``/pause_generation {"mode"}`` around a weight load for an in-flight mode, and
    ``/continue_generation`` after it, even when the load failed (the engine must not stay paused); nothing
    for ``wait`` and ``abort``. ``post(path, what, body)`` sends each (default: ``post_admin`` to ``url``)."""
    if mode not in IN_FLIGHT_MODES:
        yield
        return
    post = post or (lambda path, what, body: post_admin(url, path, what, json=body))
    post("/pause_generation", f"pausing generation ({mode})", {"mode": mode})
    try:
        yield
    finally:
        post("/continue_generation", "continuing generation", {})


class StagedSync:
    def __init__(self, url: str, staging: Path, mode: str = "wait"):
        self.url, self.staging, self.mode = url.rstrip("/"), Path(staging), mode
        self.abort = mode == "abort"

    def stage(self, state: dict[str, torch.Tensor]) -> Path:
        if self.staging.exists():
            shutil.rmtree(self.staging)
        save_safetensors(state, self.staging)
        return self.staging


def check_success(where: str, answer) -> None:
    """SGLang answers 200 with ``success: false`` when it could not load; our router lists every engine."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SupportReplayError(f"weight sync to {where}: the engine refused the weights: {str(answer)[:300]}")


ADAPTER_NAME = "policy"  # the name the trainer's LoRA adapter is loaded under (--lora-sync adapter)


class AdapterSync:
    """``--lora-sync adapter``: the LoRA adapter alone, as peft saves one, in a directory per version the
    engine reads, loaded under ``ADAPTER_NAME``; requests name it (SGLang's ``lora_path``, vLLM's ``model``)."""

    takes_adapter = True

    def __init__(self, url: str, staging: Path, lora, mode: str = "wait"):
        self.url, self.staging, self.lora, self.abort = url.rstrip("/"), Path(staging), lora, mode == "abort"
        self.loaded: Path | None = None

    def stage(self, adapter: dict[str, torch.Tensor], version: str) -> Path:
        from safetensors.torch import save_file

        path = self.staging / f"adapter-{version}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        save_file({k: v.detach().contiguous() for k, v in adapter.items()}, str(path / "adapter_model.safetensors"))
        self.lora.peft_config().save_pretrained(str(path))
        return path

    def push(self, adapter: dict[str, torch.Tensor], version: str) -> None:
        path = self.stage(adapter, version)
        self.load(path, version)
        if self.loaded is not None and self.loaded != path:
            shutil.rmtree(self.loaded, ignore_errors=True)  # the engine read it at the last push
        self.loaded = path
