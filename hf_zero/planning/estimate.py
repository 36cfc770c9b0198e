"""How many bytes a rank of *this* engine holds for parameters, gradients and optimizer state.

The numbers describe the moment of the optimizer step (backward has finished, nothing has been
freed yet), per data-parallel rank, for Ψ trainable parameters on N ranks. They follow the way
``hf_zero.zero`` lays memory out, not DeepSpeed's estimator:

- in fp32 the fp32 master weights *are* the parameters (a slice of the flat buffer), so there
  is no extra master copy;
- in bf16/fp16 every rank keeps 16-bit parameters (none at stage 3, where a unit's 16-bit
  weights are cast from the fp32 master shard when it is gathered), 16-bit gradients as
  backward writes them (freed after the reduce-scatter at stages 1-3), fp32 reduced
  gradients, and an fp32 master copy next to the optimizer state for the elements it owns;
- with gradient accumulation, stages 0 and 1 also hold the full gradients between the
  micro-steps of a step (stage 1 reduces them once, at the boundary); stages 2 and 3 reduce
  every micro-step and hold only the shard;
- a quantity "/N" is one shard: ``ceil(Ψ/N)`` elements, because each flat buffer is padded to a
  multiple of N. Buffers are per bucket, so padding adds at most N-1 elements per buffer, which
  the estimate leaves out.

With ``offload_optimizer`` (``device: cpu``, stages 1-3, :mod:`hf_zero.zero.offload`) the fp32
master, the optimizer state and an fp32 copy of the reduced gradient shard move to host memory;
the device keeps the compute-dtype parameters (at stage 3 the compute-dtype shard the gathers read)
and the fp32 reduced-gradient shard until its copy leaves: :func:`estimate_offload_memory`. Its
host figure is :func:`offload_host_bytes`, the function the engine checks against
``MemAvailable`` before it allocates (``check_host_memory`` in hf_zero/zero/offload.py).

Tests of the engine measure the bytes it really holds and compare them with
:func:`estimate_memory` (tests/test_memory.py) and :func:`estimate_offload_memory`
(tests/test_estimate_offload.py), so the formulas here are a contract: change both or neither.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

GIB = 1024**3

DTYPES = ("bf16", "fp16", "fp32")

# Optimizer-state bytes per trainable element, all in fp32: Adam keeps exp_avg and exp_avg_sq,
# SGD with momentum keeps one momentum buffer, plain SGD keeps nothing.
_OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4}

_PARAM_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the optimizer step, split the way ZeRO splits them.

    ``formula`` spells the three terms in Ψ and N, e.g.
    ``params 2Ψ + grads (2Ψ + 4Ψ/N) + optim (4+8)Ψ/N``, so a printed table can show where each
    number comes from.
    """

    stage: int
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    formula: str

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optim_bytes


def optimizer_state_bytes_per_element(optimizer: str) -> int:
    """Bytes of optimizer state per trainable element (``k`` in the formulas).

    Adam/AdamW: 8 (exp_avg and exp_avg_sq in fp32); SGD with momentum: 4; SGD: 0.
    """
    key = optimizer.strip().lower()
    if key not in _OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer: got {optimizer!r}, expected one of {', '.join(_OPTIMIZER_STATE_BYTES)}")
    return _OPTIMIZER_STATE_BYTES[key]


def _check_sizes(num_params: int, world_size: int, dtype: str) -> str:
    """Refuse a count, world size or dtype the formulas have no meaning for; the dtype's lower-case key."""
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params: got {num_params!r}, expected a non-negative integer")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: got {world_size!r}, expected an integer >= 1")
    dtype_key = dtype.strip().lower()
    if dtype_key not in DTYPES:
        raise ValueError(f"dtype: got {dtype!r}, expected one of {', '.join(DTYPES)}")
    return dtype_key


