"""``import deepspeed`` resolving to hf_zero, so that DeepSpeed's own unit tests run against it.

Only ``python -m tests.conformance.run`` uses this package: it puts ``tests/conformance/alias`` first on the
hf_zero side's ``PYTHONPATH``. ``import hf_zero as deepspeed`` is enough for a script, but DeepSpeed's test
files import by module path (``from deepspeed.runtime.zero.stage3 import ...``), which only a package named
``deepspeed`` answers. Every name under ``deepspeed.`` is one of three kinds, and nothing else:

1. **hf_zero's own**: ``deepspeed.X`` is ``hf_zero.X`` (``deepspeed.comm``, ``deepspeed.zero``,
   ``deepspeed.pipe``, ``deepspeed.utils``, ...), and a name missing there raises AttributeError as hf_zero
   does; :data:`PUBLIC_ELSEWHERE` maps a name DeepSpeed defines at another path (``DeepSpeedEngine`` in
   ``deepspeed.runtime.engine``) to where hf_zero has it, when it has it.
2. **Facts** (:data:`FACTS`): what DeepSpeed's tests read to decide whether to skip (the torch build, which
   compiled ops exist) or DeepSpeed's config vocabulary (``ADAM_OPTIMIZER == "adam"``), computed here from
   this environment and hf_zero; never training behaviour.
3. **Stubs**: names the vendored files import at module level that hf_zero does not have, so that the
   module still collects and each test is judged on what it uses: DeepSpeed internals (:data:`STUBS`) and
   DeepSpeed's public names hf_zero lacks so far (:data:`MISSING_PUBLIC`; a name hf_zero has is always
   hf_zero's). Calling a stub, instantiating it or reading an attribute of it raises :class:`InternalName`
   or :class:`MissingPublicName`, naming it; ``isinstance(x, Stub)`` answers False (no hf_zero object is
   one) and is written to ``$HF_ZERO_ALIAS_LOG`` with every other use, so the harness can say which
   passing tests took that branch. Any other ``deepspeed.`` module path raises ModuleNotFoundError naming it.
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

import torch

import hf_zero


class InternalName(NotImplementedError):  # noqa: N818 - the name a reader of a failure sees
    """A DeepSpeed-internal name the conformance alias stubs was used by a test."""


class MissingPublicName(NotImplementedError):  # noqa: N818
    """A public DeepSpeed name hf_zero does not have (yet) was used by a test."""


def _log(line: str) -> None:
    path = os.environ.get("HF_ZERO_ALIAS_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _refuse(qualname: str, how: str) -> NotImplementedError:
    _log(f"used {qualname}")
    if qualname.removeprefix("deepspeed.") in _MISSING_QUALNAMES:
        return MissingPublicName(f"{qualname} (DeepSpeed public API) is not in hf_zero; this test {how}")
    return InternalName(
        f"{qualname} is DeepSpeed-internal; the hf_zero conformance alias (tests/conformance/alias) stubs it, and "
        f"this test {how}"
    )


class _StubMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        _log(f"isinstance {cls._ds_name}")
        return False

    def __subclasscheck__(cls, sub: type) -> bool:
        _log(f"issubclass {cls._ds_name}")
        return False

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(cls._ds_name, "calls it")

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _refuse(cls._ds_name, f"reads .{name} of it")


def _operator(op: str) -> Any:
    def use(cls: Any, *args: Any) -> Any:
        raise _refuse(cls._ds_name, f"uses it as a value ({op})")
    return use


for _op in ("__int__", "__index__", "__float__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
            "__truediv__", "__floordiv__", "__lt__", "__le__", "__gt__", "__ge__", "__getitem__", "__iter__",
            "__len__", "__enter__", "__exit__"):
    setattr(_StubMeta, _op, _operator(_op))


def _stub(qualname: str) -> type:
    return _StubMeta(qualname.rsplit(".", 1)[1], (), {"_ds_name": qualname, "__module__": qualname.rsplit(".", 1)[0]})


# ---------------------------------------------------------------------------------------------- facts


def _torch_info() -> dict[str, str]:
    """DeepSpeed's ``git_version_info.torch_info``: the torch, CUDA and NCCL versions of this build."""
    nccl = "0.0"
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()[:2]))
        except (AttributeError, RuntimeError):
            pass
    return {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
            "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
            "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]), "nccl_version": nccl,
            "hip_version": "0.0"}


