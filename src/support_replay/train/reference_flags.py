"""Flags of the reference implementation's command line (Miles, slime) that this trainer does not take,
refused by name, all at once, each with the reason and what to do (docs/training.md, "coming from Miles or
slime"). A flag is either a setting here with its meaning (``--optimizer``, ``--lr-decay-style``,
``--train-backend``, ``--attn-implementation``, ``--deterministic-mode``, ``--actor-num-nodes``,
``--actor-num-gpus-per-node``, ...) or refused here: none is accepted and ignored."""

from __future__ import annotations

NO_SGLANG = (
    "an SGLang launch flag, and this trainer launches no SGLang: the in-process engine runs beside it, or start "
    "the SGLang server yourself with the flag (without its sglang- prefix) and give its --rollout-url"
)
REFUSED = {
    "--update-weight-buffer-size": (
        "weights reach the engine whole, in memory (in-process), as a safetensors directory or as one HTTP body "
        "(serve's --max-weights-bytes bounds it): there is no bucketed transfer to size"
    ),
    "--rollout-num-gpus-per-engine": (
        "this trainer starts no GPU engines: the in-process engine runs in its process, or give --rollout-url of "
        "servers you started (support-replay local-run --engines N starts ours)"
    ),
    "--sglang-enable-deterministic-inference": (
        f"{NO_SGLANG}; with our engine, --true-on-policy-mode runs its batch-invariant forward"
    ),
}
PREFIXES = {"--sglang-": NO_SGLANG}


def refusals(argv: list[str]) -> list[str]:
    """``flag: why`` for every refused flag in ``argv`` (``--flag`` or ``--flag=value``), in order, once each."""
    out, seen = [], set()
    for token in argv:
        if token == "--":  # what follows belongs to another command
            break
        name = token.split("=", 1)[0]
        if not name.startswith("--") or name in seen:
            continue
        why = REFUSED.get(name) or next((w for p, w in PREFIXES.items() if name.startswith(p)), None)
        if why is not None:
            seen.add(name)
            out.append(f"{name}: {why}")
    return out
