"""The sampler's top-k selection on a CPU in one compiled kernel (csrc/top_candidates.cpp).

SGLang's rule reads only the first max top_k ranks of each row's sort by (probability descending, id ascending)
(core/sampling.py). ``torch.topk`` finds them in 0.59 ms for 16 rows of SmolLM2's 49152 ids on a Zen 3 EPYC, and
its choice among tied values is arbitrary, so the sampler widens a tie at the cut with more passes. The kernel
returns exactly the sort's first ranks, ties included, in 0.08 ms (``python bench/sampling.py``). Its result is the
same tensors as ``torch.sort(probs, descending=True, stable=True)``'s first columns, so the support and the draw
are unchanged; each process checks that on a few cases (ties, NaN, -inf, tiny vocabularies) before using it.

``sglang_rows`` goes on from the selection to the support itself: SGLang's rule over the ranks and the kept ids in
ascending order, the tensors core/sampling.py's ``_keep_sglang`` and ``_rows_of_ranks`` make with a dozen small
operations (0.42 of a 1.74 ms sampling step inside a GRPO-shape decode on a Zen 5 EPYC), in one call with their
arithmetic. Checked the same way against those functions, over settings of top_k, top_p and min_p.

``sglang_draw`` goes on to the token: the draw's weights, each row's noise from its own generator and the argmax,
the sampler's own ATen operations called from C++ (the same bits, checked with generators seeded alike), without the
interpreter between them: inside a GRPO-shape decode on a Zen 5 EPYC those operations took some 0.35 ms in Python,
and ``sample_tokens`` went ~1.68 -> 1.60 ms (most of their time is the cold caches after the head's product, which
C++ does not spare).

``sglang_draw_logits`` starts from the logits: each row's ``softmax(z / T)`` with ATen's float32 softmax's own vector
functions in its order (the same bits, checked against ``torch.softmax`` at start-up) and the row's selection in one
task, so the selection reads a row just written instead of 3 MB of probabilities again from memory.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from . import build

log = logging.getLogger(__name__)


def _cases(generator: torch.Generator) -> list[torch.Tensor]:
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    smooth = torch.softmax(3 * randn(6, 5000), -1)
    tied = torch.softmax((3 * randn(6, 3000)).bfloat16().float(), -1)  # bf16 logits tie often at the cut
    odd = torch.softmax(randn(5, 301), -1)
    odd[0, 5] = float("nan")
    odd[1] = float("nan")
    odd[2, 100:] = 0.0
    odd[3] = 0.5
    odd[4, 7:] = float("-inf")
    few = torch.randint(0, 3, (4, 77), generator=generator).float()
    return [smooth, tied, odd, few, randn(2, 5)]


def check(kernel: Callable) -> str:
    """Where ``kernel(probs, width)`` differs from the full sort's first ``width`` columns ("" nowhere)."""
    generator = torch.Generator().manual_seed(0)
    for probs in _cases(generator):
        want_values, want_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        vocab = probs.shape[1]
        for width in sorted({1, 2, 7, 32, 48, vocab - 1, vocab} & set(range(1, vocab + 1))):
            values, ids = kernel(probs, width)
            same = torch.equal(ids, want_ids[:, :width]) and torch.equal(
                values.nan_to_num(-1.0), want_values[:, :width].nan_to_num(-1.0)
            )
            if not same:
                return f"its selection differs from the full sort's at {tuple(probs.shape)}, width {width}"
    return ""


# (top_k, top_p, min_p) of the rows a check gives the rule: every filter alone, together, off, and at its edges
SETTINGS = [(1, 1.0, 0.0), (7, 1.0, 0.0), (32, 0.8, 0.0), (32, 0.95, 0.05), (48, 0.5, 0.1), (5, 1e-6, 0.0),
            (48, 1.0, 1.0), (2, 0.999999, 0.3), (32, 0.3, 0.0), (20, 0.97, 0.01)]  # fmt: skip


