"""The policy's weight versions: their names, the push to the engine, the copies --ci-test keeps."""

from __future__ import annotations

from .lagged import LaggedScorer


def policy_version(updates: int) -> str:
    """The name the trainer gives the weights after ``updates`` rollouts' updates."""
    return str(updates)


class PolicyVersions:
    """Versions in push order, the engine's current one last; ``push`` gathers the unsharded weights
    (every rank) and hands them to the engine (rank 0, when there is a ``sync``); ``lagged`` keeps a
    copy for --ci-test under a policy lag."""

    def __init__(self, start: int, sync, lagged: LaggedScorer | None, keeps_copies: bool):
        self.pushed = [policy_version(start)]
        self.sync, self.lagged = sync, lagged
        self.keeps_copies = keeps_copies  # --ci-test under a lag: rank 0 keeps the weights of recent versions

    @property
    def current(self) -> str:
        return self.pushed[-1]

    def push(self, learner, ctx, *, to_engine: bool = True) -> None:
        state, adapter = learner.actor.checkpoint_state()  # with LoRA: merged, and the adapter alone
        if ctx.is_main and to_engine and self.sync is not None:
            self.sync.push(adapter if getattr(self.sync, "takes_adapter", False) else state, self.current)
        if self.lagged is not None:
            self.lagged.add(self.current, state)

    def advance(self, learner, ctx, updates: int) -> None:
        """The weights after ``updates`` rollouts' updates, named and pushed."""
        self.pushed.append(policy_version(updates))
        self.push(learner, ctx)
