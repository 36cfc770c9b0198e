"""One script against DeepSpeed's API, run twice: by DeepSpeed 0.19.8 itself and with ``hf_zero`` as ``deepspeed``.

    python -m torch.distributed.run --nproc-per-node 2 tests/ds_oracle_semantics.py OUT_DIR

(``tests/dsenv.py:run_torchrun`` starts it with DeepSpeed's interpreter; CPU processes over gloo.) The
functions take the ``deepspeed`` module as an argument, so ``tests/test_ds_semantics.py`` runs the very
same code with ``hf_zero`` on two gloo ranks and compares:

- :func:`facts`: what a script can observe of DeepSpeed's semantics, as JSON: ``load_checkpoint`` on a
  folder with nothing saved, the optimizer ``initialize`` returns and the ``isinstance`` checks on it and
  the engine, ``zero.Init`` parameters around ``GatheredParameters`` and in a stage-3 engine
  (``numel()``, ``ds_shape``, ``ds_numel``, ``ds_status``), ``checkpoint.tag_validation``,
  ``get_accelerator().device_count()`` with ``LOCAL_SIZE``, ``RepeatingLoader``, ``utils.groups``, and
  ``destroy()``;
- :func:`accessors`: ``deepspeed.utils.safe_get_full_grad`` (after the boundary's backward),
  ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state`` (after the step), then
  ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` and the loss and weights they lead to,
  at ZeRO stages 0-3 (fp32) and 2-3 (bf16); tensors as safetensors, never pickles.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import torch

MICRO, GAS = 2, 2
ACCESSOR_CASES = [{"stage": s, "dtype": "fp32"} for s in (0, 1, 2, 3)] + [{"stage": s, "dtype": "bf16"} for s in (2, 3)]


class Net(torch.nn.Module):
    """An odd-sized bias (so ZeRO pads) and a frozen scale read in forward. The weights the script sets have an
    even number of elements: DeepSpeed's stage-3 setters cut the value without padding and fail on the last rank
    for an odd one (``set_full_hp_param`` narrows past its end)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.scale = torch.nn.Parameter(torch.full((3,), 1.5), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x))) * self.scale.to(x.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3, 5))  # 15 elements: padded to 16 on two ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


class Chain(torch.nn.Module):
    """Two elementwise scales, each one parameter (so DeepSpeed's per-parameter partitions and hf_zero's
    per-unit shards are cut alike), for ``ds_tensor`` writes and ``get_fp32_grad_partitions``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Scale(), Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class InitsChild(torch.nn.Module):
    """A parent whose ``self.apply`` re-initialises its child's weight, differently on each rank."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(12, 1)
        self.apply(self._init)

    def _init(self, module: torch.nn.Module) -> None:
        import torch.distributed as dist

        if isinstance(module, torch.nn.Linear):
            with torch.no_grad():
                module.weight.fill_(1 + dist.get_rank())


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(t: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    x, y = torch.randn(world * MICRO, 5, generator=g), torch.randn(world * MICRO, 3, generator=g)
    return x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]


def _config(stage: int, dtype: str = "fp32", **extra: Any) -> dict:
    # gradient_clipping given: DeepSpeed 0.19.8's default is 1.0, hf_zero's 0 (no clipping)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
                           "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter sharded
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def _mod(ds: Any, path: str) -> Any:
    return importlib.import_module(f"{ds.__name__}.{path}")


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)


def _step(engine: Any, t: int, rank: int, world: int) -> float:
    x, y = _batch(t, rank, world)
    # DeepSpeed feeds inputs as given: a bf16 model takes bf16 activations
    x = x.to(engine.device, torch.bfloat16 if engine.bfloat16_enabled() else torch.float32)
    loss = engine(x, y.to(engine.device))
    engine.backward(loss)
    engine.step()
    return float(loss.detach().float())


# --------------------------------------------------------------------------- facts