def estimate_memory(
    num_params: int, world_size: int, stage: int, dtype: str = "bf16", optimizer: str = "adam"
) -> MemoryEstimate:
    """Bytes per rank for parameters, gradients and optimizer state at the optimizer step.

    With Ψ = ``num_params``, N = ``world_size``, S = ceil(Ψ/N) (one padded shard) and
    k = :func:`optimizer_state_bytes_per_element`:

    ======  ==========  ================  ============
    fp32    params      grads             optim
    ======  ==========  ================  ============
    0       4Ψ          4Ψ                kΨ
    1       4Ψ          4Ψ                kS
    2       4Ψ          4S                kS
    3       4S          4S                kS
    ======  ==========  ================  ============

    ======  ==========  ================  ============
    16-bit  params      grads             optim
    ======  ==========  ================  ============
    0       2Ψ          2Ψ + 4Ψ           (4+k)Ψ
    1       2Ψ          2Ψ + 4S           (4+k)S
    2       2Ψ          4S                (4+k)S
    3       0           4S                (4+k)S
    ======  ==========  ================  ============

    Stage 3 in 16-bit holds no 16-bit parameters between steps: a unit's 16-bit weights are
    cast from the fp32 master shards when it is gathered and freed after use. In 16-bit training the gradient term is the 16-bit gradients backward writes plus the
    fp32 reduced gradients; the optimizer term includes the fp32 master weights.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: got {stage!r}, expected one of 0, 1, 2, 3")
    dtype_key = _check_sizes(num_params, world_size, dtype)
    k = optimizer_state_bytes_per_element(optimizer)
    full = num_params
    shard = math.ceil(num_params / world_size)

    def n_of(sharded: bool) -> tuple[int, str]:
        return (shard, "Ψ/N") if sharded else (full, "Ψ")

    if dtype_key == "fp32":
        p_elems, p_sym = n_of(stage >= 3)
        g_elems, g_sym = n_of(stage >= 1)
        o_elems, o_sym = n_of(stage >= 1)
        params, grads, optim = 4 * p_elems, 4 * g_elems, k * o_elems
        formula = f"params 4{p_sym} + grads 4{g_sym} + optim {k}{o_sym}"
    else:
        o_elems, o_sym = n_of(stage >= 1)
        # Stage 3 keeps no 16-bit copy between steps: units are cast from the fp32 masters when gathered.
        params, p_text = (0, "0") if stage >= 3 else (2 * full, "2Ψ")
        optim = (4 + k) * o_elems
        if stage == 0:
            grads, g_text = 2 * full + 4 * full, "(2Ψ + 4Ψ)"
        else:
            grads, g_text = 4 * shard, "4Ψ/N"
        formula = f"params {p_text} + grads {g_text} + optim (4+{k}){o_sym}"
    return MemoryEstimate(
        stage=stage, params_bytes=params, grads_bytes=grads, optim_bytes=optim, formula=formula
    )


def offload_host_bytes(shard_numel: int, state_bytes: int, *, optimizer: bool = True, param_bytes: int = 0,
                       frozen_numel: int = 0, copy_bytes: int = 0, speculate: bool = False) -> int:
    """Host bytes one rank pins for offload: with ``offload_optimizer``, per element of its trainable shard, the
    fp32 master (4), the fp32 copy of the reduced gradient the host optimizer reads (4), ``state_bytes`` of
    optimizer state and ``copy_bytes`` of the 16-bit copy of the stepped master that stages 1-2 send to the device
    (the one-pass kernel writes it: hf_zero/zero/offload.py ``OffloadedFlatGroup.host_shard``); with stage 3's
    ``offload_param``, ``param_bytes`` per element of the 16-bit shards kept there (the trainable ones only when the
    optimizer is offloaded too, else their masters stay on the device, and ``frozen_numel`` elements of frozen
    shards). ``speculate`` (``super_offload``): per trainable element a second master and optimizer state (the
    speculative step's destination or undo copy, hf_zero/zero/speculative_step.py) and a second 16-bit host shard.

    One function for two readers, so they cannot drift apart: the engine compares the sum over a
    machine's ranks with ``MemAvailable`` before it allocates anything (``check_host_memory`` in
    hf_zero/zero/offload.py), and ``hf-zero estimate`` prints it.
    """
    masters = shard_numel * (4 + 4 + state_bytes + copy_bytes) if optimizer else 0
    if optimizer and speculate:
        masters += shard_numel * (4 + state_bytes + param_bytes)
    return masters + ((shard_numel if optimizer else 0) + frozen_numel) * param_bytes


def async_save_host_bytes(num_params: int, world_size: int, stage: int, optimizer: str = "adam") -> int:
    """Host bytes one rank keeps for ``"checkpoint": {"async_save": true}``: its share of a resume checkpoint, copied
    there at each save (pinned on a GPU) and reused by the next (:mod:`hf_zero.checkpoint.background`).

    Per trainable element it stores, the fp32 master (4) and ``k`` bytes of optimizer state, of ceil(Ψ/N)
    elements at stages 1-3; at stage 0 every rank holds the same values and the first stores them all
    (this is its figure; the others keep nothing). Frozen parameters and buffers, stored once, come on top
    on the rank that stores them. The engine checks what it will allocate against ``MemAvailable`` (every
    machine's ranks added up) before the first background save.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: got {stage!r}, expected one of 0, 1, 2, 3")
    k = optimizer_state_bytes_per_element(optimizer)
    return (4 + k) * (num_params if stage == 0 else math.ceil(num_params / world_size))


@dataclass(frozen=True)
class OffloadEstimate:
    """Bytes one rank holds with ``offload_optimizer`` on the CPU: model states on the device and in host memory.

    ``device_formula`` and ``host_formula`` spell the terms in Ψ and N, as :class:`MemoryEstimate`'s
    ``formula`` does.
    """

    stage: int
    device_params_bytes: int
    device_grads_bytes: int
    host_bytes: int
    device_formula: str
    host_formula: str

    @property
    def device_bytes(self) -> int:
        return self.device_params_bytes + self.device_grads_bytes


def estimate_offload_memory(
    num_params: int, world_size: int, stage: int, dtype: str = "bf16", optimizer: str = "adam", params: bool = False,
) -> OffloadEstimate:
    """Bytes per rank with ``"offload_optimizer": {"device": "cpu"}`` at ZeRO stage 1, 2 or 3 (and, with
    ``params``, stage 3's ``"offload_param": {"device": "cpu"}`` as well).

    With Ψ, N, S = ceil(Ψ/N) and k as in :func:`estimate_memory`, and w the bytes of the compute
    dtype (2 in bf16/fp16, 4 in fp32):

    ======  ==============  ==============  =====================
    stage   device params   device grads    host (per rank)
    ======  ==============  ==============  =====================
    1, 2    wΨ              4S              (4 + 4 + k)S
    3       wS              4S              (4 + 4 + k)S
    ======  ==============  ==============  =====================

    Device: the compute-dtype parameters (at stage 3 the compute-dtype shard the all-gathers read,
    which offload keeps on the device where stage 3 without offload casts it from the fp32 master),
    and the fp32 reduced-gradient shard. That shard is wholly on the device while stages 2-3
    accumulate micro-steps; in the backward that ends a step each bucket's part is copied to the
    host and released as soon as it is reduced, so with one micro-step per step (and at stage 1,
    which reduces only then) fewer than 4S bytes of it are there at once. With gradient
    accumulation stage 1 also holds the full compute-dtype gradients (wΨ) between micro-steps, as
    it does without offload (see the module docstring). Host: :func:`offload_host_bytes` (master, gradient
    copy, optimizer state). Stage 3's gathered units, like every temporary buffer, are left out.
    With parameter offload (stage 3 only) the wS shard moves from the device column to the host one:
    the device then holds parameters only while their unit is gathered (left out, as above). Where
    the machine's host memory cannot hold these figures, the engine streams the gradients instead
    (``check_host_memory`` in hf_zero/zero/offload.py): host (4 + k)S plus two buffers of the
    largest shard group, and the device holds the whole 4S until the step.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage: got {stage!r}, expected 1, 2 or 3 (offload_optimizer needs a partitioned optimizer)")
    if params and stage != 3:
        raise ValueError(f"stage: got {stage!r}, but offload_param acts at stage 3 only")
    width = 4 if _check_sizes(num_params, world_size, dtype) == "fp32" else 2
    k = optimizer_state_bytes_per_element(optimizer)
    shard = math.ceil(num_params / world_size)
    on_device, p_text = (width * shard, f"{width}Ψ/N") if stage == 3 else (width * num_params, f"{width}Ψ")
    if params:
        on_device, p_text = 0, "0 (gathered units only)"
    return OffloadEstimate(
        stage=stage, device_params_bytes=on_device, device_grads_bytes=4 * shard,
        host_bytes=offload_host_bytes(shard, k, param_bytes=width if params else 0,
                                      copy_bytes=width if stage < 3 and width == 2 else 0),
        device_formula=f"params {p_text} + grads 4Ψ/N",
        host_formula=f"(4+4+{k}+{width})Ψ/N" if params or (stage < 3 and width == 2) else f"(4+4+{k})Ψ/N",
    )


def parse_param_count(text: str) -> int:
    """``"7B"`` -> 7_000_000_000; also ``1.1e9``, ``350M``, ``125k``, ``1_000``.

    Suffixes are decimal (K=1e3, M=1e6, B or G=1e9, T=1e12) because model sizes are quoted that way.
    """
    match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if match is None:
        raise ValueError(f"--params: got {text!r}, expected a number such as 1.1e9, 7B or 350M")
    value = float(match.group(1).replace("_", "")) * _PARAM_SUFFIXES[match.group(2).upper()]
    count = round(value)
    if count <= 0:
        raise ValueError(f"--params: got {text!r}, expected a positive number of parameters")
    return count


def _count_module(module: Any) -> int:
    """Trainable parameters of a module, each shared (tied) Parameter counted once.

    ``parameters()`` already yields a Parameter shared by two modules only once; identity is
    the only test that works on the meta device, where every tensor has data_ptr 0.
    """
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += int(p.__dict__.get("ds_numel", p.numel()))  # a zero.Init parameter is 0 elements outside a gather
    return total


def _load_config(path: str | os.PathLike) -> Any:
    """A transformers config from a model directory or a config.json file (no remote code)."""
    from transformers import AutoConfig

    path = os.fspath(path)
    if os.path.isfile(path):
        import json

        with open(path, encoding="utf-8") as f:
            config_dict = json.load(f)
        model_type = config_dict.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{path}: config.json has no 'model_type', so the model class cannot be chosen")
        return AutoConfig.for_model(model_type, **config_dict)
    if os.path.isdir(path) or (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) and not path.startswith(".")):
        return AutoConfig.from_pretrained(path)  # a directory, or a Hub id (fetches config.json only)
    raise FileNotFoundError(f"{path}: no such model directory or config.json")


def model_class_for(config: Any) -> type | None:
    """The transformers class ``config.architectures`` names (what was trained and saved), or None."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type):
            return cls
    return None


def _build_on_meta(config: Any) -> Any:
    """The model a config describes, with no storage: the class its ``architectures`` names, else a
    causal LM if there is one for the model type, else the base model."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    cls = model_class_for(config)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)


_PEFT_TASK_AUTO = {
    "CAUSAL_LM": "AutoModelForCausalLM", "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM", "SEQ_CLS": "AutoModelForSequenceClassification",
    "TOKEN_CLS": "AutoModelForTokenClassification", "QUESTION_ANS": "AutoModelForQuestionAnswering", "FEATURE_EXTRACTION": "AutoModel",
}


def _adapter_on_meta(path: str) -> Any:
    """A PEFT adapter folder's model on the meta device: its base (from ``base_model_name_or_path``) plus the adapter."""
    import torch

    from hf_zero.training import peft_model as hz_peft

    adapters = hz_peft.read_adapter_configs(path)
    base = next(iter(adapters.values())).base_model_name_or_path
    if not base:
        raise ValueError(f"{path}: adapter_config.json names no base_model_name_or_path, so the base model is unknown")
    config = _load_config(base)
    import transformers

    first = next(iter(adapters.values()))
    trained = (getattr(first, "auto_mapping", None) or {}).get("base_model_class")
    cls = getattr(transformers, str(trained), None) if trained else None
    if cls is None and first.task_type in _PEFT_TASK_AUTO:  # the head peft's task type puts on the base
        with torch.device("meta"):
            cls = type(getattr(transformers, _PEFT_TASK_AUTO[first.task_type]).from_config(config))
    if cls is None:
        cls = type(_build_on_meta(config))
    return hz_peft.build_twin(cls, config, adapters)


def build_model_on_meta(model_or_config: Any) -> Any:
    """The module whose parameters the estimate counts: a transformers config (or a folder, config.json or Hub
    id) built on the meta device as the class it names; a PEFT adapter folder as its base with the adapter."""
    from transformers import PretrainedConfig

    if isinstance(model_or_config, (str, os.PathLike)):
        path = os.fspath(model_or_config)
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "adapter_config.json")) \
                and not os.path.isfile(os.path.join(path, "config.json")):
            return _adapter_on_meta(path)
        model_or_config = _load_config(path)
    if not isinstance(model_or_config, PretrainedConfig):
        raise TypeError(
            f"count_model_parameters: got {type(model_or_config).__name__}, expected an nn.Module, "
            "a transformers PretrainedConfig, or a path to a model directory or config.json"
        )
    return _build_on_meta(model_or_config)


