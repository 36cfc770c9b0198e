"""``zero.Init`` (DeepSpeed's name): build a model whose parameters exist only as per-rank slices.

Its ``from_pretrained`` is :mod:`hf_zero.zero.pretrained`'s; full parameters inside a block come
from :class:`hf_zero.zero.gathered.GatheredParameters` (re-exported here, DeepSpeed's path).
"""

from __future__ import annotations

import functools
import logging
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.distributed import dist as hz_dist
from hf_zero.zero import collectives as C
from hf_zero.zero import preshard
from hf_zero.zero.gathered import GatheredParameters, src_rank
from hf_zero.zero.preshard import is_presharded, preshard_, slice_of
from hf_zero.zero.pretrained import from_pretrained_sharded

logger = logging.getLogger("hf_zero")


# ----------------------------------------------------------------------------- zero.Init


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            out.append(s)
            todo.append(s)
    return out


class Init:
    """Build a model without any rank ever holding all of it (DeepSpeed's ``zero.Init``).

    Inside the context every module's parameters are cut into per-rank slices as soon as that
    module's ``__init__`` returns: the module's own initialisation runs on the real device, rank
    0's values are broadcast, each rank keeps its slice and the parameter's data becomes a
    ``meta`` tensor of the right shape. For a ``transformers`` model the library's weight
    initialisation (``_init_weights``, which it applies after construction) is then replayed one
    module at a time on gathered parameters, so a model built here starts from the same
    distribution as one built without it. ``from_pretrained`` of a safetensors checkpoint builds
    the model's skeleton on ``meta`` and has each rank read only its slices from the files.
    ``hf_zero.initialize`` turns the slices into ZeRO-3 shards one unit at a time.

    Outside the ``with`` block each such parameter is, as DeepSpeed's, a 0-element tensor whose whole
    shape is ``ds_shape`` (with DeepSpeed's other ``ds_*`` attributes); inside it, while modules are
    built, it keeps its shape on the ``meta`` device (``hf_zero/zero/preshard.py`` says why).

    A parent that re-initialises its children's weights after building them through ``self.apply(fn)``
    (the usual ``self.apply(self._init_weights)``) reaches them as DeepSpeed's ``zero.Init`` lets it: inside
    the block ``Module.apply`` gathers each module's own parameters before ``fn`` runs on it and keeps rank
    0's values after (``GatheredParameters(..., modifier_rank=0)``, module by module). Any other edit of a
    child's already-sliced weight must be made inside ``GatheredParameters(..., modifier_rank=0)``.
    """

    _active: Init | None = None

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        del mem_efficient_linear, pin_memory
        for key, value in kwargs.items():
            if key not in _DS_INIT_FLAGS:
                raise TypeError(f"zero.Init() got an unexpected keyword argument '{key}'")
            if value:
                raise ValueError(f"zero.Init({key}=...) is not supported by hf_zero; leave it unset")
        if remote_device not in (None, "none", "cpu") and torch.device(remote_device).type != hz_dist.get_device().type:
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}): hf_zero keeps the slices on the training device or, "
                'with remote_device="cpu", in host memory; NVMe is not supported'
            )
        if mpu is not None:
            raise ValueError("zero.Init(mpu=...): model parallelism is not supported by hf_zero; leave mpu unset")
        self.enabled = enabled
        self.group = data_parallel_group
        self.dtype = dtype if dtype is not None else self._dtype_from_config(config_dict_or_path or config)
        self._wrapped: list[tuple[type, Any]] = []
        self._building: set[int] = set()
        self._pretrained_depth = 0
        self.skeleton = False  # True while from_pretrained builds a skeleton whose values come from files
        self._owner = False
        self._saved_from_pretrained: Any = None
        self._device_ctx: torch.device | None = None
        self._pretrained_cls: type = torch.nn.Module
        self._saved_apply: Any = None
        self._saved_to_empty: Any = None
        if enabled:
            hz_dist.init_distributed()
            self.device = hz_dist.get_device()
            # remote_device="cpu" (DeepSpeed's, beside offload_param): each rank's slices wait in host memory, so a
            # model bigger than the GPUs can be built; the engine moves one unit at a time to the device
            self.slice_device = torch.device("cpu") if remote_device == "cpu" else self.device
            self.world_size = dist.get_world_size(self.group)
            if module is not None:  # DeepSpeed's zero.Init(module=model): shard an already-built model
                for m in module.modules():
                    self._shard_own_params(m)

    @staticmethod
    def _dtype_from_config(cfg: Any) -> torch.dtype | None:
        if cfg is None:
            return None
        from hf_zero.config import ZeroConfig

        zc = cfg if isinstance(cfg, ZeroConfig) else ZeroConfig.load(cfg)
        return None if zc.compute_dtype == torch.float32 else zc.compute_dtype

    # --------------------------------------------------------------- context

    def __enter__(self) -> Init:
        if not self.enabled or Init._active is not None:
            return self  # nested contexts: the outer one does the work
        # Imported before any class is wrapped: importing transformers builds modules at import time.
        from transformers import modeling_utils

        self._pretrained_cls = modeling_utils.PreTrainedModel
        Init._active = self
        self._owner = True
        preshard.building(True)  # slices keep their shape on meta while modules are built (hf_zero/zero/preshard.py)
        # Modules build their weights straight on the training device (as DeepSpeed's Init does).
        self._device_ctx = torch.device(self.device) if self.device.type == "cuda" else None
        if self._device_ctx is not None:
            self._device_ctx.__enter__()
        for cls in [torch.nn.Module, *_all_subclasses(torch.nn.Module)]:
            self._wrap_class(cls)
        ctx = self

        def init_subclass(cls: type, **kw: Any) -> None:
            ctx._wrap_class(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        self._saved_from_pretrained = modeling_utils.PreTrainedModel.__dict__["from_pretrained"]

        def from_pretrained(cls: type, *args: Any, **kw: Any) -> torch.nn.Module:
            return from_pretrained_sharded(cls, ctx, *args, **kw)

        modeling_utils.PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment]
        self._saved_apply, self._saved_to_empty = torch.nn.Module.apply, torch.nn.Module.to_empty
        torch.nn.Module.apply = _gathering_apply(self._saved_apply)  # type: ignore[method-assign]
        torch.nn.Module.to_empty = _slicing_to_empty(self._saved_to_empty)  # type: ignore[method-assign]
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self._owner:
            return
        from transformers import modeling_utils

        modeling_utils.PreTrainedModel.from_pretrained = self._saved_from_pretrained
        torch.nn.Module.apply = self._saved_apply  # type: ignore[method-assign]
        torch.nn.Module.to_empty = self._saved_to_empty  # type: ignore[method-assign]
        if "__init_subclass__" in torch.nn.Module.__dict__:
            del torch.nn.Module.__init_subclass__
        if self._device_ctx is not None:
            self._device_ctx.__exit__(exc_type, exc, tb)
            self._device_ctx = None
        for cls, orig in reversed(self._wrapped):
            cls.__init__ = orig
        self._wrapped.clear()
        Init._active = None
        self._owner = False
        preshard.building(False)
        preshard.show_empty_()  # outside the block a parameter is DeepSpeed's 0-element tensor, its shape in ds_shape

    def _wrap_class(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_hf_zero_orig", None) is not None:
            return

        @functools.wraps(orig)
        def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            ctx = Init._active
            if ctx is None or id(module) in ctx._building:
                orig(module, *args, **kwargs)
                return
            ctx._constructed(module, orig, args, kwargs)

        wrapped._hf_zero_orig = orig  # type: ignore[attr-defined]
        try:
            cls.__init__ = wrapped  # type: ignore[misc]
        except (TypeError, AttributeError):
            return  # a class whose attributes cannot be set (none in torch or transformers)
        self._wrapped.append((cls, orig))

    def _constructed(self, module: torch.nn.Module, orig: Any, args: tuple, kwargs: dict) -> None:
        pretrained = isinstance(module, self._pretrained_cls)
        self._building.add(id(module))
        self._pretrained_depth += int(pretrained)
        try:
            orig(module, *args, **kwargs)
        finally:
            self._building.discard(id(module))
            self._pretrained_depth -= int(pretrained)
        if self.skeleton:
            return
        self._shard_own_params(module)
        if pretrained and self._pretrained_depth == 0:
            self._replay_transformers_init(module)

    # --------------------------------------------------------------- sharding

    def _shard_own_params(self, module: torch.nn.Module) -> None:
        src = src_rank(self.group, 0)
        for p in module.parameters(recurse=False):
            if is_presharded(p) or p.device.type == "meta":
                continue
            with torch.no_grad():
                full = p.data.to(self.device, dtype=self.dtype or p.dtype if p.is_floating_point() else p.dtype)
                C.broadcast_(full, src, self.group, self.world_size)
                p.data = full
                preshard_(p, slice_of(full, self.group, self.slice_device), self.group)
            del full

    def _replay_transformers_init(self, model: torch.nn.Module) -> None:
        """transformers initialises weights after construction; redo it here one module at a time."""
        from transformers import PreTrainedModel

        rank = dist.get_rank(self.group)

        def visit(mod: torch.nn.Module, owner: PreTrainedModel) -> None:
            for child in mod.children():
                visit(child, child if isinstance(child, PreTrainedModel) else owner)
            params: dict[int, torch.nn.Parameter] = {id(p): p for p in mod.parameters(recurse=False)}
            for child in mod.children():  # _init_weights may reach into direct children
                if not isinstance(child, PreTrainedModel):
                    params.update({id(p): p for p in child.parameters(recurse=False)})
            todo = [p for p in params.values() if is_presharded(p)]
            if not todo:
                return
            with torch.no_grad(), GatheredParameters(todo, modifier_rank=0):
                if rank == 0:
                    owner._init_weights(mod)

        visit(model, model)  # type: ignore[arg-type]


def _gathering_apply(orig_apply: Any) -> Any:
    """``Module.apply`` inside ``zero.Init``: ``fn`` sees each module's own parameters whole, rank 0's result kept.

    As DeepSpeed's ``zero.Init`` wraps it (``_override_module_apply``). Every rank calls ``apply`` (the gathers are
    collectives), module by module in the order ``apply`` visits them. Inside a ``transformers`` model's own
    construction ``fn`` runs as given: its ``_init_weights`` is replayed on gathered parameters afterwards
    (``Init._replay_transformers_init``), so it is not gathered for twice.
    """

    @functools.wraps(orig_apply)
    def apply(module: torch.nn.Module, fn: Any) -> torch.nn.Module:
        ctx = Init._active
        if ctx is None or ctx._pretrained_depth > 0 or ctx.skeleton:
            return orig_apply(module, fn)

        def gathered_fn(m: torch.nn.Module) -> None:
            own = [p for p in m.parameters(recurse=False) if is_presharded(p)]
            if not own:
                fn(m)
                return
            with GatheredParameters(own, modifier_rank=0):
                fn(m)

        return orig_apply(module, gathered_fn)

    return apply


def _slicing_to_empty(orig_to_empty: Any) -> Any:
    """``Module.to_empty`` inside ``zero.Init``: the parameters it makes real are sliced at once.

    ``torch.nn.utils.skip_init`` builds a module on ``meta`` (which ``zero.Init`` leaves alone: nothing to slice)
    and then calls ``to_empty``; as under DeepSpeed's ``zero.Init``, the module then holds per-rank slices like any
    other (of rank 0's uninitialised values, which skip_init's caller is to overwrite, under
    ``GatheredParameters(..., modifier_rank=0)``).
    """

    @functools.wraps(orig_to_empty)
    def to_empty(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        out = orig_to_empty(module, *args, **kwargs)
        ctx = Init._active
        if ctx is not None and not ctx.skeleton:
            for m in module.modules():
                ctx._shard_own_params(m)
        return out

    return to_empty


_DS_INIT_FLAGS = (
    "zero_param_parallel_group",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "sequence_data_parallel_group",
    "param_swapper",
)
