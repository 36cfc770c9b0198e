"""What hf_zero refuses in a config it has parsed whole: features it cannot run yet and combinations DeepSpeed refuses.

The walk (:mod:`hf_zero.config.parse`) checks each key where it stands; these rules need several sections at once (bf16
masters and the stage, offload and its device, NVMe and the gather overlap, tensor parallelism and compile), so they
run on the parsed :class:`hf_zero.config.ZeroConfig`, once, before any model exists. Apart from the walk because a
feature that lands removes a rule here without touching how a key is read. Part of the parser for
tests/test_config_rules.py's check that every config field is read somewhere outside it.
"""

from __future__ import annotations

from typing import Any

from hf_zero.config.schema import ConfigError
from hf_zero.config.sections import ZeroOptimizationConfig


def refuse_missing_features(cfg: Any) -> list[str]:
    """Features the parser reads in full but hf_zero cannot run yet, and combinations DeepSpeed refuses: one
    sentence each, before any work. Returns the JSON paths to name in the "accepts but ignores" warning.

    ``cfg`` is the parsed ZeroConfig. Optimizer offload and stage 3's parameter offload to the CPU and to NVMe run
    (hf_zero/zero/offload.py, hf_zero/zero/nvme.py); their partial forms do not yet. (Sequence parallelism:
    ``cfg.sequence_parallel``, read by hf_zero/config/sequence.py.)
    """
    zo = cfg.zero_optimization
    opt = zo.offload_optimizer
    bf = cfg.bf16
    if bf.optimizer_states and not bf.master_weights_and_grads:
        raise ConfigError("bf16.bf16_optimizer_states: got true, but it needs bf16.bf16_master_weights_and_grads: true "
                          "(the optimizer state follows the masters); set both, or remove bf16_optimizer_states")
    if bf.master_weights_and_grads:
        if not bf.enabled and not {"bf16.enabled", "bfloat16.enabled"} & cfg.auto_keys:  # "auto": the Trainer decides
            raise ConfigError("bf16.bf16_master_weights_and_grads: got true while bf16.enabled is false; bf16 masters "
                              "need bf16 parameters, so enable bf16 or remove the key")
        if zo.stage == 0:
            raise ConfigError("bf16.bf16_master_weights_and_grads: bf16 masters need ZeRO stage 1, 2 or 3, and the stage "
                              "is 0; set zero_optimization.stage, or remove the key")
        if opt is not None and opt.device != "none":
            raise ConfigError("bf16.bf16_master_weights_and_grads: bf16 masters with offload_optimizer are not supported "
                              "yet; remove one of the two (offload keeps fp32 masters in host memory)")
        if not bf.optimizer_states:
            raise ConfigError("bf16.bf16_master_weights_and_grads: got true without bf16.bf16_optimizer_states, which asks "
                              "for fp32 optimizer state beside bf16 masters (DeepSpeed runs that only with its CPU Adam "
                              "under offload); set bf16_optimizer_states: true as well, or remove both")
    if opt is not None and opt.device in ("cpu", "nvme"):
        if zo.stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer: offload needs ZeRO stage 1, 2 or 3 (the offloaded state is "
                              "the rank's shard), and the stage is 0; set zero_optimization.stage, or remove offload_optimizer")
        # ratio < 1 (Twin-Flow, hf_zero/zero/offload.py device_group_count): the first groups stay and step on the
        # device. DeepSpeed runs it at stage 3 only; hf_zero at stages 1-3, but not with the step paths below
        if opt.ratio < 1.0 and opt.device == "nvme":
            raise ConfigError(f'zero_optimization.offload_optimizer.ratio: got {opt.ratio:g} with "device": "nvme", '
                              'which keeps every group\'s state in files; use "device": "cpu" for a partial offload, '
                              "or remove ratio")
        if opt.ratio < 1.0 and opt.super_offload:
            raise ConfigError(f"zero_optimization.offload_optimizer.ratio: got {opt.ratio:g} with super_offload, whose "
                              "speculative host step does not run beside groups stepped on the device yet; remove "
                              "ratio or super_offload")
        if opt.ratio < 1.0 and zo.overlap_param_gather and zo.stage < 3:
            raise ConfigError(f"zero_optimization.offload_optimizer.ratio: got {opt.ratio:g} with "
                              "zero_optimization.overlap_param_gather, whose deferred host step does not step groups "
                              "kept on the device; remove ratio or overlap_param_gather")
        if opt.super_offload and opt.device == "nvme":  # the speculative step needs the masters in host memory
            raise ConfigError('zero_optimization.offload_optimizer.super_offload: got true with "device": "nvme", but '
                              'the speculative host step keeps the masters in host memory; use "device": "cpu" or '
                              "remove super_offload")
    _refuse_zenflow_combinations(cfg)
    par = zo.offload_param
    nvme = [(key, sec) for key, sec in (("offload_optimizer", opt), ("offload_param", par))
            if sec is not None and sec.device == "nvme" and (key == "offload_optimizer" or zo.stage == 3)]
    for key, sec in nvme:
        where = f"zero_optimization.{key}"
        if not sec.nvme_path:
            raise ConfigError(f'{where}.nvme_path: "device": "nvme" needs a folder to keep the offloaded state in; set '
                              "nvme_path to a folder on a local NVMe disk (each run and rank gets a subfolder of it)")
        if sec.buffer_count < 1:
            raise ConfigError(f"{where}.buffer_count: got {sec.buffer_count}, but NVMe offload needs at least one buffer; "
                              "set it to 1 or more (DeepSpeed's default is 4 for the optimizer, 5 for the parameters)")
        if zo.overlap_param_gather:
            raise ConfigError(f'{where}.device: "nvme" with zero_optimization.overlap_param_gather is not supported yet; '
                              'remove overlap_param_gather, or offload to "cpu"')
    if par is not None and par.device == "nvme" and zo.stage == 3 and (opt is None or opt.device not in ("cpu", "nvme")):
        raise ConfigError('zero_optimization.offload_param.device: "nvme" without offload_optimizer is not supported yet; '
                          'add "offload_optimizer": {"device": "nvme"} (or "cpu"), or offload the parameters to "cpu"')
    tp = cfg.tensor_parallel_size
    if tp > 1:
        if cfg.compile.enabled:
            raise ConfigError(f"tensor_parallel.autotp_size: got {tp} with compile enabled, but compiled blocks cannot "
                              'hold the tensor-parallel all-reduces yet; set "compile": {"enabled": false} or autotp_size 1')
    ignored = []
    given_zero = cfg.raw.get("zero_optimization", {})
    if (isinstance(given_zero, dict) and "sub_group_size" in given_zero and (opt is None or opt.device == "none")
            and zo.sub_group_size != ZeroOptimizationConfig.sub_group_size):
        ignored.append("zero_optimization.sub_group_size (it sizes the offloaded host step; without offload_optimizer "
                       "the optimizer steps each group in one call)")
    if par is not None and par.device in ("cpu", "nvme") and zo.stage != 3:
        ignored.append("zero_optimization.offload_param (DeepSpeed reads it at stage 3 only)")
    if zo.stage == 3 and zo.overlap_param_gather and opt is not None and opt.device == "cpu" and opt.ratio < 1.0:
        ignored.append("zero_optimization.overlap_param_gather (at stage 3 it defers the offloaded host step of each "
                       "unit to its next gather, which does not run beside offload_optimizer.ratio below 1 yet)")
    zf = zo.zenflow
    given_zf = given_zero.get("zenflow") if isinstance(given_zero, dict) else None
    if zf is not None and isinstance(given_zf, dict):
        if "pt_reserved_cores_perc" in given_zf and not zf.overlap_step:
            ignored.append("zero_optimization.zenflow.pt_reserved_cores_perc (it splits the cores between training and "
                           "the host update running beside it, which only overlap_step does)")
        if given_zf.get("steps_per_epoch") is not None and zf.select_strategy == "step":
            ignored.append("zero_optimization.zenflow.steps_per_epoch (select_strategy \"step\" counts steps)")
    for key, _ in nvme:
        given = cfg.raw.get("zero_optimization", {}).get(key, {}) or {}
        if key == "offload_param" and "buffer_size" in given:
            ignored.append("zero_optimization.offload_param.buffer_size (each shard is read into a buffer of its size)")
        if key == "offload_optimizer" and given.get("fast_init"):
            ignored.append("zero_optimization.offload_optimizer.fast_init (the masters are written once, at build)")
    return ignored


