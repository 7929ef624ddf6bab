"""bench/fleet_sim.py's model: its times where they can be worked out by hand, and its token accounting."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("fleet_sim", Path(__file__).parents[1] / "bench" / "fleet_sim.py")
fleet_sim = sys.modules["fleet_sim"] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up
_spec.loader.exec_module(fleet_sim)

COSTS = fleet_sim.Costs(a=0.01, c=0.001, gap=0.0, p0=0.0, p=0.0001, u=0.002, push=0.5)


def lengths(cycle):
    it = itertools.cycle(cycle)
    return lambda: (10, next(it))


def test_one_engine_synchronous_rollouts_take_the_time_worked_out_by_hand():
    # 4 requests of 20 tokens: prefill 40 tokens, 20 steps of 4 rows, an update of 4 x 30 tokens, the push
    per_rollout = 40 * 0.0001 + 20 * (0.01 + 4 * 0.001) + 120 * 0.002 + 0.5
    s = fleet_sim.Fleet("sync", 1, COSTS, lengths([20]), samples=4, group=2).run(3)
    assert s["span"] == pytest.approx(3 * per_rollout)
    assert s["trained"] == 3 * 80 and s["lag_max"] == 0 and s["generated"] == s["trained"]
    assert s["busy"] == pytest.approx(3 * (40 * 0.0001 + 20 * 0.014))


@pytest.mark.parametrize("mode", fleet_sim.MODES)
def test_every_generated_token_is_trained_masked_or_kept_and_lags_are_bounded(mode):
    s = fleet_sim.Fleet(mode, 3, COSTS, lengths([5, 80, 12, 300, 7, 40]), samples=24, group=4).run(6)
    assert s["generated"] == s["trained"] + s["masked"] + s["kept"]
    assert 0 < s["idle"] < 1 and s["trained"] > 0
    assert s["lag_max"] <= 1  # beyond --max-policy-lag 1: masked, never trained
    if mode == "sync":
        assert s["lag_max"] == 0
    if mode in ("async", "in-flight", "partial"):
        assert s["lag_share"].get(1, 0) > 0
    if mode != "partial":
        assert s["masked"] == 0 and s["kept"] == 0


def test_partial_rollouts_beat_synchronous_ones_when_one_response_is_ten_times_the_others():
    tail = lengths([20, 20, 20, 200])
    sync = fleet_sim.Fleet("sync", 2, COSTS, tail, samples=16, group=4).run(6)
    partial = fleet_sim.Fleet("partial", 2, COSTS, lengths([20, 20, 20, 200]), samples=16, group=4).run(6)
    assert partial["rate"] > sync["rate"]
