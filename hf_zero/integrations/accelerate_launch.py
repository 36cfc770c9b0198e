"""``hf-zero launch --config_file X.yaml``: an Accelerate YAML of ``distributed_type: DEEPSPEED``, run on hf_zero.

``accelerate launch`` with such a YAML stops in its launcher unless the ``deepspeed`` package is
installed. hf-zero's launcher reads the same YAML (with Accelerate's own loader, so its key checks are
Accelerate's) and does what Accelerate's DeepSpeed launcher does on one node (``prepare_deepspeed_cmd_env``
in ``accelerate/utils/launch.py``): torchrun with ``num_processes / num_machines`` processes per
node, and the ``deepspeed_config`` block passed to the processes under Accelerate's variable names
(``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, ``ACCELERATE_MIXED_PRECISION``,
``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, ...), so that Accelerate's ``DeepSpeedPlugin`` rebuilds
exactly the config it would have given DeepSpeed. The one variable that differs is the switch:
``HF_ZERO_USE_DEEPSPEED`` instead of ``ACCELERATE_USE_DEEPSPEED``, which :class:`hf_zero.Accelerator`
reads (:mod:`hf_zero.integrations.deepspeed_plugin`) and Accelerate's own classes never see.

Accelerate's launch flags override the YAML as under ``accelerate launch`` (``--num_processes 2`` runs an
8-GPU YAML on two). Before any process starts, the config is built and checked here once, so a bad
``deepspeed_config_file`` is one sentence from the launcher rather than one traceback per rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import warnings
from collections.abc import Mapping
from typing import Any

from hf_zero.errors import LaunchError

# Accelerate's launch flags that override an Accelerate YAML, by the YAML key they set (None: top level).
_TOP_FLAGS = {
    "num_processes": int, "num_machines": int, "machine_rank": int, "main_process_ip": str, "main_process_port": int,
    "mixed_precision": str, "gpu_ids": str,
}
_DEEPSPEED_FLAGS = {
    "zero_stage": int, "gradient_accumulation_steps": int, "gradient_clipping": float, "offload_optimizer_device": str,
    "offload_param_device": str, "zero3_init_flag": str, "zero3_save_16bit_model": str, "deepspeed_config_file": str,
}
# deepspeed_config key -> the variable Accelerate's launcher sets for it (DeepSpeedPlugin reads them back)
_DEEPSPEED_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
}
_LOWERED = {"gradient_clipping", "offload_optimizer_device", "offload_param_device", "zero3_init_flag", "zero3_save_16bit_model"}
# what each other distributed_type is, and where it runs instead
_OTHER_TYPES = {
    "MULTI_GPU": "plain data parallelism without ZeRO, which needs no DeepSpeed: start it with `accelerate launch "
                 "--config_file {path}` as before (hf_zero.Accelerator and Trainer run under it with zero_config=...), "
                 "or write a distributed_type: DEEPSPEED YAML for hf-zero launch",
    "FSDP": "PyTorch FSDP, which hf-zero does not run and Accelerate runs without DeepSpeed: start it with `accelerate "
            "launch --config_file {path}`, or for ZeRO on hf_zero write a distributed_type: DEEPSPEED YAML "
            "(FULL_SHARD is zero_stage 3, SHARD_GRAD_OP is zero_stage 2)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config_file`` and the ``accelerate launch`` flags that override what it says."""
    group = parser.add_argument_group(
        "Accelerate YAML", "with --config_file, Accelerate's launch flags override the YAML as under accelerate launch")
    group.add_argument("--config_file", default=None, metavar="YAML",
                       help="an Accelerate config of distributed_type: DEEPSPEED (the YAML accelerate launch takes)")
    for name, kind in {**_TOP_FLAGS, **_DEEPSPEED_FLAGS}.items():
        group.add_argument(f"--{name}", type=kind, default=None, help=argparse.SUPPRESS)