def _refuse_zenflow_combinations(cfg: Any) -> None:
    """``zero_optimization.zenflow`` runs on the offloaded optimizer of stages 1-2 (``hf_zero/zero/zenflow.py``), as
    DeepSpeed 0.19.8's stage-1-2 ZenFlow optimizer does, with an Adam-family optimizer; everything else is refused here
    in one sentence, before any model exists."""
    zo = cfg.zero_optimization
    if zo.zenflow is None:
        return
    where = "zero_optimization.zenflow"
    opt = zo.offload_optimizer
    if zo.stage == 3:
        raise ConfigError(f"{where}: ZenFlow runs at ZeRO stages 1-2 (DeepSpeed 0.19.8's stage-3 ZenFlow is not built "
                          "here yet), and the stage is 3; set zero_optimization.stage to 2, or remove zenflow")
    if zo.stage == 0:
        raise ConfigError(f"{where}: ZenFlow steps the offloaded optimizer of ZeRO stages 1-2, and the stage is 0; set "
                          "zero_optimization.stage to 2, or remove zenflow")
    if opt is None or opt.device != "cpu":
        got = "no offload_optimizer" if opt is None or opt.device == "none" else f'offload_optimizer.device "{opt.device}"'
        raise ConfigError(f"{where}: ZenFlow steps the unimportant columns with the offloaded optimizer on the host, "
                          f'and the config has {got}; set "offload_optimizer": {{"device": "cpu"}}, or remove zenflow')
    for key, on, why in (
        ("offload_optimizer.super_offload", opt.super_offload, "the speculative host step of every step"),
        ("offload_optimizer.ratio", opt.ratio < 1.0, "optimizer state kept on the device"),
        ("overlap_param_gather", zo.overlap_param_gather, "the host step deferred into the next forward"),
    ):
        if on:
            raise ConfigError(f"{where}: ZenFlow takes its own host step every update_interval steps, which does not run "
                              f"beside zero_optimization.{key} ({why}); keep one of the two")
    if cfg.optimizer is not None and cfg.optimizer.type not in ("Adam", "AdamW"):
        raise ConfigError(f"{where}: ZenFlow steps the important columns with Adam, and optimizer.type is "
                          f"{cfg.optimizer.type!r}; use \"Adam\" or \"AdamW\", or remove zenflow")
    if cfg.optimizer is not None and cfg.optimizer.params.get("amsgrad"):
        raise ConfigError(f"{where}: ZenFlow's Adam steps without AMSGrad, and optimizer.params.amsgrad is true; remove "
                          "amsgrad or zenflow")
    if cfg.tensor_parallel_size > 1 or cfg.expert_parallel.active:
        what = "tensor_parallel.autotp_size" if cfg.tensor_parallel_size > 1 else "expert_parallel.autoep_size"
        raise ConfigError(f"{where}: ZenFlow with {what} above 1 is not supported yet (each slice would choose its own "
                          f"columns); remove one of the two")
