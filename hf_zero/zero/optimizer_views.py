"""DeepSpeed's names for a ZeRO optimizer's masters and gradient partitions, on :class:`ShardedOptimizer`.

DeepSpeed's scripts and tests read ``single_partition_of_fp32_groups`` (stages 1-2), ``fp32_partitioned_groups_flat``
(stage 3), ``fp32_groups_flat`` (stage 0), ``averaged_gradients`` and ``get_fp32_grad_partitions()`` off the optimizer.
hf_zero keeps a master per shard group, not per param group, so each is an answer built from the groups when it is
asked. Apart from the optimizer (a base class it inherits) because this is DeepSpeed's read-only surface, grown as
DeepSpeed's tests ask, while the optimizer's own body is the groups, the hooks and the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_zero.zero.group import Placement, ShardGroup
    from hf_zero.zero.nvme import NvmeStores


class DeepSpeedOptimizerViews:
    """DeepSpeed's attributes for this rank's masters (copies) and reduced gradients (views), by ZeRO stage.

    At a stage whose DeepSpeed optimizer has no such attribute, reading it raises AttributeError, so ``hasattr``
    answers as under DeepSpeed. Reads what :class:`hf_zero.zero.optimizer.ShardedOptimizer` sets up: its stage, groups,
    placement, torch optimizer and NVMe stores.
    """

    stage: int
    device: torch.device
    place: Placement
    optimizer: torch.optim.Optimizer
    nvme: NvmeStores | None
    groups: list[ShardGroup]
    master_params: Callable[[], Iterable[torch.Tensor]]
    _group_params: list[list[torch.Tensor]]

    def _per_param_group(self) -> list[torch.Tensor]:
        """This rank's masters of each optimizer param group, bucket after bucket, as one new tensor per group."""
        out = []
        swap = self.nvme.swap if self.nvme is not None else None
        owner = {id(g.master): g for g in self.groups if g.master is not None} if swap is not None else {}

        def flat(m: torch.Tensor) -> torch.Tensor:
            if swap is None or id(m) not in owner:
                return m.detach().reshape(-1)
            with swap.group_resident(owner[id(m)], write=False):  # NVMe: read from its file, a copy
                return m.detach().reshape(-1).clone()

        for pg in self.optimizer.param_groups:
            parts = [flat(m) for m in pg["params"]]
            out.append(torch.cat(parts) if parts else torch.empty(0, dtype=self.place.master_dtype, device=self.device))
        return out

    def _only_at(self, name: str, stages: tuple[int, ...]) -> None:
        if self.stage not in stages:  # DeepSpeed's other wrappers have no such attribute: hasattr answers as there
            raise AttributeError(f"{name} is DeepSpeed's name for the masters at ZeRO stage(s) {stages}; this "
                                 f"optimizer is at stage {self.stage}")

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """Stages 1-2: this rank's partition of each param group's fp32 masters (DeepSpeed's ``DeepSpeedZeroOptimizer``).

        One tensor per param group, as DeepSpeed has it: the rank's share of every bucket of the group, in
        bucket order (a bucket's share on the last rank ends in its padding, as DeepSpeed's partitions do).
        hf_zero keeps a master per bucket, so these are copies taken now: reading them (logging, comparing
        two runs) works as in DeepSpeed; writing into them changes nothing, use
        ``deepspeed.utils.safe_set_full_fp32_param`` / ``safe_set_local_fp32_param`` for that.
        """
        self._only_at("single_partition_of_fp32_groups", (1, 2))
        return self._per_param_group()

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """Stage 3: this rank's partition of each sub-group's fp32 master (DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3``).

        One tensor per hf_zero shard group with a master (DeepSpeed's sub-groups are its ``sub_group_size``
        pieces; hf_zero's are its units' and the whole small parameters' buckets): copies taken now, as
        :attr:`single_partition_of_fp32_groups`.
        """
        self._only_at("fp32_partitioned_groups_flat", (3,))
        return [m.detach().clone() for m in self.master_params()]

    @property
    def fp32_groups_flat(self) -> list[torch.Tensor]:
        """Stage 0 in fp16/bf16: each param group's fp32 masters, whole (DeepSpeed's ``FP16_Optimizer``); copies
        taken now, as :attr:`single_partition_of_fp32_groups`."""
        self._only_at("fp32_groups_flat", (0,))
        return self._per_param_group()

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """DeepSpeed's ZeRO optimizers' attribute: ``[param group index]`` -> this rank's averaged gradient
        partitions, one per parameter, in order (:meth:`get_fp32_grad_partitions` as lists; read-only views)."""
        return {g: [t for _, t in sorted(per.items())] for g, per in self.get_fp32_grad_partitions().items()}

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """DeepSpeed's: ``[param group index][parameter index]`` -> this rank's fp32 partition of that parameter's
        averaged gradient, between an accumulation boundary's backward and the step.

        The indices count the trainable parameters of each optimizer param group, in the group's order. Each
        entry is a view of the reduced gradient shard (an edit changes what the step uses) over the parameter's
        partition (:meth:`ShardGroup.partitions`, where its ``ds_tensor`` is too at stage 3): at stages 1-3 this
        rank's part of it (empty where another rank holds all of it), at stage 0 all of it. A parameter whose
        gradient is not reduced yet (or was dropped by ``zero_grad`` / the step) is left out; offloaded, it is
        the host copy once the device shard is released.
        """
        where: dict[int, tuple[ShardGroup, int, int]] = {}
        for g in self.groups:
            for s, at, n in g.partitions():
                where[id(s.param)] = (g, at, n)
        out: dict[int, dict[int, torch.Tensor]] = {}
        for gi, params in enumerate(self._group_params):
            for pi, p in enumerate(params):
                if id(p) not in where:
                    continue
                g, at, n = where[id(p)]
                grad = g.grad_values()
                if grad is None:
                    continue
                part = grad[at : at + n]
                out.setdefault(gi, {})[pi] = part if part.dtype == torch.float32 else part.float()
        return out