def count_model_parameters(model_or_config: Any) -> int:
    """Ψ: the trainable parameters of a module, a transformers config, or a path to one.

    A config (or a directory / config.json path) is turned into a model on the meta device, as
    the class its ``architectures`` names (so a classifier counts its head), so counting a 70B
    model allocates nothing. A PEFT adapter folder counts its adapter's parameters (the frozen
    base holds no gradients or optimizer state). Tied weights count once, because the engine
    stores a shared Parameter once.
    """
    import torch

    if isinstance(model_or_config, torch.nn.Module):
        return _count_module(model_or_config)
    return _count_module(build_model_on_meta(model_or_config))


def reference_model_bytes(num_params: int, world_size: int, stage: int, dtype: str = "bf16") -> int:
    """Bytes one rank holds of a frozen reference model (DPO's ``ref_model``, a teacher) of ``num_params``.

    It has no gradients or optimizer state: at stage 3 its weights are sharded like the policy's
    (the accelerator makes it an optimizer-free ZeRO-3 engine), so a rank holds ceil(Ψ/N) elements;
    at stages 0-2 every rank holds a whole copy, as Accelerate places it. 2 bytes per element in
    bf16/fp16, 4 in fp32.
    """
    width = 4 if dtype.strip().lower() == "fp32" else 2
    return width * (math.ceil(num_params / world_size) if stage >= 3 else num_params)


