"""A fleet simulation to plan past this machine: trained tokens per second, engine idle share and token lag for
synchronous rollouts, async lag 1, partial rollouts and in-flight updates, at 8, 64 and 512 engines.

    python bench/partial_rollout.py --rollouts 4 --trace runs.json   # this machine's runs: costs and targets
    python bench/fleet_sim.py --trace runs.json [--engines 8,64,512] [--max-len 8192] [--rollouts 12]

A discrete-event model of engines and a trainer (no tokens, no model: times and counts).

- **Engine**: continuous batching. A decode step of b rows takes ``a + c*b`` seconds, then ``gap`` seconds of
  scheduling between steps (idle); a prefill of n tokens takes ``p0 + p*n``. A request joins at once up to
  ``max_running`` rows, otherwise it queues. Each token carries the weight version of the step that sampled it.
- **Trainer**: a rollout's update takes ``u`` seconds per token of its trained samples (prompt + response); the
  push then takes ``push`` seconds. Colocated (this machine: engine and trainer share 2 cores), while both work
  the engine's steps and the trainer each run slower by their measured factor; a fleet is disaggregated (1).
- **Modes**, as support-replay runs them (train/loop.py, rollout/partial.py, engine/pausing.py):
  ``sync``: generate, update, push. ``async`` (``--async-rollout --max-policy-lag 1``): rollout r+1 generates
  during update r; push r waits for rollout r+1's requests, then r+2 starts. ``partial`` (``--partial-rollout``,
  ``--over-sampling-batch-size`` 2x): twice the groups are sent, the first half to finish trains, the rest are
  stopped and continued first in the next rollout; a group whose oldest tokens are ``--max-policy-lag`` (1) old is
  not stopped again, the stop waits for it (tokens beyond the lag would be masked, per token).
  ``in-flight`` (``--async-rollout --weight-sync-mode retract``): push r lands between decode steps as soon as
  update r ends; the running rows pause for the push and their context is prefilled again (the recompute).

Costs on this machine are fitted on the ``sync`` run of the trace (least squares over its decode steps, the
prefills' seconds per token, the trainer's and the push's seconds from its per-rollout timings), the colocation
slowdowns on the ``async`` run's steps that overlapped a trainer call, and the model must reproduce the
measured ``sync`` and ``async`` runs (their own response lengths, rollout by rollout) within 15% in trained tokens
per second and engine busy time before it projects. The fleet's costs come from published GPU figures (printed
with their sources), its response lengths from the measured run's length distribution scaled to ``--max-len``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

MODES = ("sync", "async", "partial", "in-flight")
TOLERANCE = 0.15

# Published GPU figures the fleet is costed with (each printed beside the table).
H100_TRAINER_TOKENS_PER_S = 11_896  # prime-rl benchmarks/baselines/benchmark-1xh100-Qwen--Qwen3-0.6B-rl-full-1gpu-
# Recompute-flash_attention_3-16384-cp1-ep1.json (2026-01-15): Qwen3-0.6B RL step on one H100, 1.992 s a step
GPU_TPOT_S = 4.2e-3  # vLLM Qwen3-0.6B, one request (ISL 128), A100: tenstorrent/tt-inference-server#340 (2025-06-24)
GPU_TTFT_S = 12.4e-3  # the same table's time to first token at one request (ISL 128): a prefill's fixed cost


@dataclass
class Costs:
    a: float  # decode step, seconds
    c: float  # decode step, seconds per row
    gap: float  # between decode steps, seconds (scheduling; not busy)
    p0: float  # prefill, seconds
    p: float  # prefill, seconds per token
    u: float  # update, seconds per trained token (prompt + response)
    push: float  # weight push, seconds
    check: float = 0.0  # --ci-test: seconds per token of a sample holding tokens of an older version (rescored)
    slow_engine: float = 1.0  # colocated: the engine's steps this much slower while the trainer works
    slow_trainer: float = 1.0  # colocated: the trainer this much slower while the engine works
    max_running: int = 1 << 30

    def step(self, rows: int) -> float:
        return self.a + self.c * rows

    def prefill(self, tokens: int) -> float:
        return self.p0 + self.p * tokens if tokens else 0.0


@dataclass
class Request:
    rollout: int  # the rollout that sent it (its group's)
    group: int
    prompt: int
    left: int  # response tokens still to generate
    tokens: Counter = field(default_factory=Counter)  # weight version -> tokens it sampled

    @property
    def context(self) -> int:
        return self.prompt + sum(self.tokens.values())


class SimEngine:
    def __init__(self, index: int, costs: Costs, on_done):
        self.index, self.costs, self.on_done = index, costs, on_done
        self.t = 0.0
        self.busy = 0.0
        self.running: list[Request] = []
        self.queue: list[Request] = []
        self.version = 0
        self.slow = 1.0
        self.epoch = 0  # bumps whenever its next event moves: stale heap entries are skipped

    def load(self) -> int:
        return len(self.running) + len(self.queue)

    def _step_time(self) -> float:
        return self.costs.step(len(self.running)) * self.slow

    def next_event(self) -> float:
        if not self.running:
            return math.inf
        k = min(r.left for r in self.running)
        return self.t + k * (self._step_time() + self.costs.gap)

    def _spend(self, seconds: float) -> None:
        self.t += seconds
        self.busy += seconds

    def admit(self, requests: list[Request], now: float, recompute: bool = False) -> None:
        """Requests join (or queue); their prompt (and, continued, their tokens so far) prefilled at once."""
        self.t = max(self.t, now)
        self.queue.extend(requests)
        self._admit()

    def _admit(self) -> None:
        room = self.costs.max_running - len(self.running)
        joining, self.queue = self.queue[:room], self.queue[room:]
        if joining:
            self._spend(self.costs.prefill(sum(r.context for r in joining)) * self.slow)
            self.running.extend(joining)

    def _steps(self, k: int) -> None:
        self._spend(k * self._step_time())
        self.t += k * self.costs.gap
        for r in self.running:
            r.left -= k
            r.tokens[self.version] += k
        done = [r for r in self.running if r.left <= 0]
        if done:
            self.running = [r for r in self.running if r.left > 0]
            for r in done:
                self.on_done(self, r)
            self._admit()

    def advance(self, until: float, finish_step: bool = False) -> None:
        """Run decode steps that end by ``until``; ``finish_step``: then the step in progress too (a pause or a
        stop lands between steps)."""
        while self.running:
            each = self._step_time() + self.costs.gap
            k = min(min(r.left for r in self.running), int((until - self.t) / each + 1e-9))
            if k <= 0:
                if finish_step and self.t < until:
                    self._steps(1)
                    continue
                break
            self._steps(k)
        self.t = max(self.t, until)
        self.epoch += 1

    def pause(self, seconds: float) -> None:
        """The weight push lands: ``seconds`` paused, then the running rows' context prefilled again."""
        self.t += seconds
        self.version += 1
        if self.running:
            self._spend(self.costs.prefill(sum(r.context for r in self.running)) * self.slow)

    def take_all(self) -> list[Request]:
        out, self.running, self.queue = self.running + self.queue, [], []
        self.epoch += 1
        return out