def accelerate_flags_given(args: argparse.Namespace) -> list[str]:
    """The Accelerate launch flags set on the command line (they mean something only with --config_file)."""
    return [f"--{name}" for name in {**_TOP_FLAGS, **_DEEPSPEED_FLAGS} if getattr(args, name, None) is not None]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: str) -> Any:
    """The YAML through Accelerate's own loader (its defaults, its unknown-key check), errors as one sentence."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    try:
        config = load_config_from_file(path)
    except (OSError, ValueError, TypeError) as e:
        raise LaunchError(f"--config_file {path}: {' '.join(str(e).split())}".rstrip(".") + ".") from None
    if not isinstance(config, ClusterConfig):
        raise LaunchError(f"--config_file {path} is an Amazon SageMaker config, which hf-zero launch does not start.")
    return config


def _refuse_other_type(path: str, distributed_type: str) -> None:
    what = _OTHER_TYPES.get(distributed_type)
    if what is None:
        what = (f"not DeepSpeed, the one type hf-zero launch takes: start it with `accelerate launch --config_file {path}`, "
                "or write a distributed_type: DEEPSPEED YAML for hf-zero launch")
    raise LaunchError(f"--config_file {path} has distributed_type {distributed_type}, {what.format(path=path)}.")


def translate(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[argparse.Namespace, dict[str, str], str]:
    """The DeepSpeed-flag namespace ``plan_launch`` takes, the variables to add, and a notice, for ``args.config_file``.

    Pure apart from reading the YAML (and the ``deepspeed_config_file`` it names, to check it).
    """
    path = args.config_file
    given_ds = [flag for flag, set_ in (("--num_gpus", args.num_gpus is not None), ("--num_nodes", args.num_nodes is not None),
                                        ("--node_rank", args.node_rank is not None), ("--master_addr", args.master_addr),
                                        ("--master_port", args.master_port is not None), ("--include", args.include),
                                        ("--exclude", args.exclude)) if set_]
    if given_ds:
        raise LaunchError(
            f"{given_ds[0]} is DeepSpeed's launcher flag; with --config_file use Accelerate's names (--num_processes, "
            "--num_machines, --machine_rank, --main_process_ip, --main_process_port, --gpu_ids), as accelerate launch does."
        )
    config = _load(path)
    kind = getattr(config.distributed_type, "value", str(config.distributed_type))
    if kind != "DEEPSPEED":
        _refuse_other_type(path, kind)
    top = {name: getattr(config, name) for name in _TOP_FLAGS}
    top.update({name: getattr(args, name) for name in _TOP_FLAGS if getattr(args, name) is not None})
    yaml_ds = dict(config.deepspeed_config or {})
    ds = {**yaml_ds, **{name: getattr(args, name) for name in _DEEPSPEED_FLAGS if getattr(args, name) is not None}}

    processes, machines = top["num_processes"], top["num_machines"] or 1
    if processes is None or processes < 1:
        raise LaunchError(f"--config_file {path} sets no num_processes; pass --num_processes N.")
    if machines < 1 or processes % machines:
        raise LaunchError(f"num_processes {processes} is not a multiple of num_machines {machines}; each machine runs "
                          "num_processes / num_machines processes.")
    mixed = args.mixed_precision or config.mixed_precision or "no"
    if mixed not in ("no", "fp16", "bf16", "fp8"):  # fp8: torchao's float8 linears over bf16 (hf_zero/precision/float8.py)
        raise LaunchError(f"mixed_precision {mixed!r}: hf_zero trains in no (fp32), fp16, bf16 or fp8; choose one of them.")
    multinode = ds.get("deepspeed_multinode_launcher") or "pdsh"  # Accelerate's default when the key is absent
    if machines > 1 and multinode != "standard":
        raise LaunchError(
            f"deepspeed_multinode_launcher {multinode!r} starts every machine from one over "
            "ssh/MPI, which hf-zero launch --config_file does not do: set it to standard and run hf-zero launch "
            f"--config_file {path} --machine_rank R on each machine (or start them all with DeepSpeed's flags: "
            "hf-zero launch --hostfile H)."
        )
    if ds.get("deepspeed_moe_layer_cls_names"):
        raise LaunchError("deepspeed_moe_layer_cls_names (DeepSpeed's ZeRO-3 leaf modules) is not supported by hf_zero; "
                          "remove it from the YAML.")
    config_file = ds.get("deepspeed_config_file")
    if config_file and not os.path.isfile(config_file):
        raise LaunchError(
            f"deepspeed_config_file {config_file} does not exist; like accelerate launch, hf-zero launch reads it from "
            f"the directory you launch in ({os.getcwd()}), not from the YAML's."
        )

    env = {"HF_ZERO_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": mixed}
    fields = list(yaml_ds) + (["mixed_precision"] if not args.mixed_precision and config.mixed_precision is not None else [])
    env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(fields).lower()
    for key, name in _DEEPSPEED_ENV.items():
        if ds.get(key) is not None:
            env[name] = str(ds[key]).lower() if key in _LOWERED else str(ds[key])
    if config.use_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    if config.debug:
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if config.enable_cpu_affinity:
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    gpu_ids = top["gpu_ids"]
    if gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    cwd = os.path.abspath(".")  # as Accelerate's launcher puts it first on the processes' path
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([cwd, *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]))
    check_deepspeed_settings(path, {**environ, **env})

    port = top["main_process_port"]
    port = 29500 if port is None else (_free_port() if port == 0 else port)
    rdzv = config.rdzv_backend or "static"
    launch = argparse.Namespace(**{
        **vars(args), "num_gpus": processes // machines, "num_nodes": machines,
        "node_rank": top["machine_rank"] if machines > 1 else None, "master_addr": top["main_process_ip"],
        "master_port": port, "rdzv_backend": rdzv, "include": "", "exclude": "", "config_file": None,
        **dict.fromkeys({**_TOP_FLAGS, **_DEEPSPEED_FLAGS}),
    })
    unused = [key for key in ("fsdp_config", "megatron_lm_config", "fp8_config", "parallelism_config", "mpirun_config")
              if getattr(config, key, None)]
    if (config.dynamo_config or {}).get("dynamo_backend", "NO") not in ("NO", "no"):
        unused.append("dynamo_config")
    notice = (f"{path} (DEEPSPEED): {processes} process{'es' if processes > 1 else ''} on {machines} machine"
              f"{'s' if machines > 1 else ''}, the deepspeed_config block for hf_zero.Accelerator / hf_zero.Trainer "
              "(Accelerate's own Accelerator does not read it)")
    if unused:
        notice += f"; not acted on: {', '.join(unused)}"
    return launch, env, notice


def check_deepspeed_settings(path: str, environ: Mapping[str, str]) -> None:
    """Build the config every process will build (Accelerate's plugin, hf_zero's parser), so it fails here once."""
    from accelerate.utils import patch_environment

    from hf_zero.integrations import deepspeed_plugin as ds_plugin
    from hf_zero.integrations.autofill import load_zero_config

    added = {k: v for k, v in environ.items() if os.environ.get(k) != v}
    try:
        with patch_environment(**added), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_zero_config(ds_plugin.zero_config_of(ds_plugin.plugin_from_environment(), environ["ACCELERATE_MIXED_PRECISION"]))
    except (ValueError, OSError, TypeError, KeyError) as e:
        raise LaunchError(f"--config_file {path}: {' '.join(str(e).split())}".rstrip(".") + ".") from None
