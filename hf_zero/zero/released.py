"""Stage 3: an op that reads a parameter between gathers raises one sentence instead of reading missing memory.

Between gathers a stage-3 engine's parameter keeps its shape but its storage holds zero bytes
(:mod:`hf_zero.zero.stage3`). PyTorch does not check that before every kernel: on the CPU an element-wise op
(``p.sum()``, ``p.norm()``, ``p.clone()``) reads through a null pointer and the process dies with SIGSEGV, other
ops raise PyTorch's storage error, and on a GPU a kernel would fault the device context. A user's logging loop
(``for p in model.parameters(): p.norm()``) or a ``print(model.lm_head.weight)`` ends the run that way.

So while its group is sharded, each parameter's class is swapped to :class:`ShardedParameter`, whose
``__torch_function__`` lets metadata through (shape, dtype, device, ``numel``, setting ``.data`` or ``.grad``), lets
a conversion that would be a no-op return the parameter (``model.to(its device)``), hands out views whose ops are
checked the same way (``.data``, ``detach()``: what ``state_dict()`` returns), and refuses every op that reads values
with a :class:`~hf_zero.errors.ReleasedParameterError` naming the parameter and what to use instead (``GatheredParameters``).
When the group is gathered the class is the parameter's own again, so forward and backward run with no Python in
the way: a class swap is one attribute write per parameter per gather and release, as ``ds_status`` is already.

Only plain ``nn.Parameter`` objects are swapped; a parameter of another subclass keeps its class (its own
``__torch_function__``, if any, must not be shadowed) and the unchecked behaviour. A read inside a forward on a
code path the first forwards took is gathered before it happens (:mod:`hf_zero.zero.external`), so it never
reaches this guard; one on a later path now gets this error instead of PyTorch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hf_zero.errors import ReleasedParameterError
from hf_zero.zero.external import _is_metadata

__all__ = ["ReleasedView", "ShardedParameter", "mark_released", "mark_whole"]

# Tensor methods that convert, and the (device, dtype) each one asks for; a call asking for what the tensor already
# is returns it unchanged without reading it (nn.Module._apply does that on every parameter for model.to(device)).
_CONVERSIONS: dict[str, Callable[..., tuple[torch.device | None, torch.dtype | None]]] = {
    "to": lambda *a, **k: torch._C._nn._parse_to(*a, **k)[:2],
    "cpu": lambda *a, **k: (torch.device("cpu"), None),
    "float": lambda *a, **k: (None, torch.float32),
    "half": lambda *a, **k: (None, torch.float16),
    "bfloat16": lambda *a, **k: (None, torch.bfloat16),
    "double": lambda *a, **k: (None, torch.float64),
}
# Ops that alias their argument whole without reading it (``state_dict()`` detaches): their result is checked like
# the parameter. A view of another shape cannot be made of empty storage (PyTorch checks its bounds): refused.
_ALIASING = {"detach"}
# Functions and methods that read no values: an address, metadata, or a new tensor of the same shape and dtype
_NO_VALUES = {"data_ptr", "_has_compatible_shallow_copy_type", "result_type", "is_same_size", "is_inference", "is_conj",
              "is_neg", "_is_view", "_is_zerotensor", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
              "randn_like", "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"}


def _released(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0 and t.numel() > 0


def _name(t: torch.Tensor) -> str:
    """The parameter's name in its stage-3 group, for the message (the group keeps its slots' names)."""
    group = t.__dict__.get("hf_zero_group")
    for s in getattr(group, "slots", ()):
        if s.param is t:
            return f"parameter '{s.name}'"
    base = t.__dict__.get("hf_zero_view_of")
    return f"a view of {base}" if base else "a stage-3 parameter"


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):
        return f"`.{getattr(getattr(func, '__self__', None), '__name__', '?')}`"
    return f"`{name}()`"


def _refuse(func: Callable, t: torch.Tensor) -> ReleasedParameterError:
    return ReleasedParameterError(
        f"ZeRO stage 3: {_op_name(func)} used {_name(t)} between gathers, when this rank holds only its shard and the "
        "whole parameter has no values; read it inside `with hf_zero.zero.GatheredParameters(params):` "
        "(deepspeed.zero.GatheredParameters), or take the whole weights with engine.save_16bit_model() or "
        "hf_zero.utils.safe_get_full_fp32_param(param)",
        t if isinstance(t, torch.nn.Parameter) else None,
    )


def _no_op(me: torch.Tensor, name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether conversion ``name`` asks for the device and dtype ``me`` already has (it then returns ``me``)."""
    try:
        device, dtype = _CONVERSIONS[name](*args[1:], **kwargs)
        device = None if device is None else torch.device(device)
    except (TypeError, RuntimeError, ValueError):  # arguments torch would refuse: let the op be refused as a read
        return False
    same_device = device is None or device == me.device or (device.type == me.device.type and device.index is None)
    return same_device and (dtype is None or dtype == me.dtype) and not kwargs.get("copy", False)


def _tensors(args: Iterable[Any], kwargs: dict[str, Any]) -> Iterable[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _guarded_call(func: Callable, args: tuple, kwargs: dict[str, Any] | None) -> Any:
    with torch._C.DisableTorchFunctionSubclass():  # the checks' own tensor calls (storage, numel) run unguarded
        return _checked_call(func, args, kwargs or {})


def _checked_call(func: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
    name = getattr(func, "__name__", "")

    def run() -> Any:
        return func(*args, **kwargs)

    if _is_metadata(func) or name == "__set__" or name in _NO_VALUES:
        return run()
    released = [t for t in _tensors(args, kwargs) if isinstance(t, (ShardedParameter, ReleasedView)) and _released(t)]
    if not released:  # gathered since (a view taken between gathers of a parameter whole again), or 0 elements
        return run()
    me = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if me is not None and name in _CONVERSIONS and all(t is me for t in released) and _no_op(me, name, args, kwargs):
        return me
    if name == "__get__" or name in _ALIASING:  # a property (.data, .T, .grad, ...) or a view: no values read yet
        try:
            out = run()
        except RuntimeError as e:  # a view of another shape (.T, .mT): PyTorch checks it against the empty storage
            raise _refuse(func, released[0]) from e
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor) and type(o) is torch.Tensor and _released(o):
                o.__class__ = ReleasedView
                o.__dict__["hf_zero_view_of"] = _name(released[0])
        return out
    raise _refuse(func, released[0])


class ShardedParameter(torch.nn.Parameter):
    """A stage-3 parameter between gathers: metadata reads pass, value reads raise (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Iterable[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        return _guarded_call(func, args, kwargs)


class ReleasedView(torch.Tensor):
    """A view of a stage-3 parameter taken between gathers (``.data``, ``detach()``, ``state_dict()``): checked
    at each op, so it reads the values once its parameter is gathered again, and raises while it is not."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Iterable[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        return _guarded_call(func, args, kwargs)


def mark_released(params: Iterable[torch.nn.Parameter]) -> None:
    """The group's storage was released: its plain parameters refuse value reads from now on."""
    for p in params:
        if type(p) is torch.nn.Parameter:
            p.__class__ = ShardedParameter


def mark_whole(params: Iterable[torch.nn.Parameter]) -> None:
    """The group is being gathered: its parameters are plain ``nn.Parameter`` again (nothing on the hot path)."""
    for p in params:
        if type(p) is ShardedParameter:
            p.__class__ = torch.nn.Parameter