class Fleet:
    """Engines, a router (least loaded) and a trainer under one of the four modes."""

    def __init__(self, mode: str, engines: int, costs: Costs, lengths, samples: int, group: int, max_lag: int = 1):
        self.mode, self.costs, self.lengths = mode, costs, lengths
        self.samples, self.group, self.max_lag = samples, group, max_lag
        self.engines = [SimEngine(i, costs, self._done) for i in range(engines)]
        self.colocated = (costs.slow_engine, costs.slow_trainer) != (1.0, 1.0)
        self.heap: list = []
        self.now = 0.0
        self.done: dict[int, list[Request]] = {}  # group -> its finished requests
        self.complete: list[int] = []  # groups whose every request finished, not yet trained
        self.outstanding = 0  # requests sent and neither finished nor stopped
        self.group_size: dict[int, int] = {}
        self.group_rollout: dict[int, int] = {}
        self.kept: list[Request] = []
        self.next_group = 0
        self.trained = self.generated = self.masked = 0
        self.lags: Counter = Counter()
        self.trainer_busy_until = None  # while an update runs: its remaining full-speed seconds and last time
        self.train_left = 0.0
        self.train_mark = 0.0

    # the router and the engines ------------------------------------------------------------------
    def _done(self, engine: SimEngine, request: Request) -> None:
        finished = self.done.setdefault(request.group, [])
        finished.append(request)
        self.outstanding -= 1
        if len(finished) == self.group_size[request.group]:
            self.complete.append(request.group)

    def _schedule(self, engine: SimEngine) -> None:
        heapq.heappush(self.heap, (engine.next_event(), engine.index, engine.epoch))

    def _send(self, requests: list[Request]) -> None:
        self.outstanding += len(requests)
        by_engine: dict[int, list[Request]] = {}
        loads = [(e.load(), e.index) for e in self.engines]
        heapq.heapify(loads)
        for r in requests:
            load, i = heapq.heappop(loads)
            by_engine.setdefault(i, []).append(r)
            heapq.heappush(loads, (load + 1, i))
        for i, rs in by_engine.items():
            e = self.engines[i]
            e.advance(self.now)
            e.admit(rs, self.now)
            self._schedule(e)

    def _new_groups(self, n: int, rollout: int) -> list[Request]:
        out = []
        for _ in range(n):
            g = self.next_group
            self.next_group += 1
            self.group_size[g], self.group_rollout[g] = self.group, rollout
            for _ in range(self.group):
                prompt, response = self.lengths()
                out.append(Request(rollout, g, prompt, response))
        return out

    # the trainer (processor sharing with the engines when colocated) -----------------------------------
    def _engines_busy(self) -> bool:
        return self.colocated and any(e.running for e in self.engines)  # read only when colocated

    def _set_speeds(self) -> None:
        training = self.train_left > 0
        for e in self.engines:
            slow = self.costs.slow_engine if self.colocated and training else 1.0
            if slow != e.slow:
                e.advance(self.now, finish_step=False)
                e.slow = slow
                self._schedule(e)

    def _trainer_rate(self) -> float:
        return 1.0 / self.costs.slow_trainer if self._engines_busy() else 1.0

    def _trainer_end(self) -> float:
        return self.train_mark + self.train_left / self._trainer_rate() if self.train_left > 0 else math.inf

    def _account_trainer(self, t: float) -> None:
        if self.train_left > 0:
            self.train_left = max(0.0, self.train_left - (t - self.train_mark) * self._trainer_rate())
        self.train_mark = t

    def _run_until(self, condition) -> None:
        """Process engine events and the trainer in time order until ``condition()`` (checked after each)."""
        while not condition():
            while self.heap and self.heap[0][2] != self.engines[self.heap[0][1]].epoch:
                heapq.heappop(self.heap)
            t_engine = self.heap[0][0] if self.heap else math.inf
            t_trainer = self._trainer_end()
            t = min(t_engine, t_trainer)
            if t == math.inf:
                raise RuntimeError(f"{self.mode}: nothing left to run and the condition never held")
            self._account_trainer(t)
            self.now = t
            if t_trainer <= t_engine:
                self.train_left = 0.0
                self._set_speeds()
                continue
            _, i, _ = heapq.heappop(self.heap)
            e = self.engines[i]
            was_busy = self._engines_busy()
            e.advance(t)
            self._schedule(e)
            if was_busy != self._engines_busy():
                self._account_trainer(t)

    def _train(self, groups: list[int], version: int) -> None:
        """Start the update of ``groups`` (trainer at weights ``version``): count its tokens and lags."""
        tokens = rescored = 0
        self.complete = [g for g in self.complete if g not in set(groups)]
        for g in groups:
            for r in self.done.pop(g):
                tokens += r.prompt
                if any(v < version for v in r.tokens):  # --ci-test scores it again under those weights
                    rescored += r.context
                for v, n in r.tokens.items():
                    lag = version - v
                    if lag > self.max_lag:
                        self.masked += n
                    else:
                        self.trained += n
                        self.lags[lag] += n
                    tokens += n
        self._account_trainer(self.now)
        self.train_left = self.costs.u * tokens + self.costs.check * rescored
        self._set_speeds()

    def _training_done(self) -> bool:
        return self.train_left <= 0

    def _push(self, in_flight: bool) -> None:
        """The push: each engine paused ``push`` seconds after its step in progress (in flight: then its running
        rows recomputed); otherwise the engines are idle and the run waits for it."""
        for e in self.engines:
            e.advance(self.now, finish_step=in_flight)
            e.pause(self.costs.push)
            e.epoch += 1
            self._schedule(e)
        if not in_flight:
            self.now += self.costs.push

    def _oldest(self, kept: list[Request]) -> dict[int, float]:
        """Each held group's oldest token's weight version (its finished requests' and its stopped ones'), in one
        pass over them."""
        oldest: dict[int, float] = {}
        for r_ in [*(r_ for rs in self.done.values() for r_ in rs), *kept]:
            if r_.tokens:
                oldest[r_.group] = min(oldest.get(r_.group, math.inf), min(r_.tokens))
        return oldest

    def _idle_engines(self) -> bool:
        return self.outstanding == 0

    # the modes --------------------------------------------------------------------------------------
    def run(self, rollouts: int) -> dict:
        per_rollout = self.samples // self.group
        if self.mode == "sync":
            for r in range(rollouts):
                self._send(self._new_groups(per_rollout, r))
                self._run_until(self._idle_engines)
                self._train(list(self.done), r)
                self._run_until(self._training_done)
                self._push(in_flight=False)
        elif self.mode == "partial":
            for r in range(rollouts):
                kept, self.kept = self.kept, []  # stopped last rollout: continued first
                in_flight = set(self.done) | {k.group for k in kept}  # unfinished groups and untrained ones
                # a group whose oldest tokens are max_lag old now is not stopped again (rollout/partial.py)
                oldest = self._oldest(kept)
                last_chance = {g for g in in_flight if oldest.get(g, math.inf) <= r - self.max_lag}
                self._send(kept + self._new_groups(2 * per_rollout - len(in_flight), r))
                self._run_until(lambda: len(self.complete) >= per_rollout and last_chance <= set(self.complete))
                groups = sorted(self.complete, key=lambda g: (self.group_rollout[g], g))[:per_rollout]
                for e in self.engines:  # the rest stopped after their step in progress, their tokens kept
                    e.advance(self.now, finish_step=True)
                    stopped = e.take_all()
                    self.outstanding -= len(stopped)
                    self.kept.extend(stopped)
                self.now = max([self.now] + [e.t for e in self.engines])
                self._train(groups, r)
                self._run_until(self._training_done)
                self._push(in_flight=False)
            held = self.kept + [r_ for rs in self.done.values() for r_ in rs]
            self.kept_tokens = sum(sum(k.tokens.values()) for k in held)
        else:  # async, in-flight: rollout r+1 generates while update r runs
            in_flight = self.mode == "in-flight"
            self._send(self._new_groups(per_rollout, 0))
            self._run_until(self._idle_engines)
            for r in range(rollouts):
                ready = list(self.done)
                if r + 1 < rollouts:
                    self._send(self._new_groups(per_rollout, r + 1))
                self._train(ready, r)
                self._run_until(self._training_done)
                if not in_flight:  # the push waits for the requests in flight
                    self._run_until(self._idle_engines)
                self._push(in_flight=in_flight)
                if in_flight:
                    self._run_until(self._idle_engines)
        self.generated = self.trained + self.masked + getattr(self, "kept_tokens", 0)
        span = max([self.now] + [e.t for e in self.engines])
        lags = self.lags
        total = sum(lags.values())
        return {
            "mode": self.mode,
            "span": span,
            "trained": self.trained,
            "rate": self.trained / span,
            "busy": statistics.mean(e.busy for e in self.engines),
            "idle": 1 - statistics.mean(e.busy for e in self.engines) / span,
            "generated": self.generated,
            "kept": getattr(self, "kept_tokens", 0),
            "masked": self.masked,
            "lag_mean": sum(k * n for k, n in lags.items()) / total if total else 0.0,
            "lag_max": max(lags) if lags else 0,
            "lag_share": {k: n / total for k, n in sorted(lags.items())},
        }


