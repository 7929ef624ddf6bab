"""A session's routing: the final prefill's, every earlier computation that routed its positions otherwise kept for
the tokens it sampled, and the decoded tokens a prefill computed again compared to their first."""

from __future__ import annotations

import numpy as np

from support_replay.core.routing import needed_history
from support_replay.core.support import SupportTable
from support_replay.protocol import Completion
from support_replay.rollout.trajectory import Trajectory


def completion(output: list[int], routed: np.ndarray) -> Completion:
    return Completion(
        output_ids=output,
        finish_reason={"type": "stop"},
        log_mu=np.zeros(len(output), np.float32),
        support=SupportTable.singleton(output),
        routed_experts=routed,
    )


def test_the_final_prefill_wins_and_recomputed_decodes_are_counted():
    rng = np.random.default_rng(0)
    route = lambda n: np.argsort(rng.random((n, 2, 8)), -1)[..., :2].astype(np.int32)  # noqa: E731
    traj = Trajectory(prompt_ids=[1, 2, 3], prompt_text="", capture=True)
    first = route(3 + 4 - 1)  # prompt 3, output 4: positions 0..5 (output tokens 0..2 fed by decode steps)
    traj.append_turn([], completion([10, 11, 12, 13], first))
    second = route(7 + 2 + 3 - 1)  # history 7, inserted 2, output 3
    second[:6] = first  # the prefill routes the history as the first turn did, but for one choice:
    second[4, 1] = [(first[4, 1, 0] + 1) % 8, (first[4, 1, 1] + 1) % 8]  # output token 1 (position 4), layer 1
    traj.append_turn([20, 21], completion([30, 31, 32], second))
    sample = traj.to_sample(0, 0, reward=0.0, temperature=1.0)
    assert np.array_equal(sample.routing, second)  # the final computation's routing, every fed position
    assert sample.routing_recomputed == (1, 3 * 2)  # decoded positions 3, 4, 5 x 2 layers, one choice differed
    # the first turn's tokens followed its own routing of position 4: it is kept for them (a row of their own)
    assert len(sample.routing_history) == 1 and np.array_equal(sample.routing_history[0], first)
    third = route(12 + 1 + 1 - 1)
    third[:11] = second  # routes the history as the second turn did: the second's tokens are scored under it
    traj.append_turn([40], completion([50], third))
    assert [len(r) for r in traj.routing_history] == [6]
    traj.append_turn([41], completion([51], route(14 + 1 + 1 - 1)))  # routes otherwise (new weights): kept
    assert [len(r) for r in traj.routing_history] == [6, 13]
    traj.response_ids += [60, 61]  # inserted after the last model turn: never fed, routed freely
    traj.loss_mask.append(np.zeros(2, np.int8))
    tail = traj.to_sample(0, 0, reward=0.0, temperature=1.0).routing
    assert len(tail) == 3 + len(traj.response_ids) - 1 and (tail[-2:] == -1).all()


def test_a_recompute_s_earlier_routing_is_kept_only_where_it_routed_otherwise():
    rng = np.random.default_rng(1)
    final = np.argsort(rng.random((9, 2, 8)), -1)[..., :2].astype(np.int32)
    same, other = final[:5].copy(), final[:7].copy()
    other[2, 0] = [(v + 1) % 8 for v in other[2, 0]]
    assert [len(r) for r in needed_history([same, other], final)] == [5, 7]  # ``same`` differs from ``other``
    assert [len(r) for r in needed_history([same, final[:7]], final)] == []
