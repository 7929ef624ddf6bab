"""SGLang's own sampling-capture and payload code, taken from its published wheel.

SGLang cannot be installed here with its dependencies (CUDA kernels, a GPU), and its
packages import them on load. So the few pieces that decide what a sampled token's support,
log mu and ``meta_info`` look like are read from the wheel's files and run as they are:

- ``sglang/srt/layers/sampler.py``: ``top_k_top_p_min_p_sampling_from_probs_torch`` (the
  torch sampler: sort descending, cumsum on the unfiltered probabilities, top-k by rank,
  top-p on the exclusive prefix, min-p) and ``Sampler._build_sampling_mask_output`` (support
  = weight > 0, log mu = log(w_sel / sum w) in fp32, ids packed in weight order);
- ``sglang/srt/layers/logits_processor.py``: ``SamplingMaskStatus``, ``SamplingMaskOutput``;
- ``sglang/srt/managers/scheduler_components/batch_result_processor.py``:
  ``materialize_sampling_mask_output`` (device rows to per-request host rows);
- ``sglang/srt/sampling/sampling_mask.py``: ``SamplingMaskRows`` / ``SamplingMaskChunk.to_lists``;
- ``sglang/srt/managers/tokenizer_manager.py``: the block of ``_handle_batch_output`` that puts
  the mask into ``meta_info``;
- ``sglang/srt/utils/weight_versions.py``: ``add_weight_versions_to_meta_info``;
- ``sglang/srt/state_capturer/base.py`` and ``managers/detokenizer_manager.py``: the routed-experts
  capture (device rows, host rows by KV slot, ``get_topk``) and its base64 encoding
  (tests/engines/generate_routing_fixtures.py).

Functions and classes are cut out of their files with ``ast`` and executed with the names
they use; nothing is rewritten. ``load()`` fetches the wheel once (``pip download --no-deps``)
into the user cache and raises ``Unavailable`` with the reason when it cannot.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch

VERSION = "0.5.23"
FILES = {
    "sampler": "sglang/srt/layers/sampler.py",
    "logits_processor": "sglang/srt/layers/logits_processor.py",
    "batch_result_processor": "sglang/srt/managers/scheduler_components/batch_result_processor.py",
    "sampling_mask": "sglang/srt/sampling/sampling_mask.py",
    "tokenizer_manager": "sglang/srt/managers/tokenizer_manager.py",
    "weight_versions": "sglang/srt/utils/weight_versions.py",
    "msgspec_utils": "sglang/srt/utils/msgspec_utils.py",
    "topk_capturer": "sglang/srt/state_capturer/base.py",
    "detokenizer_manager": "sglang/srt/managers/detokenizer_manager.py",
}


class Unavailable(RuntimeError):
    """SGLang's code could not be obtained here; the message says why."""


def cache_root() -> Path:
    base = Path(os.environ.get("SUPPORT_REPLAY_CACHE", Path.home() / ".cache" / "support-replay"))
    return base / "engine-code" / f"sglang-{VERSION}"


def source_dir() -> Path:
    """The wheel's files we run, extracted once into the user cache."""
    root = cache_root()
    if all((root / f).exists() for f in FILES.values()):
        return root
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={VERSION}", "-d", tmp],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wheels = list(Path(tmp).glob("sglang-*.whl"))
        if done.returncode != 0 or not wheels:
            raise Unavailable(f"pip download sglang=={VERSION} failed: {done.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in FILES.values():
                wheel.extract(name, root)
    return root


def _module_from_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _definitions(path: Path, names: dict[str, str | None], namespace: dict) -> dict:
    """Execute the named top-level definitions of ``path`` (``"Class.method"`` for a method,
    bound as a plain function) in ``namespace``; returns it."""
    tree = ast.parse(path.read_text())
    for qualified in names:
        cls, _, attr = qualified.rpartition(".")
        scope = tree.body
        if cls:
            scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == attr)
        node.decorator_list = [
            d for d in node.decorator_list if not (isinstance(d, ast.Name) and d.id == "staticmethod")
        ]
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def _meta_info_block(path: Path):
    """The ``if`` of ``TokenizerManager._handle_batch_output`` that writes the sampling mask
    into ``meta_info``, compiled as it stands in the file."""
    tree = ast.parse(path.read_text())
    manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TokenizerManager")
    method = next(n for n in manager.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "_handle_batch_output")
    block = next(
        n
        for n in ast.walk(method)
        if isinstance(n, ast.If)
        and "output_token_sampling_mask_length" in ast.unparse(n)
        and "return_sampling_mask" in ast.unparse(n.test)
    )
    return compile(ast.Module(body=[block], type_ignores=[]), str(path), "exec")


@dataclasses.dataclass
class SGLangCode:
    root: Path
    sampling_mask: types.ModuleType
    weight_versions: types.ModuleType
    namespace: dict
    meta_info_block: Any

    @property
    def sample_from_probs(self):
        return self.namespace["top_k_top_p_min_p_sampling_from_probs_torch"]

    @property
    def build_sampling_mask_output(self):
        return self.namespace["_build_sampling_mask_output"]

    @property
    def materialize(self):
        return self.namespace["materialize_sampling_mask_output"]


_LOADED: SGLangCode | None = None


def load() -> SGLangCode:
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    try:
        import msgspec  # noqa: F401  (SGLang's host-side structs are msgspec structs)
    except ImportError as exc:
        raise Unavailable(f"SGLang's sampling_mask.py needs msgspec: {exc}") from exc
    root = source_dir()
    # weight_versions.py imports sglang.srt.utils.msgspec_utils by its package name
    stubs = [n for n in ("sglang", "sglang.srt", "sglang.srt.utils") if n not in sys.modules]
    for n in stubs:
        sys.modules[n] = types.ModuleType(n)
    try:
        _module_from_file("sglang.srt.utils.msgspec_utils", root / FILES["msgspec_utils"])
        weight_versions = _module_from_file("_sglang_wheel_weight_versions", root / FILES["weight_versions"])
        sampling_mask = _module_from_file("_sglang_wheel_sampling_mask", root / FILES["sampling_mask"])
    finally:
        for n in [*stubs, "sglang.srt.utils.msgspec_utils"]:
            sys.modules.pop(n, None)
    # one module holds the definitions cut out of the files (dataclasses look their module up)
    module = types.ModuleType("_sglang_wheel")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace.update(
        {
            "torch": torch,
            "np": np,
            "dist": torch.distributed,
            "enum": enum,
            "IntEnum": enum.IntEnum,
            "dataclasses": dataclasses,
            "NamedTuple": NamedTuple,
            "Optional": Optional,
            "List": list,
            "Tuple": tuple,
            "Union": Union,
            "Dict": dict,
            "Any": Any,
        }
    )
    _definitions(root / FILES["logits_processor"], {"SamplingMaskStatus": None, "SamplingMaskOutput": None}, namespace)
    _definitions(
        root / FILES["sampler"],
        {
            "_SamplingMaskCapture": None,
            "top_k_top_p_min_p_sampling_from_probs_torch": None,
            "Sampler._build_sampling_mask_output": None,
        },
        namespace,
    )
    namespace["Req"] = namespace["LogitsProcessorOutput"] = object  # annotations only
    _definitions(
        root / FILES["batch_result_processor"],
        {"SchedulerBatchResultProcessor.materialize_sampling_mask_output": None},
        namespace,
    )
    _LOADED = SGLangCode(
        root, sampling_mask, weight_versions, namespace, _meta_info_block(root / FILES["tokenizer_manager"])
    )
    return _LOADED