# this machine: costs fitted on the sync run, targets from both runs ---------------------------------------
TRAINER_CALLS = ("score_before_update", "update")


def fit_costs(sync: dict, lagged: dict) -> Costs:
    """Costs from the sync run; the colocation slowdowns from the async run, where engine and trainer overlap:
    the engine's, its decode steps that started during a trainer call against the sync fit (their total time over
    the fit's); the trainer's, from how much of its calls' time the engine worked and how much longer they took per
    token."""
    steps = sync["steps"]
    decode = np.array([(s[3], s[2]) for s in steps if s[0] == "decode" and s[3] > 0])
    (a, c), *_ = np.linalg.lstsq(np.c_[np.ones(len(decode)), decode[:, 0]], decode[:, 1], rcond=None)
    prefill = [s for s in steps if s[0] == "prefill_and_join"]  # a few, alike: seconds per token
    p = sum(s[2] for s in prefill) / sum(s[3] for s in prefill)
    rollouts = sync["rollouts"]
    generate = sum(r["time_generate"] for r in rollouts)
    busy = sum(s[2] for s in steps if s[0] in ("decode", "prefill_and_join"))
    gap = (generate - busy) / len(decode)
    tokens = sum(p_ + n for p_, n in sync["requests"])
    update = sum(r["time_step"] - r["time_generate"] - r["time_sync"] for r in rollouts)
    push = statistics.mean(r["time_sync"] for r in rollouts)

    engine = [s for s in lagged["steps"] if s[0] in ("decode", "prefill_and_join")]

    def overlap(t0: float, t1: float) -> float:
        return sum(max(0.0, min(t1, s[1] + s[2]) - max(t0, s[1])) for s in engine)

    calls = [(s[1], s[1] + s[2]) for s in lagged["steps"] if s[0] in TRAINER_CALLS]
    during = [s for s in engine if s[0] == "decode" and any(t0 <= s[1] < t1 for t0, t1 in calls)]
    # the ratio of their total time to the sync fit's: the engine's busy time is what the model must reproduce,
    # and its few much slower steps (the trainer's heaviest moments) weigh in it as much as the many others
    slow_engine = sum(s[2] for s in during) / sum(a + c * s[3] for s in during) if during else 1.0
    shared = sum(overlap(t0, t1) for t0, t1 in calls)
    spent = sum(t1 - t0 for t0, t1 in calls)
    per_token = sum(s[2] for s in steps if s[0] in TRAINER_CALLS) / tokens  # the sync run's calls
    alone = per_token * sum(p_ + n for p_, n in lagged["requests"])  # the async run's calls, had nothing overlapped
    slow_trainer = shared / (alone - spent + shared) if shared and alone - spent + shared > 0 else 1.0
    # the async run's checks rescore its lagged rollouts (all but the first); the slowdown of their overlap undone
    checks = [(s[1], s[1] + s[2]) for s in lagged["steps"] if s[0] == "checks"][1:]
    check_alone = sum((t1 - t0) - overlap(t0, t1) * (1 - 1 / slow_trainer) for t0, t1 in checks)
    n = lagged["samples_per_rollout"]
    rescored = sum(p_ + n_ for p_, n_ in lagged["requests"][n:])
    sync_checks = sum(s[2] for s in steps if s[0] == "checks")  # what a check costs without rescoring
    check = max(0.0, check_alone - sync_checks * len(checks) / len(rollouts)) / rescored if rescored else 0.0
    return Costs(
        a=a,
        c=c,
        gap=max(gap, 0.0),
        p0=0.0,
        p=p,
        u=update / tokens,
        push=push,
        check=check,
        slow_engine=slow_engine,
        slow_trainer=slow_trainer,
    )


