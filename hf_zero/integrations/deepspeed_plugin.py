"""Accelerate's DeepSpeed settings as hf_zero's ZeRO config, and the answers Accelerate's DeepSpeed scripts read back.

Accelerate's launcher hands a ``distributed_type: DEEPSPEED`` YAML to the processes as variables
(``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, ``ACCELERATE_MIXED_PRECISION``,
``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, ...) plus ``ACCELERATE_USE_DEEPSPEED=true``, and its
``DeepSpeedPlugin`` reads them back into a DeepSpeed config: the ``deepspeed_config_file``, or one made from
the inline ``zero_stage`` / ``offload_*_device`` / ``zero3_save_16bit_model``. ``hf-zero launch
--config_file`` sets the same variables, except that ``ACCELERATE_USE_DEEPSPEED`` becomes
:data:`ENV_FLAG`: Accelerate's and transformers' own classes take the former as an order to import the
``deepspeed`` package. The plugin built here *is* Accelerate's class (it needs no ``deepspeed`` to be
built), so the config hf_zero's engine runs is the one Accelerate would have handed to DeepSpeed, and a
script reading ``accelerator.state.deepspeed_plugin.deepspeed_config`` sees what it sees under DeepSpeed.

Only :class:`hf_zero.Accelerator` answers ``state.deepspeed_plugin``: ``AcceleratorState()`` built
anywhere else keeps answering None, so transformers' Trainer and TRL never take their DeepSpeed branches
(which import ``deepspeed``). ``distributed_type`` stays the real one (``MULTI_GPU``, ``MULTI_CPU``):
Accelerate's own methods branch on it, and its DeepSpeed branches are the ones that need the package.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin

from hf_zero.errors import UsageError

ENV_FLAG = "HF_ZERO_USE_DEEPSPEED"  # hf-zero launch's ACCELERATE_USE_DEEPSPEED
_PLUGIN_KEY = "_hf_zero_deepspeed_plugin"  # where the plugin lives in Accelerate's shared state


def launched_with_deepspeed_yaml(environ: Any = None) -> bool:
    """``hf-zero launch --config_file`` started this process from a ``distributed_type: DEEPSPEED`` YAML."""
    return str((environ if environ is not None else os.environ).get(ENV_FLAG, "")).lower() == "true"


class ZeroDeepSpeedPlugin(DeepSpeedPlugin):
    """Accelerate's ``DeepSpeedPlugin``, whose config hf_zero's engine runs.

    Its fields and config are Accelerate's; what would reach for the ``deepspeed`` package says what
    hf_zero offers instead. ``zero3_init_flag`` reads False: hf_zero does not build transformers models
    sharded on its own (transformers' hook for that imports ``deepspeed``), each rank builds the whole
    model and ``prepare`` shards it; ``hf_zero.zero.Init()`` builds it sharded.
    """

    def set_deepspeed_weakref(self) -> None:
        raise UsageError(
            "zero3_init_context_manager(enable=True) / set_deepspeed_weakref() make transformers build models under "
            "DeepSpeed's zero.Init, which needs the deepspeed package; with hf_zero build the model inside "
            "`with hf_zero.zero.Init():` (import hf_zero) instead"
        )

    def set_moe_leaf_modules(self, model: Any) -> None:
        if self.transformer_moe_cls_names or os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"):
            raise UsageError(
                "deepspeed_moe_layer_cls_names (DeepSpeed's ZeRO-3 leaf modules) is not supported by hf_zero; remove it "
                "from the Accelerate config"
            )


def adopt(plugin: Any) -> ZeroDeepSpeedPlugin:
    """A user's ``DeepSpeedPlugin`` (``Accelerator(deepspeed_plugin=...)``) as hf_zero's; a dict of several is refused."""
    if isinstance(plugin, dict):
        if len(plugin) != 1:
            raise UsageError(
                f"Accelerator got {len(plugin)} DeepSpeed plugins ({', '.join(map(str, plugin))}); hf_zero's Accelerator "
                "runs one ZeRO config, so pass one DeepSpeedPlugin (a model that only runs forward is prepared with "
                "the same config)"
            )
        plugin = next(iter(plugin.values()))
    if not isinstance(plugin, DeepSpeedPlugin):
        raise UsageError(f"deepspeed_plugin must be an accelerate.utils.DeepSpeedPlugin, got {type(plugin).__name__}")
    if not isinstance(plugin, ZeroDeepSpeedPlugin):
        plugin.__class__ = ZeroDeepSpeedPlugin  # no new fields: only the two methods above differ
    return plugin


def plugin_from_environment() -> ZeroDeepSpeedPlugin:
    """The plugin Accelerate's ``DeepSpeedPlugin()`` builds from the launcher's variables (its errors are its own)."""
    return ZeroDeepSpeedPlugin()


def zero_config_of(plugin: ZeroDeepSpeedPlugin, mixed_precision: str) -> dict:
    """The plugin's DeepSpeed config once the run's precision is in it, as ``AcceleratorState`` puts it there.

    The plugin keeps the config object (Accelerate's scripts read and edit it in place); the copy
    returned is what hf_zero's parser checks and ``prepare`` resolves.
    """
    plugin.set_mixed_precision(mixed_precision)
    if plugin.zero3_init_flag:
        warnings.warn(
            "zero3_init_flag: hf_zero does not build transformers models sharded on its own (transformers' hook needs "
            "the deepspeed package): each rank builds the whole model and prepare() shards it; to build it sharded, "
            "create it inside `with hf_zero.zero.Init():`",
            stacklevel=3,
        )
        plugin.zero3_init_flag = False
    return copy.deepcopy(plugin.deepspeed_config)


class ZeroAcceleratorState(AcceleratorState):
    """``hf_zero.Accelerator``'s view of Accelerate's shared state: ``deepspeed_plugin`` answers the plugin
    its ZeRO config came from, and ``mixed_precision`` the precision that config trains in, as Accelerate's
    state answers under DeepSpeed. Every other attribute is the shared state itself."""

    @property
    def deepspeed_plugin(self) -> Any:
        plugin = self.__dict__.get(_PLUGIN_KEY)
        return plugin if plugin is not None else super().deepspeed_plugin

    @property
    def mixed_precision(self) -> str:
        plugin = self.__dict__.get(_PLUGIN_KEY)
        if plugin is None or self._mixed_precision == "fp8":
            return super().mixed_precision
        config = plugin.deepspeed_config
        for name in ("fp16", "bf16"):
            if str((config.get(name) or {}).get("enabled", False)).lower() == "true":
                return name
        return "no"

    def __repr__(self) -> str:
        text = super().__repr__()
        plugin = self.__dict__.get(_PLUGIN_KEY)
        return text + (f"hf_zero ZeRO config (from Accelerate's DeepSpeed plugin): {plugin.deepspeed_config}\n" if plugin else "")


def attach(state: AcceleratorState, plugin: ZeroDeepSpeedPlugin) -> ZeroAcceleratorState:
    """``state`` seen through :class:`ZeroAcceleratorState`, carrying ``plugin`` (only this view answers it)."""
    view = ZeroAcceleratorState()  # binds to the shared state, already initialised: nothing is rebuilt
    view.__dict__[_PLUGIN_KEY] = plugin
    return view
