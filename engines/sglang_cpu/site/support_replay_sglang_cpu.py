"""Run by a ``.pth`` line at every interpreter start of the SGLang venv (``make sglang``): SGLang's scheduler and
detokenizer are spawned interpreters, so a fix made once in the launcher would not reach them.

It makes ``import torchvision`` work on a CPU torch. The registry's only torchvision 0.28.0 (the release built
against torch 2.13) is a CUDA build: its ``_C.so`` cannot load without ``libc10_cuda.so``, torchvision carries on
without its operators, and then ``torchvision/_meta_registrations.py`` registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` without checking they exist: ``RuntimeError: operator
torchvision::nms does not exist`` at ``import sglang`` (``sglang/__init__`` -> ``transformers.image_utils`` ->
``torchvision``; ``srt/multimodal/internvl_utils.py`` imports it at module level too, so it cannot be left out).

The two schemas, as torchvision declares them (``csrc/ops/nms.cpp``), are declared just before torchvision is
first imported (a finder at the head of ``sys.meta_path`` that steps aside after one use), so interpreters that
never import it pay nothing. They get no kernel: a call raises torch's own "no kernel" error. SGLang's text models never
call them. Patching torchvision's file in the venv would do the same, hidden in an installed package; this file is
the whole of the change, in the repository.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = []  # the Library object lives as long as the process: dropping it would remove the schemas


def declare_torchvision_schemas() -> None:
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        library.define(schema)
    _LIBRARY.append(library)


class _DeclareBeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            declare_torchvision_schemas()
        return None  # the usual finders import it


def install() -> None:
    if not any(isinstance(f, _DeclareBeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeclareBeforeTorchvision())