def measured(run: dict) -> dict:
    span = sum(r["time_step"] for r in run["rollouts"])
    return {"span": span, "trained": run["trained"], "rate": run["trained"] / span, "busy": run["busy"]}


def replay_lengths(run: dict):
    """The run's own requests, rollout by rollout (each rollout's requests end before the next one's)."""
    queue = list(run["requests"])
    return lambda: queue.pop(0)


def reproduce(trace: dict) -> tuple[Costs, list[dict]]:
    costs = fit_costs(trace["sync"], trace["async"])
    rows = []
    for mode in ("sync", "async"):
        run = trace[mode]
        n = run["samples_per_rollout"]
        sim = Fleet(mode, 1, costs, replay_lengths(run), samples=n, group=4).run(len(run["rollouts"]))
        rows.append({"mode": mode, "measured": measured(run), "sim": sim})
    return costs, rows


def fleet_costs(push: float, max_running: int) -> Costs:
    return Costs(
        a=GPU_TPOT_S,
        c=1.0 / (4 * H100_TRAINER_TOKENS_PER_S),  # a row's forward: a quarter of a recomputed training step's work
        gap=0.0,
        p0=GPU_TTFT_S,
        p=1.0 / (4 * H100_TRAINER_TOKENS_PER_S),  # a token's forward, as a decode row's
        u=1.0 / H100_TRAINER_TOKENS_PER_S,  # scaled by the trainer's GPUs (below)
        push=push,
        max_running=max_running,
    )


