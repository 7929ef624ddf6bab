"""The placement group of a run, laid out as slime and Miles lay theirs out (slime/ray/placement_group.py).

One bundle per device: ``{GPU: 1, CPU: 1}`` there. The trainer's ranks are ``--actor-num-nodes x
--actor-num-gpus-per-node`` bundles and the engines ``--rollout-num-gpus`` more after them, or the same ones
with ``--colocate`` (then ``max`` of the two); each engine spans ``--rollout-num-gpus-per-engine`` bundles and its
actor sits in the first. The bundles are ordered by node and device before they are handed out, so the ranks
fill the first node(s) and the engines the rest. On a machine without CUDA a "GPU" is a custom resource
(``SIM_GPU``) that each node declares, as many as the device slots it simulates; the CPUs of a bundle are
stated (``--ray-cpus-per-bundle``), so an oversubscription of the machine's cores is a number the run prints.
"""

from __future__ import annotations

from dataclasses import dataclass

SIM_GPU = "sim_gpu"  # the custom resource that stands for a device on a node without CUDA
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# the share of a bundle's device each actor asks for, slime's (0.4 a trainer rank, 0.2 an engine): colocated,
# both fit in one bundle
RANK_SHARE, ENGINE_SHARE = 0.4, 0.2


@dataclass(frozen=True)
class Layout:
    actor_ranks: int
    rollout_gpus: int
    gpus_per_engine: int
    colocate: bool

    @property
    def bundles(self) -> int:
        return max(self.actor_ranks, self.rollout_gpus) if self.colocate else self.actor_ranks + self.rollout_gpus

    @property
    def rollout_offset(self) -> int:
        return 0 if self.colocate else self.actor_ranks

    @property
    def engines(self) -> int:
        return self.rollout_gpus // self.gpus_per_engine

    def rank_bundle(self, rank: int, order: list[int]) -> int:
        return order[rank]

    def engine_bundle(self, engine: int, order: list[int]) -> int:
        """The bundle of an engine's first device (its actor's)."""
        return order[self.rollout_offset + engine * self.gpus_per_engine]


def bundle(gpu_resource: str, cpus: float) -> dict[str, float]:
    return {gpu_resource: 1.0, "CPU": cpus}


def ordered(infos: list[tuple[str, str, int]]) -> list[int]:
    """Bundle indices by (node address, node id, device id, index): slime sorts by address and device; on one
    host every simulated node has the loopback address, so the node id orders them."""

    def key(i: int):
        address, node, device = infos[i]
        parts = (
            [int(p) for p in address.split(".")] if address.replace(".", "").isdigit() else [ord(c) for c in address]
        )
        return parts, node, device, i

    return sorted(range(len(infos)), key=key)
