"""Stage 3: parameters read outside the forward of the unit that holds them.

A unit's parameters are whole only between its forward pre-hook and post-hook (and again in its
backward), see :mod:`hf_zero.zero.stage3`. Code that reads them at any other moment finds storage of
zero bytes: a parent's ``F.linear(x, self.head.weight)`` (the head module never called), a method of
the root other than ``forward`` indexing a child's position table, a block that reads another block's
weight. Three things here deal with that:

- :class:`OutsideReads`, a ``TorchFunctionMode`` the engine runs its first training forward and its
  first no-grad forward under (:meth:`hf_zero.zero.stage3.Stage3Runtime.watch`). Every op's tensor
  arguments are looked at; a sharded parameter whose unit is not running is reported, and the runtime
  *pins* that unit: gathers it on the spot (every rank runs the same code, so the collective matches)
  and from then on treats it as it treats the root unit, whole from the root's pre-forward until its
  gradients are reduced. Only the first forwards are watched: a mode sees every op of the step, which
  costs milliseconds a step on a GPU (a 7B forward is about a thousand ops). A ``torch.compile``-d block
  runs unwatched (:func:`outside_reads_paused`, ``hf_zero/training/compile.py``): traced under the mode, dynamo
  would compile it twice; a weight of another unit read inside compiled code is therefore not found.
- :func:`register_external_parameter` and :func:`unregister_external_parameter`, DeepSpeed's names
  (``deepspeed.zero.register_external_parameter``), for what the first forwards cannot see: a code path
  that first runs later. DeepSpeed gathers such a parameter with the module that registered it; here
  its unit is pinned, which gives the same numbers and holds it a little longer.
- :func:`explain_unallocated`: a read that neither caught is refused by the parameter itself
  (:mod:`hf_zero.zero.released`: between gathers its class refuses value reads) or, for one that reaches
  PyTorch another way, ends in PyTorch's storage error (``setStorage: ... out of bounds for storage of size
  0``). The engine turns either into one sentence naming the parameter, the line of code and what to do.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "OutsideReads", "explain_unallocated", "outside_reads_paused", "register_external_parameter",
    "unregister_external_parameter",
]

# Reading these tells nothing about a tensor's values: a forward that asks a weight's shape (nanoGPT's
# LayerNorm passes ``self.weight.shape``) or dtype outside its unit has not read it.
_METADATA_METHODS = {
    "size", "dim", "numel", "stride", "element_size", "is_floating_point", "is_complex", "is_contiguous",
    "storage_offset", "nelement", "ndimension", "__len__", "__hash__", "get_device", "is_pinned",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "untyped_storage",
}
_METADATA_PROPERTIES = {
    "shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "is_cpu", "is_meta", "layout", "is_leaf",
    "grad_fn", "grad", "names", "is_sparse", "is_quantized", "itemsize", "nbytes", "_version", "is_nested",
}


def _is_metadata(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of Tensor: the descriptor says which
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
    return name in _METADATA_METHODS


def _parameters_in(obj: object, depth: int = 0) -> Iterator[torch.nn.Parameter]:
    if isinstance(obj, torch.nn.Parameter):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _parameters_in(o, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            yield from _parameters_in(o, depth + 1)


class OutsideReads(TorchFunctionMode):
    """Report every sharded parameter an op reads, before the op runs (see the module docstring).

    ``watched`` maps ``id(param)`` of every sharded parameter to whatever ``on_read`` needs; ``on_read``
    decides whether the read is outside its unit and makes the parameter whole before the op reads it.
    Inside ``__torch_function__`` the mode is off, so what ``on_read`` runs (a gather) is not seen again.
    """

    def __init__(self, watched: dict[int, object], on_read: Callable[[torch.nn.Parameter], None]) -> None:
        super().__init__()
        self.watched = watched
        self.on_read = on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self.watched and not _is_metadata(func):
            for p in _parameters_in(args):
                if id(p) in self.watched:
                    self.on_read(p)
            if kwargs:
                for p in _parameters_in(kwargs):
                    if id(p) in self.watched:
                        self.on_read(p)
        return func(*args, **kwargs)


def outside_reads_paused() -> contextlib.AbstractContextManager:
    """Run a block unwatched when :class:`OutsideReads` is the innermost mode (a ``torch.compile``-d block's code)."""
    if torch._C._len_torch_function_stack() and isinstance(torch.overrides._get_current_function_mode(), OutsideReads):
        return torch.overrides._pop_mode_temporarily()
    return contextlib.nullcontext()


# ------------------------------------------------------------------ DeepSpeed's external parameters


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's ``deepspeed.zero.register_external_parameter``: ``module``'s forward reads ``parameter``,
    which belongs to another module.

    Under ZeRO stage 3 the parameter's unit is then kept whole for the whole forward and backward, as
    the root's parameters are (DeepSpeed gathers it with ``module`` instead: the same numbers, held a
    little longer here). Needed only for a read that the engine's first forwards do not make, since those
    find outside reads by themselves (:class:`OutsideReads`); harmless otherwise, and a no-op at stages
    0-2 and for a parameter too small to shard. Call it before ``initialize`` (in the model's
    ``__init__``, as DeepSpeed's examples do) or at any time after, on every rank.
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(
            f"register_external_parameter got a {type(parameter).__name__}, not a torch.nn.Parameter; pass the "
            "parameter itself (e.g. self.layer1.weight)"
        )
    if not isinstance(module, torch.nn.Module):
        raise RuntimeError(
            f"register_external_parameter got a {type(module).__name__} as the module; pass the torch.nn.Module "
            "whose forward reads the parameter"
        )
    registered = module.__dict__.setdefault("_external_params", {})  # DeepSpeed's attribute
    registered[id(parameter)] = parameter
    pin = getattr(getattr(parameter, "hf_zero_group", None), "pin_for", None)
    if callable(pin):  # the parameter is already sharded by a stage-3 engine
        pin(module)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's ``unregister_external_parameter``: undo :func:`register_external_parameter`.

    The record goes; a unit already pinned stays pinned for the engine's life (a first forward may have
    found the same read on its own, and whole is always correct).
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(
            f"unregister_external_parameter got a {type(parameter).__name__}, not a torch.nn.Parameter; pass the "
            "parameter that was registered"
        )
    registered = getattr(module, "_external_params", None)
    if not isinstance(registered, dict) or id(parameter) not in registered:
        raise RuntimeError(
            f"unregister_external_parameter: this parameter (shape {tuple(parameter.shape)}) is not registered "
            f"as an external parameter of {type(module).__name__}; register_external_parameter(module, param) first"
        )
    del registered[id(parameter)]