def facts(ds: Any, rank: int, world: int, root: str) -> dict:
    """What a DeepSpeed script observes; every value JSON, the same on DeepSpeed and on a faithful drop-in."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    here = os.path.join(root, f"facts_{ds.__name__}")
    os.makedirs(here, exist_ok=True)
    engine_cls = _mod(ds, "runtime.engine").DeepSpeedEngine
    zero_opt = _mod(ds, "runtime.base_optimizer").ZeROOptimizer
    stage3_opt = _mod(ds, "runtime.zero.stage3").DeepSpeedZeroOptimizer_Stage3
    status = _mod(ds, "runtime.zero.partition_parameters").ZeroParamStatus

    # initialize's optimizer: the client's own at stage 0 in fp32, the ZeRO wrapper otherwise
    for name, stage, dtype in (("z0", 0, "fp32"), ("z0_bf16", 0, "bf16"), ("z2", 2, "fp32"), ("z3", 3, "fp32")):
        model = _net()
        client = _adamw(model)
        engine, opt, _, _ = ds.initialize(model=model, optimizer=client, config=_config(stage, dtype))
        out[f"opt_{name}"] = {
            "is_client": opt is client, "is_engine_optimizer": opt is engine.optimizer,
            "is_adamw": isinstance(opt, torch.optim.AdamW), "wraps_client": getattr(opt, "optimizer", None) is client,
            "zero": isinstance(opt, zero_opt), "stage3": isinstance(opt, stage3_opt),
            "engine": isinstance(engine, engine_cls), "engine_is_module": isinstance(engine, torch.nn.Module),
        }
        if name == "z2":
            # load_checkpoint where nothing was saved: a warning and (None, None), nothing touched
            before = [p.detach().clone() for p in engine.module.parameters()]
            empty = os.path.join(here, "empty")
            os.makedirs(empty, exist_ok=True)
            got = [list(engine.load_checkpoint(empty)), list(engine.load_checkpoint(os.path.join(here, "absent")))]
            out["load_nothing"] = got
            out["load_nothing_untouched"] = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
            out["train_after_load_nothing"] = _step(engine, 0, rank, world) > 0
        engine.destroy()
        out[f"destroy_twice_{name}"] = engine.destroy() is None

    # zero.Init parameters: 0 elements outside a gather, the shape in ds_shape
    cfg3 = _config(3, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}})
    with ds.zero.Init(config_dict_or_path=cfg3):
        model = _net()
    w = model.fc1.weight
    out["init_outside"] = [w.numel(), list(w.ds_shape), w.ds_numel, w.ds_status.name, w.ds_status == status.NOT_AVAILABLE]
    with ds.zero.GatheredParameters([w], modifier_rank=0):
        out["init_gathered"] = [w.numel(), list(w.shape), w.ds_status.name]
        if rank == 0:
            with torch.no_grad():
                w.copy_(torch.arange(40, dtype=w.dtype).view(8, 5) / 10)
    out["init_after"] = [w.numel(), w.ds_status.name]
    with ds.zero.GatheredParameters([w]):
        out["init_edit_kept"] = float(w.detach().double().sum())
    out["init_after_again"] = w.numel()
    engine, opt, _, _ = ds.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg3)
    out["z3_attrs"] = [list(w.ds_shape), w.ds_numel, w.ds_status.name, isinstance(w.ds_id, int), w.ds_tensor.dim()]
    out["z3_train"] = _step(engine, 0, rank, world) > 0
    with ds.zero.GatheredParameters([w]):
        out["z3_gathered"] = [list(w.shape), w.ds_status.name]
    out["z3_after"] = w.ds_status.name
    engine.destroy()

    # a stage-3 bf16 engine: floating inputs go in as given (bf16 weight * fp32 input is fp32); a write to
    # ds_tensor.data is what the next forward gathers; get_fp32_grad_partitions is this rank's fp32 partition
    # of each parameter's averaged gradient; optimizer.step() steps and leaves every parameter partitioned
    chain = Chain()
    cfg3_bf16 = _config(3, "bf16", optimizer={"type": "Adam", "params": {"lr": 1.0, "torch_adam": True}},
                        gradient_accumulation_steps=1)
    engine, *_ = ds.initialize(model=chain, model_parameters=chain.parameters(), config=cfg3_bf16)
    for i, p in enumerate((chain.a.weight, chain.b.weight)):
        p.ds_tensor.data = torch.full_like(p.ds_tensor.data, (i + 1) * (1 + rank))
    out["z3_ds_tensor_numel"] = [chain.a.weight.ds_tensor.numel(), chain.b.weight.ds_tensor.numel()]
    y = engine(torch.ones(3, 5, device=engine.device))
    out["z3_forward"] = [str(y.dtype), y.detach().float().flatten().tolist()]
    engine.backward(y.sum())
    parts = engine.optimizer.get_fp32_grad_partitions()
    out["z3_grad_partitions"] = {str(g): [[str(t.dtype), t.float().tolist()] for _, t in sorted(per.items())]
                                 for g, per in parts.items()}
    engine.optimizer.step()
    out["z3_optimizer_step"] = [round(float(engine.optimizer._global_grad_norm), 3),
                                sorted({p.ds_status.name for p in chain.parameters()})]
    engine.destroy()

    # a trainable parameter in no optimizer group (an empty group beside the biases'): accepted, never stepped
    model = _net()
    groups = [{"params": [], "weight_decay": 0.01}, {"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0}]
    engine, *_ = ds.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=0.1), config=_config(3))
    with ds.zero.GatheredParameters(list(model.parameters())):
        before = [p.detach().clone() for p in (model.fc1.weight, model.fc1.bias)]
    for t in range(GAS):
        _step(engine, t, rank, world)
    with ds.zero.GatheredParameters(list(model.parameters())):
        out["ungrouped_trained"] = [not torch.equal(b, p) for b, p in zip(before, (model.fc1.weight, model.fc1.bias))]
    engine.destroy()

    # zero.Init: a parent's self.apply(fn) reaches its child's sliced weight, rank 0's values kept
    with ds.zero.Init(config_dict_or_path=cfg3):
        parent = InitsChild()
    out["init_parent_apply"] = [parent.linear.weight.ds_tensor.numel(), parent.linear.weight.ds_tensor.tolist()]

    # checkpoint.tag_validation: DeepSpeed's three values (any case); another refused at parse
    try:
        ds.initialize(model=_net(), optimizer=_adamw, config=_config(1, checkpoint={"tag_validation": "foo"}))
        out["tag_foo"] = "accepted"
    except ds.DeepSpeedConfigError:
        out["tag_foo"] = "DeepSpeedConfigError"
    for mode in ("fail", "Warn", "IGNORE"):
        model = _net()
        engine, *_ = ds.initialize(model=model, optimizer=_adamw(model), config=_config(1, checkpoint={"tag_validation": mode}))
        try:
            engine.save_checkpoint(os.path.join(here, f"tags_{mode}"), tag=f"tag-{rank}")
            out[f"tag_{mode}"] = "saved"
        except AssertionError:
            out[f"tag_{mode}"] = "AssertionError"
        engine.destroy()
        dist.barrier()

    # the accelerator, RepeatingLoader, groups
    acc = _mod(ds, "accelerator").get_accelerator()
    saved = os.environ.pop("LOCAL_SIZE", None)
    os.environ["LOCAL_SIZE"] = "5"
    out["device_count_local_size"] = acc.device_count()
    del os.environ["LOCAL_SIZE"]
    out["device_count"] = acc.device_count()
    if saved is not None:
        os.environ["LOCAL_SIZE"] = saved
    loader = ds.utils.RepeatingLoader([1, 2, 3])
    out["repeating"] = [next(loader) for _ in range(7)]
    out["repeating_iter_is_self"] = iter(loader) is loader
    groups = ds.utils.groups
    out["groups"] = [groups._get_data_parallel_world_size(), groups._get_data_parallel_rank() == rank,
                     dist.get_world_size(groups._get_data_parallel_group()), groups._get_sequence_parallel_world_size(),
                     groups._get_sequence_parallel_rank(), groups._get_model_parallel_world_size()]
    try:
        groups._get_sequence_parallel_group()
        out["sp_group"] = "returned"
    except KeyError:
        out["sp_group"] = "KeyError"
    return out


# --------------------------------------------------------------------------- accessors


def accessors(ds: Any, rank: int, world: int, case: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """The per-parameter accessors at one stage and dtype: ``(json, tensors)``, the tensors whole on every rank."""
    u = _mod(ds, "utils")
    model = _net()
    names = [n for n, p in model.named_parameters()]
    engine, _, _, _ = ds.initialize(model=model, optimizer=_adamw(model), config=_config(case["stage"], case["dtype"]))
    params = dict(engine.module.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {}

    def keep(key: str, t: Any) -> None:
        info[key] = None if t is None else list(t.shape)
        if t is not None:
            tensors[key] = t.detach().float().cpu().contiguous().clone()

    # (Outside backward-to-step DeepSpeed's stages 1-2 raise on the ranks holding a fragment of the parameter and
    # all-reduce on the others, a collective mismatch: only that window is compared.)
    for t in range(GAS):  # one optimizer step's micro-batches; the accessors read after the boundary's backward
        x, y = _batch(t, rank, world)
        loss = engine(x.to(engine.device, torch.bfloat16 if case["dtype"] == "bf16" else torch.float32), y.to(engine.device))
        engine.backward(loss)
        if t < GAS - 1:
            engine.step()
    for n in names:
        keep(f"grad.{n}", u.safe_get_full_grad(params[n]))
    engine.step()
    for n in names:
        keep(f"fp32.{n}", u.safe_get_full_fp32_param(params[n]))
        for key in ("exp_avg", "exp_avg_sq"):
            keep(f"{key}.{n}", u.safe_get_full_optimizer_state(params[n], key))
    # edits: a new weight (the model must compute with it) and a new first moment (the next step must use it)
    w = params["fc1.weight"]
    u.safe_set_full_fp32_param(w, torch.linspace(-1, 1, 40).view(8, 5).to(engine.device))
    u.safe_set_full_optimizer_state(params["fc2.weight"], torch.full((3, 8), 0.5, device=engine.device), "exp_avg")
    keep("after_set.fp32.fc1.weight", u.safe_get_full_fp32_param(w))
    keep("after_set.exp_avg.fc2.weight", u.safe_get_full_optimizer_state(params["fc2.weight"], "exp_avg"))
    # what a plain copy of the model with the weights as set computes on this rank's next micro-batch
    plain = _net()
    for n, p in plain.named_parameters():
        full = u.safe_get_full_fp32_param(params[n])
        if full is not None:
            p.data.copy_(full.float().cpu())
    x, y = _batch(GAS, rank, world)
    with torch.no_grad():
        info["plain_loss_after_set"] = float(plain(x, y))
    losses = [_step(engine, GAS + t, rank, world) for t in range(GAS)]
    info["loss_after_set"] = losses[0]
    for n in names:
        keep(f"next.fp32.{n}", u.safe_get_full_fp32_param(params[n]))
    engine.destroy()
    return info, tensors


# --------------------------------------------------------------------------- DeepSpeed's side


def main() -> None:
    import deepspeed
    import torch.distributed as dist
    from safetensors.torch import save_file

    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    result = {"facts": facts(deepspeed, rank, world, out_dir), "accessors": []}
    for i, case in enumerate(ACCESSOR_CASES):
        info, tensors = accessors(deepspeed, rank, world, case)
        result["accessors"].append(info)
        if rank == 0:
            save_file(tensors, os.path.join(out_dir, f"accessors_{i}.safetensors"))
    with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # leave without gloo's C++ teardown (tests/distributed.py says why)


if __name__ == "__main__":
    main()
