"""Optimizers named in a DeepSpeed config, with DeepSpeed's numbers (the LR schedules are ``hf_zero/optim/schedules.py``).

Behaviours a migrating user relies on without knowing it, reproduced here on purpose:

- ``"type": "Adam"`` means *decoupled* weight decay: DeepSpeed's ``adam_w_mode`` defaults to
  true, so it is AdamW. ``adam_w_mode: false`` gives classic Adam with L2 regularisation; type
  ``"AdamW"`` is AdamW whatever ``adam_w_mode`` says. Weight decay defaults to 0 (DeepSpeed's
  FusedAdam), except with ``torch_adam: true``, where DeepSpeed hands the params to
  ``torch.optim.AdamW`` and so inherits torch's default of 0.01.
- The Warmup* schedules set the lr when they are built (``warmup_min_lr``, or 0 for
  WarmupCosineLR), and each ``step()`` advances ``last_batch_iteration`` by one; DeepSpeed's
  engine calls it once after every optimizer step that was not skipped. The first two
  optimizer steps therefore both run at the warm-up floor, exactly as under DeepSpeed.

The schedules subclass torch's ``LRScheduler`` so that ``transformers`` and ``accelerate``
accept them, but keep DeepSpeed's step protocol, its arithmetic (operation for operation, so the
floats are identical) and its checkpoint format ``{"last_batch_iteration": n}``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hf_zero.config.schema import SUPPORTED_OPTIMIZERS
from hf_zero.errors import OptimizerConfigError, UsageError

__all__ = ["SUPPORTED_OPTIMIZERS", "FusedAdam", "OptimizerConfigError", "build_optimizer"]


# ------------------------------------------------------------------ checks (one sentence each)


def _canonical(path: str, given: Any, choices: Sequence[str]) -> str:
    """``given`` spelled as in ``choices``, matched case-insensitively (DeepSpeed lower-cases Adam/AdamW)."""
    if isinstance(given, str):
        for choice in choices:
            if choice.lower() == given.lower():
                return choice
    close = difflib.get_close_matches(str(given), list(choices), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise OptimizerConfigError(f"{path}: got {given!r}, expected one of {', '.join(choices)}{hint}")


def _as_dict(path: str, params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise OptimizerConfigError(f"{path}: got {params!r}, expected an object of named parameters")
    return dict(params)


def _check_keys(path: str, given: dict[str, Any], allowed: Iterable[str], owner: str) -> None:
    allowed = sorted(allowed)
    for key in given:
        if key in allowed:
            continue
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"expected one of {', '.join(allowed)}"
        raise OptimizerConfigError(f"{path}.{key}: unknown parameter for {owner}; {hint}")


def _number(path: str, value: Any, low: float = 0.0, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptimizerConfigError(f"{path}: got {value!r}, expected a number")
    if value < low or (high is not None and value > high):
        bound = f"between {low:g} and {high:g}" if high is not None else f">= {low:g}"
        raise OptimizerConfigError(f"{path}: got {value!r}, expected a number {bound}")
    return float(value)


def _integer(path: str, value: Any, low: int) -> int:
    """Integers only, as DeepSpeed's schedules insist (``isinstance(n, int)``); bools are not integers here."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        want = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise OptimizerConfigError(f"{path}: got {value!r}, expected {want}")
    return value


def _flag(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptimizerConfigError(f"{path}: got {value!r}, expected true or false")
    return value


# ------------------------------------------------------------------ optimizers

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad", "bias_correction",
              "set_grad_none")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def _betas(value: Any) -> tuple[float, float]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in value
    )
    if not ok:
        raise OptimizerConfigError(
            f"optimizer.params.betas: got {value!r}, expected a pair of floats in [0, 1) like [0.9, 0.999]"
        )
    return float(value[0]), float(value[1])


def _materialise(param_groups: Any) -> list[Any]:
    """A list of tensors or of group dicts whose ``params`` are lists, so they can be inspected then used."""
    if isinstance(param_groups, torch.Tensor):
        raise OptimizerConfigError("optimizer: got a single tensor as parameters, expected an iterable of tensors or of param-group dicts")
    groups = []
    for group in param_groups:
        if isinstance(group, dict):
            ps = group.get("params", [])
            group = dict(group, params=[ps] if isinstance(ps, torch.Tensor) else list(ps))
        groups.append(group)
    tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
    if not tensors:
        raise OptimizerConfigError("optimizer: got no parameters to optimize; pass the model's trainable parameters")
    return groups