def external_parameters(root: torch.nn.Module) -> Iterable[tuple[torch.nn.Module, torch.nn.Parameter]]:
    """Every ``(module, parameter)`` registered under ``root`` (DeepSpeed's ``_external_params``)."""
    for m in root.modules():
        registered = m.__dict__.get("_external_params")
        if isinstance(registered, dict):
            for p in registered.values():
                if isinstance(p, torch.nn.Parameter):
                    yield m, p


# ------------------------------------------------------------------ the error a late read ends in

_UNALLOCATED = ("out of bounds for storage of size 0", "data is not allocated yet")
_SIZES = re.compile(r"sizes \[([0-9, ]*)\]")


def explain_unallocated(
    error: BaseException, sharded: dict[int, tuple[str, str]], root: torch.nn.Module
) -> str | None:
    """One sentence for a PyTorch error raised by reading a sharded parameter outside its unit, else None.

    ``sharded`` maps ``id(param)`` of every sharded parameter to ``(parameter name, unit name)``. The
    parameter is named when it can be told: of those whose storage is empty now, the ones held by the
    module whose code raised (the innermost frame's ``self``; else any), narrowed by the names on the line
    of code and by the shape in PyTorch's message; the line of code is named always.
    """
    text = str(error)
    read = getattr(error, "param", None)  # hf_zero/zero/released.py's error knows the parameter it refused
    if read is None and (not isinstance(error, RuntimeError) or not any(s in text for s in _UNALLOCATED)):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if "/torch/" not in (path := f.filename.replace("\\", "/"))
            and not path.endswith("hf_zero/zero/released.py")]
    where = f"{user[-1].filename}:{user[-1].lineno} (`{(user[-1].line or '').strip()}`)" if user else "the model's forward"
    # the module whose code raised: the innermost frame with a `self` that is a module
    owner: torch.nn.Module | None = None
    tb = error.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, torch.nn.Module):
            owner = me
        tb = tb.tb_next
    shape = None
    m = _SIZES.search(text)
    if m:
        shape = tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)
    line = (user[-1].line or "") if user else ""
    candidates = []
    if read is not None and id(read) in sharded:
        candidates = [(sharded[id(read)], read, sharded[id(read)][0])]
    scopes = [] if candidates else [owner, root] if owner is not None and owner is not root else [root]
    for scope in scopes:
        for name, p in scope.named_parameters():
            info = sharded.get(id(p))
            if info is not None and p.untyped_storage().nbytes() == 0:
                candidates.append((info, p, name))
        if candidates:  # the module's own first; else another module's weight it was handed
            break
    # narrowed by what the line of code names (`self.aux.weight`), then by the shape PyTorch's message gives
    if len(candidates) > 1:
        candidates = [c for c in candidates if re.search(rf"\b{re.escape(c[2])}\b", line)] or candidates
    if shape is not None and len(candidates) > 1:
        narrowed = [c for c in candidates if tuple(c[1].shape) == shape or tuple(c[1].shape[::-1]) == shape
                    or c[1].numel() == _numel(shape)]
        candidates = narrowed or candidates
    what = "a parameter"
    if len(candidates) == 1:
        (pname, uname), _, _ = candidates[0]
        what = f"parameter '{pname}' (sharded with unit '{uname}')"
    elif candidates:
        what = "one of " + ", ".join(f"'{c[0][0]}'" for c in candidates[:3]) + (", ..." if len(candidates) > 3 else "")
    return (
        f"ZeRO stage 3: {where} read {what} outside the forward of the module that holds it, on a code path the "
        "engine's first forward did not take, so it was still sharded; call hf_zero.zero.register_external_parameter"
        "(module, param) for the module whose forward reads it (before initialize or before that forward), "
        "or call the module instead of reading its weight"
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