def scaled_lengths(trace: dict, max_len: int, prompt: int, seed: int):
    """Draws from the measured response lengths, as a share of their cap, scaled to ``max_len``."""
    cap = trace["sync"]["max_len"]
    shares = [min(n, cap) / cap for _, n in trace["sync"]["requests"]]
    rng = random.Random(seed)
    return lambda: (prompt, max(1, round(rng.choice(shares) * max_len)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="bench/partial_rollout.py --trace output (modes sync and async)")
    ap.add_argument("--engines", default="8,64,512")
    ap.add_argument("--max-len", type=int, default=8192, help="the fleet's response cap (lengths scaled to it)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--samples-per-engine", type=int, default=64, help="a rollout's samples, per engine")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-running", type=int, default=256, help="rows an engine decodes at once")
    ap.add_argument("--trainer-gpus-per-engine", type=float, default=1.0)
    ap.add_argument("--push-s", type=float, default=1.0, help="a weight push's pause (an assumption: not measured)")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)

    costs, rows = reproduce(trace)
    print(
        f"Costs on {trace['sync']['cpu']} (fitted on the sync run): decode step {costs.a * 1e3:.1f} ms + "
        f"{costs.c * 1e3:.2f} ms a row, {costs.gap * 1e3:.1f} ms between steps; prefill {costs.p0 * 1e3:.1f} ms + "
        f"{costs.p * 1e3:.3f} ms a token; update {costs.u * 1e3:.2f} ms a token; push {costs.push:.2f} s; "
        f"--ci-test's rescoring of a lagged sample {costs.check * 1e3:.2f} ms a token; "
        f"colocated: engine steps x{costs.slow_engine:.2f} while the trainer works, the trainer "
        f"x{costs.slow_trainer:.2f} while the engine works\n"
    )
    print(
        "| mode | measured s | simulated s | measured trained tok/s | simulated | diff | measured engine busy s "
        "| simulated | diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for row in rows:
        m, s = row["measured"], row["sim"]
        d_rate, d_busy = s["rate"] / m["rate"] - 1, s["busy"] / m["busy"] - 1
        worst = max(worst, abs(d_rate), abs(d_busy))
        print(
            f"| {row['mode']} | {m['span']:.1f} | {s['span']:.1f} | {m['rate']:.1f} | {s['rate']:.1f} "
            f"| {d_rate:+.0%} | {m['busy']:.1f} | {s['busy']:.1f} | {d_busy:+.0%} |"
        )
    if worst > TOLERANCE:
        raise SystemExit(f"the model misses this machine's runs by {worst:.0%} (over {TOLERANCE:.0%}): no projection")
    print(f"\nWithin {TOLERANCE:.0%} of both runs (worst {worst:.0%}): projecting.\n")

    gpu = fleet_costs(args.push_s, args.max_running)
    print(
        "Fleet costs (published figures): decode step "
        f"{gpu.a * 1e3:.1f} ms (vLLM Qwen3-0.6B TPOT at one request on an A100, tenstorrent/tt-inference-server#340) "
        f"+ {gpu.c * 1e6:.0f} us a row (a quarter of prime-rl's H100 RL step per token: {H100_TRAINER_TOKENS_PER_S:,}"
        f" tok/s, benchmarks/baselines/...Qwen3-0.6B-rl-full-1gpu-Recompute-...-16384); prefill "
        f"{GPU_TTFT_S * 1e3:.1f} ms (TTFT, same table) + {gpu.p * 1e6:.0f} us a token; "
        f"trainer {H100_TRAINER_TOKENS_PER_S:,} tok/s per H100, "
        f"{args.trainer_gpus_per_engine:g} trainer GPU per engine, linear; push {args.push_s:g} s (assumed); up to "
        f"{args.max_running} rows an engine; responses: the measured run's lengths as a share of its cap, scaled "
        f"to {args.max_len}; prompts {args.prompt_len}; {args.samples_per_engine} samples per engine a rollout in "
        f"groups of {args.group}; {args.rollouts} rollouts\n"
    )
    print(
        "| engines | mode | trained tok/s | per engine | engine idle | token lag mean | lag 0 / 1 share "
        "| masked (beyond lag 1) | kept at end | rollout s |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.engines.split(",")):
        trainer = n * args.trainer_gpus_per_engine
        costs_n = Costs(**{**gpu.__dict__, "u": gpu.u / trainer})
        for mode in MODES:
            lengths = scaled_lengths(trace, args.max_len, args.prompt_len, args.seed)
            sim = Fleet(mode, n, costs_n, lengths, samples=n * args.samples_per_engine, group=args.group)
            s = sim.run(args.rollouts)
            share = s["lag_share"]
            print(
                f"| {n} | {mode} | {s['rate']:,.0f} | {s['rate'] / n:,.0f} | {s['idle']:.0%} | {s['lag_mean']:.2f} "
                f"| {share.get(0, 0):.0%} / {share.get(1, 0):.0%} | {s['masked']:,} | {s['kept']:,} "
                f"| {s['span'] / args.rollouts:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
