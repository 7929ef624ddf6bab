"""What a bf16 gradient of a support log-prob may be: each entry the exact gradient rounded once (within one bf16
ulp of it), and so each row's entries summing to within 1.5 ulps of its largest entry (the exact row sums to zero;
one rounding of each entry already gives up to about one ulp)."""

from __future__ import annotations

import torch


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (float64): 2^(exponent - 7), the subnormal spacing at the bottom."""
    mag = x.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def exact_support_grad(logits, targets, lists, temperature, upstream) -> torch.Tensor:
    """float64 ``d(sum upstream * log pi)/d logits`` on each row's support, 0 elsewhere."""
    z = logits.double() / temperature
    grad = torch.zeros_like(z)
    for t, ids in enumerate(lists):
        ids = torch.tensor(ids)
        p = torch.softmax(z[t, ids], -1)
        onehot = (ids == targets[t]).double()
        grad[t, ids] = (onehot - p) * float(upstream[t]) / temperature
    return grad


def assert_rounded_once(grad: torch.Tensor, exact: torch.Tensor, whole_rows: bool = True) -> None:
    """``grad`` (bf16) is ``exact`` (float64) rounded once per entry: within one ulp, and (``whole_rows``: not a
    vocabulary shard's part of them) rows summing near zero."""
    got = grad.double()
    over = (got - exact).abs() > bf16_ulp(exact)
    assert not over.any(), f"{int(over.sum())} entries over one bf16 ulp, first at {over.nonzero()[0].tolist()}"
    if not whole_rows:
        return
    sums = got.sum(-1).abs()
    bound = 1.5 * bf16_ulp(got.abs().max(-1).values)
    assert (sums <= bound).all(), f"row sums {sums[sums > bound].tolist()} over 1.5 ulps of their largest entries"