def _adam_kernel(groups: list[Any]) -> dict[str, Any]:
    """``fused=True`` when every tensor is floating point on CUDA; else torch's default choice.

    Torch's default is already the foreach kernels for CUDA tensors and the per-tensor loop on
    CPU (where foreach would only emulate it). Either way the state keeps torch's keys
    (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints do not depend on the choice.
    """
    tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
    if all(isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point() for t in tensors):
        return {"fused": True}
    return {}


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none)``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise UsageError("FusedAdam(amsgrad=True): FusedAdam has no AMSGrad variant (DeepSpeed's neither); use torch.optim.Adam(amsgrad=True)")
        if not bias_correction:
            raise UsageError("FusedAdam(bias_correction=False) is not supported by hf_zero; leave it True")
        groups = _materialise(params)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, **_adam_kernel(groups))
        self.set_grad_none = set_grad_none
        self.hf_zero_fuse_on_device = True  # the engine turns the fused kernel on once the shards are on the GPU


def build_optimizer(
    opt_type: str, params: dict[str, Any] | None, param_groups: list[dict] | Iterable[torch.Tensor]
) -> torch.optim.Optimizer:
    """The torch optimizer that DeepSpeed's ``optimizer`` section (``type``, ``params``) describes.

    ``param_groups`` may hold plain tensors (the engine's flat fp32 masters, views of one buffer,
    ``requires_grad`` false): torch optimizers only need leaves with ``.grad`` set.
    """
    kind = _canonical("optimizer.type", opt_type, SUPPORTED_OPTIMIZERS)
    p = _as_dict("optimizer.params", params)
    if "max_grad_norm" in p:
        raise OptimizerConfigError(
            "optimizer.params.max_grad_norm: not an optimizer parameter; set the top-level \"gradient_clipping\" instead"
        )
    path = "optimizer.params"
    _check_keys(path, p, _SGD_KEYS if kind == "SGD" else _ADAM_KEYS, kind)
    groups = _materialise(param_groups)
    if kind == "SGD":
        # DeepSpeed hands SGD to torch.optim.SGD untouched, so torch's defaults apply (lr 1e-3).
        momentum = _number(f"{path}.momentum", p.get("momentum", 0.0))
        dampening = _number(f"{path}.dampening", p.get("dampening", 0.0))
        nesterov = _flag(f"{path}.nesterov", p.get("nesterov", False))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise OptimizerConfigError(
                f"{path}.nesterov: true needs momentum > 0 and dampening 0, got momentum {momentum:g} and dampening {dampening:g}"
            )
        return torch.optim.SGD(
            groups, lr=_number(f"{path}.lr", p.get("lr", 1e-3)), momentum=momentum, dampening=dampening,
            weight_decay=_number(f"{path}.weight_decay", p.get("weight_decay", 0.0)), nesterov=nesterov,
            maximize=_flag(f"{path}.maximize", p.get("maximize", False)),
        )

    torch_adam = _flag(f"{path}.torch_adam", p.get("torch_adam", False))
    # DeepSpeed: type AdamW forces decoupled decay; type Adam follows adam_w_mode (default true).
    decoupled = _flag(f"{path}.adam_w_mode", p.get("adam_w_mode", True)) or kind == "AdamW"
    default_wd = 0.01 if torch_adam and decoupled else 0.0
    if not _flag(f"{path}.bias_correction", p.get("bias_correction", True)):
        raise OptimizerConfigError(f"{path}.bias_correction: got false, which hf_zero does not support; remove it")
    _flag(f"{path}.set_grad_none", p.get("set_grad_none", True))  # accepted: the engine owns the gradients
    values = dict(lr=_number(f"{path}.lr", p.get("lr", 1e-3)), betas=_betas(p.get("betas", (0.9, 0.999))),
                  eps=_number(f"{path}.eps", p.get("eps", 1e-8)),
                  weight_decay=_number(f"{path}.weight_decay", p.get("weight_decay", default_wd)))
    amsgrad = _flag(f"{path}.amsgrad", p.get("amsgrad", False))
    if not torch_adam and not amsgrad:
        # DeepSpeed builds its FusedAdam unless torch_adam asks for torch's class, and scripts check
        # isinstance(optimizer, deepspeed.ops.adam.FusedAdam); the same arithmetic as torch's Adam/AdamW.
        return FusedAdam(groups, adam_w_mode=decoupled, **values)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(groups, amsgrad=amsgrad, **values, **_adam_kernel(groups))
    # Parameters built under zero.Init are on meta, where torch refuses fused=True; the engine
    # switches the fused kernel on once the groups point at the masters on the GPU.
    opt.hf_zero_fuse_on_device = True  # type: ignore[attr-defined]
    return opt
