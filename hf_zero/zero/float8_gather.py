"""Stage 3's float8 all-gather: the weights of torchao's float8 linears gathered as float8, half the bytes of bf16.

A float8 linear (tensorwise scaling) casts its whole weight to float8 with one scale, ``fp8_max / amax(|W|)``, before
every matmul. Under ZeRO-3 that cast can move before the all-gather instead of after it, because the only value
that needs the whole weight is its amax: each rank takes the amax of its own part of every weight, one all-reduce
(MAX) over the shard group makes it the whole weight's, each rank casts its shard with that scale, and the
all-gather moves float8 bytes. The gathered float8 weight and its scale are handed to the linear, which uses them
without casting again (torchao's matmul takes an argument that is already float8 as it is). Every element is cast
by the same elementwise rule, with the same scale, as the single-process cast of the whole weight, so the gathered
bits equal it exactly. torchao does the same under FSDP2 (``enable_fsdp_float8_all_gather``), through FSDP2's
all-gather extension points; here it is one more shard group.

:class:`Float8ShardedParamGroup` holds only such weights (``_build_stage3`` puts them in groups of their own).
Masters, gradients, reduce-scatters, checkpoints and the optimizer are a plain :class:`ShardedParamGroup`'s:
only what the forward and backward read changes. Reading the weights' values outside the unit's compute
(``GatheredParameters``, ``save_pretrained``, consolidation) gathers the 16-bit weights as before.

[Note: refilled in place] The linear's backward reads the float8 weight autograd saved in its forward; between the
two the unit is resharded. As the 16-bit buffer of a plain group, the float8 buffer and the scales are one tensor
each for the life of the group, emptied (storage resized to 0) on reshard and refilled in place by the backward's
regather, so the saved views read the same values again without keeping the memory in between.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hf_zero.zero import collectives as C
from hf_zero.zero.group import Placement
from hf_zero.zero.sharded_group import ShardedParamGroup, ShardState


def float8_module_of(param: torch.nn.Parameter) -> torch.nn.Module | None:
    """The float8 linear whose weight ``param`` is, when hf_zero.precision.float8 marked it for the float8 all-gather."""
    return getattr(param, "hf_zero_float8", None)


class _Float8WeightOf(torch.autograd.Function):
    """The gathered float8 weight standing in for the parameter: forward hands out the float8 tensor (the parameter's
    own storage is not read), backward passes the high-precision weight gradient to the parameter unchanged."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, mm_config: Any) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, weight.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


def _gathered_forward(self: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``Float8Linear.forward`` with the weight the group gathered as float8, when it did; else torchao's own."""
    held = self.__dict__.get("_hf_zero_float8_weight")
    if held is None:
        return type(self).forward(self, input)
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    data, scale = held
    if torch.is_autocast_enabled():  # as torchao's forward: the input in the autocast dtype
        input = input.to(torch.get_autocast_gpu_dtype())
    weight = _Float8WeightOf.apply(self.weight, data, scale, self.linear_mm_config)
    out = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config, self.config)
    if self.bias is not None:
        out = out + self.bias.to(out.dtype)
    return out


class Float8ShardedParamGroup(ShardedParamGroup):
    """A stage-3 group of float8-linear weights (tensorwise) that the unit's compute gathers as float8."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], place: Placement, *, trainable: bool) -> None:
        super().__init__(named_params, place, trainable=trainable)
        self.modules: list[torch.nn.Module] = []
        dtypes = set()
        for s in self.slots:
            m = float8_module_of(s.param)
            if m is None:
                raise ValueError(f"{s.name}: not the weight of a float8 linear marked for the float8 all-gather")
            self.modules.append(m)
            dtypes.add(m.config.cast_config_weight.target_dtype)
            m._hf_zero_float8_weight = None
            m.forward = _gathered_forward.__get__(m)  # an instance attribute: the class's forward stays torchao's
        (self.float8_dtype,) = dtypes
        self.round_pow2 = self.modules[0].config.round_scales_to_power_of_2
        # one buffer and one scale tensor for the group's life ([Note: refilled in place])
        self.full8 = torch.empty(self.padded_numel, dtype=self.float8_dtype, device=self.device)
        self._nbytes8 = self.full8.untyped_storage().nbytes()
        self.full8.untyped_storage().resize_(0)
        self.scales = torch.ones(len(self.slots), dtype=torch.float32, device=self.device)
        self.float8_out = False  # the float8 weights are gathered and handed to the modules
        self.float8_gathers = 0  # how many times the compute gathered float8 (tests and the benchmark read it)

    def float8_shard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard cast to float8 with scales over the whole weights (one all-reduce of the amaxes)."""
        from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

        src = self._gather_source()
        lo, hi = self.shard_lo, self.shard_hi
        amax = torch.zeros(len(self.slots), dtype=torch.float32, device=self.device)
        counts = []  # elements of this shard per slot (back to back, group.py's layout); then the padding, scale 0
        for i, s in enumerate(self.slots):
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            counts.append(max(0, b - a))
            if a < b:
                amax[i] = src[a - lo : b - lo].abs().max().float()
        if self.world_size > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        # elementwise, so one call for every weight and one cast for the whole shard give the per-weight bits
        scales = amax_to_scale(amax, self.float8_dtype, self.round_pow2)
        counts.append(self.shard_numel - sum(counts))
        per_element = torch.repeat_interleave(torch.cat([scales, scales.new_zeros(1)]),
                                              torch.tensor(counts, device=self.device), output_size=self.shard_numel)
        shard8 = to_fp8_saturated(src[: self.shard_numel].to(torch.float32) * per_element, self.float8_dtype)
        return shard8, scales

    def gather_for_compute(self, stream: torch.cuda.Stream | None) -> None:
        """The unit's forward or backward: gather the weights as float8 and hand them to their linears."""
        if self.state is not ShardState.SHARDED:
            return
        with C.on_stream(stream), torch.no_grad():
            shard8, scales = self.float8_shard()
            self.full8.untyped_storage().resize_(self._nbytes8)
            with torch.autograd._unsafe_preserve_version_counter(self.full8), \
                    torch.autograd._unsafe_preserve_version_counter(self.scales):
                C.all_gather_(self.full8.view(torch.uint8), shard8.view(torch.uint8), self.group, self.world_size)
                self.scales.copy_(scales)
            if stream is not None:
                self._event = torch.cuda.Event()
                self._event.record(stream)
        for i, (s, m) in enumerate(zip(self.slots, self.modules, strict=True)):
            m._hf_zero_float8_weight = (self.full8[s.offset : s.offset + s.numel].view(s.shape), self.scales[i])
        self.float8_out = True
        self.float8_gathers += 1
        self.state = ShardState.GATHERING

    def gather(self, stream: torch.cuda.Stream | None) -> None:
        """The 16-bit weights, for a reader of their values; with the float8 copy out, the 16-bit one is added."""
        if self.float8_out and self.state is not ShardState.SHARDED:
            self.wait()
            self._state = ShardState.SHARDED  # let the plain gather refill the 16-bit buffer; float8 stays out
            super().gather(stream)
            return
        super().gather(stream)

    def reshard(self, leave_views: bool = False) -> None:
        was = self.state
        super().reshard(leave_views)
        if was is not ShardState.SHARDED and self.float8_out:
            for m in self.modules:
                m._hf_zero_float8_weight = None
            self.full8.untyped_storage().resize_(0)
            self.float8_out = False

    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        held = super().held_tensors()
        held["params"].append(self.full8)
        return held