def _required_torch_version(min_version: float | None = None, max_version: float | None = None) -> bool:
    """DeepSpeed's ``utils.torch.required_torch_version``: is torch's major.minor within the bounds."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    have = float(f"{major}.{minor}")
    return (min_version is None or have >= min_version) and (max_version is None or have <= max_version)


class _OpBuilder:
    """DeepSpeed's op builders as the tests use them: a NAME and whether the op exists here (in hf_zero)."""

    NAME = ""
    HAVE = False

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.HAVE

    def load(self, verbose: bool = True) -> Any:
        raise _refuse(f"deepspeed.ops.op_builder.{type(self).__name__}.load", "loads a compiled op")


def _builder(name: str, op: str, have: bool) -> type:
    return type(name, (_OpBuilder,), {"NAME": op, "HAVE": have})


# hf_zero has FusedAdam (torch's Adam, fused) and DeepSpeedCPUAdam (hf_zero/ops); none of DeepSpeed's other ops
_OPS = {"fused_adam": True, "cpu_adam": True, "fused_lamb": False, "async_io": False, "cpu_adagrad": False,
        "cpu_lion": False}


class OffloadDeviceEnum(str, enum.Enum):
    """DeepSpeed's ``runtime.zero.offload_config.OffloadDeviceEnum``: the strings ``offload_*.device`` takes."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# module path (below deepspeed.) -> {name: value}
FACTS: dict[str, dict[str, Any]] = {
    "git_version_info": {"torch_info": _torch_info(), "version": hf_zero.__version__},
    "utils.torch": {"required_torch_version": _required_torch_version},
    "accelerator": {"is_current_accelerator_supported": lambda: True},  # hf_zero runs on its CPU and CUDA
    "ops": {"__compatible_ops__": dict(_OPS)},
    "ops.op_builder": {"FusedAdamBuilder": _builder("FusedAdamBuilder", "fused_adam", True),
                       "CPUAdamBuilder": _builder("CPUAdamBuilder", "cpu_adam", True),
                       "FusedLambBuilder": _builder("FusedLambBuilder", "fused_lamb", False)},
    "ops.aio": {"AsyncIOBuilder": _builder("AsyncIOBuilder", "async_io", False)},
    "runtime.config": {"ADAM_OPTIMIZER": "adam"},
    "runtime.zero.offload_config": {"OffloadDeviceEnum": OffloadDeviceEnum},
    # DeepSpeed's swap_tensor constant (MIN_AIO_BYTES, 1024**2); the tensor-fragment tests size their model by it
    "runtime.swap_tensor": {"MIN_SWAPPABLE_BYTES": 1024**2},
}

# DeepSpeed names hf_zero has at another path: DeepSpeed's module path + name -> hf_zero's candidates (first found)
PUBLIC_ELSEWHERE: dict[str, tuple[str, ...]] = {
    "runtime.engine.DeepSpeedEngine": ("hf_zero.DeepSpeedEngine",),
    "runtime.zero.partition_parameters.ZeroParamStatus": ("hf_zero.zero.ZeroParamStatus",
                                                          "hf_zero.zero.param_attrs.ZeroParamStatus"),
    "runtime.zero.ZeroParamStatus": ("hf_zero.zero.ZeroParamStatus", "hf_zero.zero.param_attrs.ZeroParamStatus"),
}

# DeepSpeed internals imported at module level by the vendored files (module path -> names)
STUBS: dict[str, tuple[str, ...]] = {
    "runtime.zero.stage3": ("DeepSpeedZeroOptimizer_Stage3",),
    "runtime.zero.stage_1_and_2": ("DeepSpeedZeroOptimizer",),
    "runtime.zero.partition_parameters": ("MultipleAllGatherHandles",),
    "runtime.zero.config": ("DeepSpeedZeroConfig",),
    "runtime.zero.utils": ("ZeRORuntimeException",),
    "runtime.fp16": (),
    "runtime.fp16.unfused_optimizer": ("FP16_UnfusedOptimizer",),
    "runtime.bf16_optimizer": ("BF16_Optimizer",),
    "runtime.engine": (),
    "runtime.precision_config": ("get_bfloat16_config",),
    "checkpoint.utils": ("clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank"),
    "moe.layer": ("MoE",),
}


# DeepSpeed public names the vendored files import at module level; stubbed only while hf_zero lacks them
MISSING_PUBLIC: dict[str, tuple[str, ...]] = {
    "utils": ("RepeatingLoader", "groups", "safe_get_full_fp32_param", "safe_get_full_grad",
              "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
              "safe_set_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
              "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
              "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized"),
    "utils.zero_to_fp32": ("load_state_dict_from_zero_checkpoint", "get_fp32_state_dict_from_zero_checkpoint",
                           "convert_zero_checkpoint_to_fp32_state_dict"),
    "runtime.lr_schedules": ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                             "LR_RANGE_TEST", "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE",
                             "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE", "WARMUP_LR", "WARMUP_MIN_LR",
                             "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_LOG_RATE",
                             "WARMUP_LINEAR_RATE", "ONE_CYCLE", "CYCLE_MIN_LR", "CYCLE_MAX_LR",
                             "CYCLE_FIRST_STEP_SIZE", "DECAY_LR_RATE", "DECAY_STEP_SIZE", "CYCLE_MIN_MOM",
                             "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_DECAY_LR", "TOTAL_NUM_STEPS",
                             "WARMUP_COSINE_LR", "WARMUP_MIN_RATIO", "COS_MIN_RATIO"),
    "ops.adam": ("FusedAdam",),
    "pipe": ("PipelineModule", "LayerSpec"),
}
_MISSING_QUALNAMES = {f"{m}.{n}" for m, names in MISSING_PUBLIC.items() for n in names} | {
    "runtime.engine.DeepSpeedEngine", "runtime.zero.partition_parameters.ZeroParamStatus",
    "runtime.zero.ZeroParamStatus"}


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


class _AliasModule(types.ModuleType):
    """``deepspeed.<path>``: hf_zero's module of that path (if any), then the facts and stubs for it."""

    def __init__(self, path: str, target: types.ModuleType | None) -> None:
        super().__init__(f"deepspeed.{path}")
        self._path = path
        self._target = target
        # hf_zero's own names always win: facts and stubs only fill what hf_zero's module lacks
        def lacks(name: str) -> bool:
            return target is None or not hasattr(target, name)

        self.__dict__.update({k: v for k, v in FACTS.get(path, {}).items() if lacks(k)})
        for name in (*STUBS.get(path, ()), *MISSING_PUBLIC.get(path, ())):
            if lacks(name):
                self.__dict__[name] = _stub(f"deepspeed.{path}.{name}")
        for key, candidates in PUBLIC_ELSEWHERE.items():
            if key.rpartition(".")[0] == path:
                name = key.rpartition(".")[2]
                if lacks(name):
                    found = next((v for v in map(_resolve, candidates) if v is not None), None)
                    self.__dict__[name] = found if found is not None else _stub(f"deepspeed.{key}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if self._target is not None and hasattr(self._target, name):
            value = getattr(self._target, name)
            if isinstance(value, types.ModuleType) and value.__name__.startswith("hf_zero."):
                return importlib.import_module("deepspeed." + value.__name__[len("hf_zero."):])
            return value
        sub = f"{self._path}.{name}"
        if sub in STUBS or sub in FACTS or sub in MISSING_PUBLIC or _hf_zero_module(sub) is not None:
            return importlib.import_module(f"deepspeed.{sub}")
        raise AttributeError(f"module 'deepspeed.{self._path}' (hf_zero.{self._path} under the conformance alias) "
                             f"has no attribute {name!r}")


def _hf_zero_module(path: str) -> types.ModuleType | None:
    try:
        if importlib.util.find_spec(f"hf_zero.{path}") is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module(f"hf_zero.{path}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("deepspeed."):
            return None
        sub = fullname[len("deepspeed."):]
        if _hf_zero_module(sub) is None and sub not in STUBS and sub not in FACTS and sub not in MISSING_PUBLIC:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: hf_zero has no hf_zero.{sub}, and the conformance alias neither maps "
                "nor stubs it", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        sub = spec.name[len("deepspeed."):]
        module = _AliasModule(sub, _hf_zero_module(sub))
        module.__path__ = []  # a package, so that deeper paths resolve through this finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(name: str) -> Any:
    """``deepspeed.X`` is ``hf_zero.X``; a submodule comes back as its alias module."""
    value = getattr(hf_zero, name)
    if isinstance(value, types.ModuleType) and value.__name__.startswith("hf_zero."):
        return importlib.import_module("deepspeed." + value.__name__[len("hf_zero."):])
    return value
