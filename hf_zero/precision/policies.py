"""Precision policies and the fp16 dynamic loss scaler.

The scaler follows DeepSpeed's rules so a run moved from DeepSpeed sees the same scale
history: on overflow the step is skipped and, once ``hysteresis`` overflows have been
absorbed, the scale halves (never below ``min_loss_scale``); after ``loss_scale_window``
clean steps since the last overflow it doubles.

bf16 and fp32 have no scaler; there the engine checks the global gradient norm it computes
anyway, and a non-finite one (which a nan/inf loss always produces) skips the step or stops
the run, as the hf_zero config key ``"nonfinite_loss"`` says (:class:`NonFiniteLossError`).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_zero.config import FP16Config, ZeroConfig
from hf_zero.errors import LossScaleFloorError, NonFiniteLossError  # noqa: F401 - NonFiniteLossError: its old import path

#: Every dtype hf_zero stores or sends, with its safetensors name. The order is how a pipeline's
#: activation metadata numbers them on the wire, so entries are only ever appended.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def dtype_by_name(name: str) -> torch.dtype:
    """A dtype from ``str(dtype)`` (``"torch.bfloat16"``), its bare name or its safetensors name (``"BF16"``)."""
    for dt, st_name in SAFETENSORS_DTYPES.items():
        if name in (str(dt), str(dt).removeprefix("torch."), st_name):
            return dt
    raise ValueError(f"{name!r} names no dtype hf_zero stores; expected one of {', '.join(SAFETENSORS_DTYPES.values())}")


class LossScaler:
    """Static (``loss_scale > 0``) or dynamic (``loss_scale == 0``) fp16 loss scaling."""

    def __init__(self, cfg: FP16Config) -> None:
        self.dynamic = cfg.loss_scale == 0
        self.scale = float(2**cfg.initial_scale_power) if self.dynamic else float(cfg.loss_scale)
        self.window = cfg.loss_scale_window
        self.min_scale = float(cfg.min_loss_scale)
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.cur_hysteresis = cfg.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step; ``overflow`` says the step had inf/nan gradients."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale <= self.min_scale:
                    raise LossScaleFloorError(
                        f"fp16 gradients overflowed at step {self.cur_iter} with the loss scale already at "
                        f"fp16.min_loss_scale={self.min_scale:g}; the run cannot continue in fp16 — lower the "
                        "learning rate, check the data for inf/nan, or train in bf16."
                    )
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])


def loss_scaler_for(config: ZeroConfig) -> LossScaler | None:
    """The run's loss scaler: the fp16 section's; under fp16 ``torch_autocast`` at stage 0, torch's GradScaler rules.

    DeepSpeed scales the loss of an fp16 autocast run only without ZeRO (stage 0), with
    ``torch.amp.GradScaler`` (start at 2**16, halve on every overflow, double after 2000 clean
    steps); ZeRO stages run it unscaled. The same rules here, so a run moved over skips the same
    steps. bf16 and fp32 have no scaler.
    """
    if config.fp16.enabled:
        return LossScaler(config.fp16)
    ta = config.torch_autocast
    fp16 = ta.dtype == "fp16" or (ta.dtype is None and torch.cuda.is_available())  # None: torch's default, fp16 on CUDA
    if ta.enabled and fp16 and config.zero_optimization.stage == 0:
        return LossScaler(FP16Config(enabled=True, loss_scale=0.0, initial_scale_power=16, loss_scale_window=2000,
                                     hysteresis=1, min_loss_scale=2.0**-24))
    return None


def reduce_dtype(config: ZeroConfig) -> torch.dtype:
    """The dtype gradients are summed in across ranks.

    Mixed precision reduces in fp32 by default (as FSDP2's ``reduce_dtype=float32``): a sum of
    many bf16 gradients loses bits a ZeRO user would not expect to lose.
    ``communication_data_type`` overrides it, as in DeepSpeed.
    """
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if config.communication_data_type is not None:
        return names[config.communication_data_type]
    return torch.float32
