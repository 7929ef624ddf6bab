"""Flags of the reference implementation's command line (Miles, slime) that this trainer does not take,
refused by name, all at once, each with the reason and what to do (docs/training.md, "coming from Miles or
slime"). A flag is either a setting here with its meaning (``--optimizer``, ``--lr-decay-style``,
``--train-backend``, ``--attn-implementation``, ``--deterministic-mode``, ``--actor-num-nodes``,
``--actor-num-gpus-per-node``, ``--rollout-num-gpus-per-engine`` and the ``--sglang-*`` server flags of the
engines a run starts, ...) or refused here: none is accepted and ignored."""

from __future__ import annotations

REFUSED = {
    "--update-weight-buffer-size": (
        "weights reach the engine whole, in memory (in-process), as a safetensors directory or as one HTTP body "
        "(serve's --max-weights-bytes bounds it): there is no bucketed transfer to size"
    ),
    "--sglang-true-on-policy-contract": (
        "not a flag of SGLang 0.5.23's server (its parser has no such option; its true-on-policy switch is "
        "--rl-on-policy-target fsdp, which --true-on-policy-mode sets, with --enable-deterministic-inference)"
    ),
    "--sglang-router-policy": (
        "our router sends each request to the healthy engine with the fewest in flight (a session's turns to "
        "its first engine); it has no other policy to choose"
    ),
}


def refusals(argv: list[str]) -> list[str]:
    """``flag: why`` for every refused flag in ``argv`` (``--flag`` or ``--flag=value``), in order, once each."""
    out, seen = [], set()
    for token in argv:
        if token == "--":  # what follows belongs to another command
            break
        name = token.split("=", 1)[0]
        if not name.startswith("--") or name in seen:
            continue
        why = REFUSED.get(name)
        if why is not None:
            seen.add(name)
            out.append(f"{name}: {why}")
    return out