def format_table(
    num_params: int, num_gpus: int, num_nodes: int, dtype: str = "bf16", optimizer: str = "adam",
    ref_params: int | None = None,
) -> str:
    """The text ``hf-zero estimate`` prints: a header with the formula, one row per stage.

    ``ref_params``: the size of a frozen reference model trained beside this one (``--ref-model``),
    added as its own column and counted in the total.
    """
    world = num_gpus * num_nodes
    k = optimizer_state_bytes_per_element(optimizer)
    rows = [estimate_memory(num_params, world, s, dtype, optimizer) for s in range(4)]
    refs = [reference_model_bytes(ref_params, world, s, dtype) if ref_params is not None else 0 for s in range(4)]
    half = dtype.strip().lower() != "fp32"
    master = "plus a 4-byte fp32 master copy" if half else "the fp32 master is the parameters"
    lines = [
        f"Ψ = {num_params:,} trainable params, N = G*M = {num_gpus}*{num_nodes} = {world} data-parallel ranks, "
        f"dtype {dtype}, optimizer {optimizer}: k = {k} bytes of state per param, {master}.",
        "Per-rank bytes at the optimizer step; Ψ/N means ceil(Ψ/N) elements per shard "
        f"(ceil(Ψ/N) = {math.ceil(num_params / world):,}); padding adds at most N-1 elements per buffer.",
        "",
        f"{'stage':>5}  {'params GiB':>11}  {'grads GiB':>11}  {'optim GiB':>11}"
        + (f"  {'ref GiB':>11}" if ref_params is not None else "") + f"  {'total GiB':>11}  formula",
    ]
    for r, ref in zip(rows, refs):
        ref_col = f"  {ref / GIB:>11.2f}" if ref_params is not None else ""
        ref_formula = (" + ref " + ("2" if dtype.strip().lower() != "fp32" else "4") + ("Ψr/N" if r.stage >= 3 else "Ψr")
                       if ref_params is not None else "")
        lines.append(
            f"{r.stage:>5}  {r.params_bytes / GIB:>11.2f}  {r.grads_bytes / GIB:>11.2f}  "
            f"{r.optim_bytes / GIB:>11.2f}{ref_col}  {(r.total_bytes + ref) / GIB:>11.2f}  {r.formula}{ref_formula}"
        )
    if ref_params is not None:
        lines.append(f"Ψr = {ref_params:,} parameters of the frozen reference model: a whole copy per rank at stages 0-2, "
                     "sharded at stage 3.")
    lines += ["", *format_offload_rows(num_params, num_gpus, num_nodes, dtype, optimizer, ref_params=ref_params)]
    copy = [async_save_host_bytes(num_params, world, s, optimizer) / GIB for s in range(4)]
    lines += ["", 'With "checkpoint": {"async_save": true}: host GiB/rank kept for the copy of its checkpoint share (fp32 '
              f"master and optimizer state, (4+{k})Ψ/N; stage 0: rank 0 stores all, (4+{k})Ψ): "
              + ", ".join(f"stage {s} {g:.2f}" for s, g in enumerate(copy))
              + f"; host GiB/node at stage 1-3: {num_gpus * copy[1]:.2f}."]
    lines.append("Activations, temporary buffers and the CUDA context are not included.")
    return "\n".join(lines)


