"""``--ci-test`` under a policy lag: every token against the weights that sampled it.

With ``--max-policy-lag N`` a token may come from any of the last ``N + 1`` pushed versions,
while the trainer's score before the update is under the current one only. Rank 0 keeps the
weights of the versions in that window on CPU (the full state dicts it gathers for the push
anyway, copied) and scores the samples holding older tokens under them, with the actor's own
scoring function (``Scorer``, same head, same support, same penalties) on a plain copy of
the model; each token takes the score of its own version span. The check stays exact: the
per-token comparison is the one ``compare_with_rollout`` makes without a lag.

Cost (docs/scaling.md): up to ``N`` extra full state dicts in CPU memory plus one model copy, and
per rollout one extra scoring forward over the stale samples for each older version present.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..errors import PolicyLagError
from ..protocol import versions_of
from ..rollout.sample import Sample
from .actor import load_scoring_model
from .batches import plan_optimizer_steps
from .checks import live_spans
from .scorer import Scorer


class LaggedScorer:
    def __init__(
        self,
        checkpoint,
        device,
        *,
        keep: int,
        sparse: bool,
        batch_invariant: bool,
        temperature: float,
        micro_batch: int,
        max_tokens: int | None = None,
        compute_dtype: torch.dtype = torch.float32,
        pack: bool = False,
        linear_kernel: str = "torch",
        routing_replay: bool = False,
        attn_implementation: str = "sdpa",
    ):
        self.keep, self.sparse, self.temperature, self.device = keep, sparse, temperature, device
        self.micro_batch, self.max_tokens, self.pack = micro_batch, max_tokens, pack
        self.states: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.model = (
            load_scoring_model(checkpoint, device, batch_invariant, compute_dtype, linear_kernel, attn_implementation)
            .eval()
            .requires_grad_(False)
        )
        self.model.replay_routing = routing_replay  # the actor's forward: the samples' routing, as it replays it
        self.scorer = Scorer(self.model, temperature, replay=True, sparse=sparse)

    def add(self, version: str, state: dict[str, torch.Tensor]) -> None:
        """Keep ``version``'s weights (copied: the actor updates its own in place), dropping the
        oldest beyond the window."""
        self.states[version] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        while len(self.states) > self.keep:
            self.states.popitem(last=False)

    @torch.no_grad()
    def by_sampling_version(
        self, samples: list[Sample], current_logp: list[torch.Tensor], current: str, semantics: str
    ) -> list[torch.Tensor]:
        """``current_logp`` (the actor's scores under ``current``) with every token sampled by an
        older version re-scored under that version's weights."""
        out = [lp.detach().clone() for lp in current_logp]
        # spans masked for their age (partial rollouts) are neither trained nor compared: their weights may be gone
        older = sorted({v for s in samples for v in versions_of(live_spans(s))} - {current})
        for version in older:
            if version not in self.states:  # check_policy_lag ran first: a version inside the window is kept
                raise PolicyLagError(
                    f"--ci-test: the weights of version {version!r} are not kept (window: {list(self.states)})"
                )
            chosen = [i for i, s in enumerate(samples) if version in versions_of(live_spans(s))]
            scores = self._score([samples[i] for i in chosen], self.states[version], semantics)
            for i, logp in zip(chosen, scores):
                for span in live_spans(samples[i]):
                    if span.version == version:
                        out[i][span.start : span.end] = logp[span.start : span.end].to(out[i].device)
        return out

    def _score(self, samples: list[Sample], state: dict[str, torch.Tensor], semantics: str) -> list[torch.Tensor]:
        self.model.hf.load_state_dict(state, strict=True)
        steps = plan_optimizer_steps(
            samples,
            global_batch=len(samples),
            micro_batch=self.micro_batch,
            rank=0,
            world=1,
            replay=True,
            device=self.device,
            penalty_semantics=semantics,
            max_tokens=self.max_tokens,
            pack=self.pack,
        )
        scores: dict[int, torch.Tensor] = {}
        for batch in (mb for step in steps for mb in step.micro_batches):
            logp = self.scorer(batch).logp
            scores.update(zip(batch.indices, batch.split(logp)))
        return [scores[i] for i in range(len(samples))]


def lagged_scorer(learner, ctx, checkpoint, *, max_policy_lag: int, ci_test: bool) -> LaggedScorer | None:
    """Rank 0's scorer of older versions for --ci-test under a policy lag (the learner's head,
    batches and kernels), or None."""
    if not (ctx.is_main and ci_test and max_policy_lag):
        return None
    parallel = learner.parallel_cfg
    return LaggedScorer(
        checkpoint,
        ctx.device,
        keep=max_policy_lag + 1,
        sparse=learner.actor.sparse_head,
        batch_invariant=learner.replay_cfg.true_on_policy_mode,
        compute_dtype=learner.actor.model.compute_dtype,
        temperature=learner.temperature,
        micro_batch=parallel.micro_batch,
        max_tokens=parallel.max_tokens_per_micro_batch,
        pack=learner.pack,
        linear_kernel=learner.linear_kernel,
        routing_replay=learner.actor.model.replay_routing,
        attn_implementation=learner.replay_cfg.attn_implementation,
    )