def _columns(settings: list[tuple[int, float, float]], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``[rows, 1]`` columns ``(top_k, top_p, min_p)`` of one ``SETTINGS`` entry a row, as the sampler makes them
    (core/sampling.py's ``_columns``: int64, float64, float32; top_k at most the vocabulary)."""
    top_k = torch.tensor([[min(k, vocab)] for k, _, _ in settings])
    top_p = torch.tensor([[p] for _, p, _ in settings], dtype=torch.float64)
    min_p = torch.tensor([[m] for _, _, m in settings], dtype=torch.float32)
    return top_k, top_p, min_p


def check_rows(kernel: Callable) -> str:
    """Where ``kernel(probs, width, top_k, top_p, min_p)`` differs from SGLang's rule over the sort's first ranks
    (core/sampling.py's operations) and its kept ids ascending ("" nowhere)."""
    from ..core.sampling import _keep_sglang, _rows_of_ranks

    generator = torch.Generator().manual_seed(1)
    for probs in _cases(generator):
        rows, vocab = probs.shape
        for shift in range(len(SETTINGS)):
            settings = [SETTINGS[(shift + r) % len(SETTINGS)] for r in range(rows)]
            top_k, top_p, min_p = _columns(settings, vocab)
            width = int(top_k.max())
            values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            values, order = values[:, :width], order[:, :width]
            want = _rows_of_ranks(_keep_sglang(values, top_k, top_p, min_p), order, vocab)
            got = kernel(probs, width, top_k, top_p, min_p)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                return f"its support differs from SGLang's rule at {tuple(probs.shape)}, settings {settings}"
    # top_p at a rank's exclusive mass exactly, and one float below it: a prefix sum rounded otherwise than
    # PyTorch's cumsum keeps one rank more or less there
    probs = torch.softmax(torch.randn(8, 4000, generator=generator), -1)
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    width = 64
    values, order = values[:, :width], order[:, :width]
    exclusive = values.cumsum(-1) - values
    for below in (False, True):
        at = exclusive[torch.arange(8), torch.arange(8) * 7 + 10]
        if below:
            at = torch.nextafter(at, torch.zeros_like(at))
        top_p, top_k, min_p = at.double()[:, None], torch.full((8, 1), width), torch.zeros(8, 1)
        want = _rows_of_ranks(_keep_sglang(values, top_k, top_p, min_p), order, probs.shape[1])
        if not all(torch.equal(a, b) for a, b in zip(kernel(probs, width, top_k, top_p, min_p), want)):
            return "its support differs from SGLang's rule where top_p is a rank's exclusive mass"
    return ""


def check_draw(kernel: Callable) -> str:
    """Where ``kernel(probs, width, top_k, top_p, min_p, generators)`` (``sglang_rows`` and the draw) differs from
    ``sglang_rows`` and core/sampling.py's draw over it with generators seeded alike ("" nowhere)."""
    from ..core.sampling import _exponential_noise

    generator = torch.Generator().manual_seed(2)
    for probs in _cases(generator)[:3]:
        rows, vocab = probs.shape
        settings = [SETTINGS[r % len(SETTINGS)] for r in range(rows)]
        top_k, top_p, min_p = _columns(settings, vocab)
        width = int(top_k.max())
        probs = probs.nan_to_num(0.0)  # a draw's weights are probabilities
        for seed in range(3):
            generators = [torch.Generator().manual_seed(100 * seed + r) for r in range(rows)]
            got = kernel(probs, width, top_k, top_p, min_p, generators)
            ids, valid, cols, counts = got[:4]
            weights = probs.gather(1, ids).masked_fill_(~valid, 0.0)
            again = [torch.Generator().manual_seed(100 * seed + r) for r in range(rows)]
            noise = _exponential_noise(tuple(ids.shape), again, probs.device, counts.tolist())
            tokens = ids.gather(1, (weights / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
            if not torch.equal(got[4], tokens):
                return f"its draw differs from the sampler's at {tuple(probs.shape)}, seed {seed}"
            if not all(torch.equal(g.get_state(), a.get_state()) for g, a in zip(generators, again)):
                return f"its draw takes another count of values from the generators at {tuple(probs.shape)}"
    return ""


def check_draw_logits(kernel: Callable, draw: Callable) -> str:
    """Where ``kernel(logits, width, temperature, top_k, top_p, min_p, generators)`` differs from ``torch.softmax`` of
    ``logits / temperature`` (skipped where every temperature is 1, as the sampler skips it) and ``draw`` (the checked
    ``sglang_draw``) over it with generators seeded alike ("" nowhere)."""
    generator = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    masked = 4 * randn(6, 3001)
    masked[0, 100:] = float("-inf")  # a grammar's or min-tokens' mask
    masked[1, :2900] = float("-inf")
    tied = (3 * randn(5, 4099)).bfloat16().float()  # ties at the cut
    large = 60 * randn(3, 49152)
    for logits in (4 * randn(7, 5000), masked, tied, large, randn(2, 4 * 48 + 3)):
        rows, vocab = logits.shape
        settings = [SETTINGS[r % len(SETTINGS)] for r in range(rows)]
        top_k, top_p, min_p = _columns(settings, vocab)
        width = int(top_k.max())
        for temps in ([1.0] * rows, [(0.7, 1.0, 1.3, 0.05)[r % 4] for r in range(rows)]):
            temperature = torch.tensor(temps)[:, None]
            want_probs = torch.softmax(logits if all(t == 1 for t in temps) else logits / temperature, -1)
            generators = [torch.Generator().manual_seed(7 + r) for r in range(rows)]
            got = kernel(logits, width, temperature, top_k, top_p, min_p, generators)
            again = [torch.Generator().manual_seed(7 + r) for r in range(rows)]
            want = draw(want_probs, width, top_k, top_p, min_p, again)
            if not torch.equal(got[5], want_probs):
                return f"its softmax differs from torch.softmax at {tuple(logits.shape)}, temperatures {temps[:4]}"
            if not all(torch.equal(a, b) for a, b in zip(got[:5], want)):
                return f"its draw differs from sglang_draw's at {tuple(logits.shape)}, temperatures {temps[:4]}"
            if not all(torch.equal(g.get_state(), a.get_state()) for g, a in zip(generators, again)):
                return f"it takes another count of values from the generators at {tuple(logits.shape)}"
    return ""


class Selection:
    """The checked kernels for core/sampling.py, None where a call is not theirs (off a CPU, off float32):
    ``select(probs, width)``, the sort's first ``width`` ranks; ``select.sglang_rows(probs, width, top_k, top_p,
    min_p)``, SGLang's rule over them in ``_padded_rows``' form; ``select.sglang_draw(..., generators)``, those rows
    and each row's token drawn with its own generator; ``select.sglang_draw_logits(logits, width, temperature, ...)``,
    the same from the logits with their softmax."""

    def __init__(self, module, rows: bool = True, draw: bool = True, draw_logits: bool = True):
        self._select = module.top_candidates
        self._rows = module.sglang_rows if rows else None  # None: its check failed, the rule stays PyTorch's
        self._draw = module.sglang_draw if rows and draw else None  # None: the draw stays PyTorch's operations
        # None: the softmax stays torch.softmax, the draw sglang_draw's
        self._draw_logits = module.sglang_draw_logits if self._draw is not None and draw_logits else None

    @staticmethod
    def _takes(probs: torch.Tensor) -> bool:
        return probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2

    def __call__(self, probs: torch.Tensor, width: int):
        return self._select(probs, width) if self._takes(probs) else None

    def sglang_rows(self, probs: torch.Tensor, width: int, top_k, top_p, min_p):
        if self._rows is None or not self._takes(probs):
            return None
        return self._rows(probs, width, top_k, top_p, min_p)

    def sglang_draw(self, probs: torch.Tensor, width: int, top_k, top_p, min_p, generators):
        if self._draw is None or not self._takes(probs):
            return None
        return self._draw(probs, width, top_k, top_p, min_p, generators)

    def sglang_draw_logits(self, logits: torch.Tensor, width: int, temperature, top_k, top_p, min_p, generators):
        if self._draw_logits is None or not self._takes(logits):
            return None
        return self._draw_logits(logits, width, temperature, top_k, top_p, min_p, generators)


@functools.cache
def compiled() -> tuple[Selection | None, str]:
    """The kernels for core/sampling.py (``Selection``), or None and why not. Where the selection holds and the
    rule's check fails, the selection serves alone."""
    module, why = build.checked(lambda module: check(module.top_candidates))
    if module is None:
        return None, why
    rows_why = check_rows(module.sglang_rows)
    if rows_why:
        log.info("sampling: SGLang's rule stays PyTorch's operations over the compiled selection (%s)", rows_why)
    draw_why = "" if rows_why else check_draw(module.sglang_draw)
    if draw_why:
        log.info("sampling: the draw stays PyTorch's operations (%s)", draw_why)
    logits_why = "" if rows_why or draw_why else check_draw_logits(module.sglang_draw_logits, module.sglang_draw)
    if logits_why:
        log.info("sampling: the softmax stays torch.softmax before the compiled draw (%s)", logits_why)
    return Selection(module, rows=not rows_why, draw=not draw_why, draw_logits=not logits_why), ""


def selection() -> Selection | None:
    """The checked kernel's ``select`` where it runs, else None (the sampler's torch.topk); says why once."""
    select, why = compiled()
    if select is None:
        log.info("sampling: torch.topk selects the top-k candidates (the CPU kernel is not used: %s)", why)
    return select