def format_offload_rows(
    num_params: int, num_gpus: int, num_nodes: int, dtype: str = "bf16", optimizer: str = "adam",
    ref_params: int | None = None,
) -> list[str]:
    """The offload part of ``hf-zero estimate``: device and host bytes per rank for ``offload_optimizer`` cpu at
    stages 1-3 and, at stage 3, with ``offload_param`` cpu too (row "cpu+param"), and the host bytes of a node
    (its ``num_gpus`` ranks, the sum the engine compares with ``MemAvailable``).

    ``ref_params``: a frozen reference model has no optimizer to offload, so its weights stay on the device
    (:func:`reference_model_bytes`) and are added to the device column.
    """
    world = num_gpus * num_nodes
    dtype_name = dtype.strip().lower()
    lines = [
        'With "offload_optimizer": {"device": "cpu"}: the fp32 master, the optimizer state and a copy of the reduced '
        f"gradient in host memory, the step on the CPU; the device keeps the {dtype_name} parameters (at stage 3 their shard) "
        "and the fp32 reduced-gradient shard until its copy leaves.",
        f"{'offload':<8} {'stage':>5}  {'device GiB':>11}  {'host GiB/rank':>13}  {'host GiB/node':>13}  "
        "device formula / host formula",
    ]
    for stage, params in ((1, False), (2, False), (3, False), (3, True)):
        r = estimate_offload_memory(num_params, world, stage, dtype, optimizer, params=params)
        ref, ref_text = 0, ""
        if ref_params is not None:
            ref = reference_model_bytes(ref_params, world, stage, dtype)
            ref_text = f" + ref {4 if dtype_name == 'fp32' else 2}" + ("Ψr/N" if stage >= 3 else "Ψr")
        lines.append(
            f"{'cpu+param' if params else 'cpu':<9} {stage:>4}  {(r.device_bytes + ref) / GIB:>11.2f}  "
            f"{r.host_bytes / GIB:>13.2f}  {num_gpus * r.host_bytes / GIB:>13.2f}  "
            f"{r.device_formula}{ref_text} / host {r.host_formula}"
        )
    lines.append(
        f"host GiB/node = {num_gpus} ranks x host GiB/rank: what the engine checks against MemAvailable before it allocates."
    )
    return lines
