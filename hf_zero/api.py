"""``initialize``: DeepSpeed's entry point, with its signature and its return value.

``engine, optimizer, dataloader, lr_scheduler = initialize(model=..., config=...)``. Argument
mistakes are caught here, before any process does work, with a sentence that names the
argument — every rank reaches the same verdict, so none is left waiting in a collective.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.config import ConfigError, ZeroConfig
from hf_zero.distributed import dist as hz_dist
from hf_zero.engine import ZeroEngine
from hf_zero.errors import InitializeArgumentError, UsageError
from hf_zero.expert.setup import setup as setup_expert_parallel
from hf_zero.optim.optimizers import build_optimizer
from hf_zero.optim.schedules import build_scheduler
from hf_zero.parallel import GridShape, grid_for, replicas_for
from hf_zero.parallel.tensor_parallel import setup as setup_tensor_parallel
from hf_zero.pipe.engine import PipelineEngine
from hf_zero.pipe.module import PipelineModule
from hf_zero.sequence.setup import setup_model as setup_sequence_parallel
from hf_zero.sequence.setup import wrap_loader as wrap_sequence_loader
from hf_zero.training.data import ResumableDistributedSampler

# The engine initialize built last: what DeepSpeed's module-level groups (deepspeed.utils.groups) describe.
_latest: list[weakref.ref | None] = [None]


def latest_engine() -> ZeroEngine | None:
    """The engine ``initialize`` returned last, while it lives and is not destroyed (None otherwise)."""
    ref = _latest[0]
    engine = ref() if ref is not None else None
    return None if engine is None or getattr(engine, "_destroyed", False) else engine


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags (``--deepspeed``, ``--deepspeed_config``) on the script's own parser.

    DeepSpeed's tutorials end their argument parsing with ``parser = deepspeed.add_config_arguments(parser)``
    and pass the parsed namespace as ``initialize(args=args)``, which reads the config path from
    ``args.deepspeed_config``. ``--deepscale`` and ``--deepscale_config`` are DeepSpeed's old
    names, kept for old scripts; ``--deepspeed_mpi`` is refused at ``initialize`` (no MPI here).
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by hf_zero)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: use --deepspeed_config")
    group.add_argument("--deepspeed_mpi", default=False, action="store_true", help="Not supported by hf_zero")
    return parser


def _config_from(args: argparse.Namespace | None, config: Any, config_params: Any) -> Any:
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if args is not None and from_args is None:
        from_args = getattr(args, "deepscale_config", None)
    if args is not None and getattr(args, "deepspeed_mpi", False):
        raise UsageError("--deepspeed_mpi: hf_zero starts its ranks with torchrun (hf-zero launch), not MPI; drop the flag")
    if config is not None and from_args is not None:
        raise UsageError(
            "initialize() got a config both in config= and in args.deepspeed_config; pass only one of them"
        )
    return config if config is not None else from_args


def _param_groups(model: torch.nn.Module, model_parameters: Any) -> list[dict] | list[torch.nn.Parameter]:
    if model_parameters is None:
        return [p for p in model.parameters() if p.requires_grad]
    if isinstance(model_parameters, torch.Tensor):
        raise UsageError("initialize(model_parameters=...) expects an iterable of parameters or of param-group dicts, got a single tensor")
    params = list(model_parameters)
    if params and isinstance(params[0], dict):
        return params
    if params and not all(isinstance(p, torch.Tensor) for p in params):
        bad = next(p for p in params if not isinstance(p, torch.Tensor))
        raise UsageError(f"initialize(model_parameters=...) holds a {type(bad).__name__}; pass model.parameters() or param-group dicts")
    return params


def _resolve_batch_sizes_on_every_rank(cfg: ZeroConfig, data_parallel_size: int) -> None:
    """Resolve the batch triple and check that every rank of the run got the same one (one sentence on every rank).

    Ranks started with different configs would otherwise train on different global batches, or
    hang in a collective; a rank whose config is refused makes the others refuse too. The batch
    multiplies by the grid's data-parallel degree, not the world size (sequence- and tensor-parallel
    ranks share their samples, a pipeline's stages pass them along).
    """
    error: ConfigError | None = None
    try:
        cfg.resolve_batch_sizes(data_parallel_size)
        mine = [1, cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps]
    except ConfigError as e:
        error, mine = e, [0, 0, 0, 0]
    every = hz_dist.gather_ints(mine, None)
    if error is not None:
        raise error
    refused = [r for r, v in enumerate(every) if not v[0]]
    if refused:
        raise ConfigError(f"the config's batch sizes were refused on rank {refused[0]} (its error says why); every rank must run the same config")
    if any(v != every[0] for v in every):
        r = next(r for r, v in enumerate(every) if v != every[0])
        show = lambda v: f"train_batch_size {v[1]}, train_micro_batch_size_per_gpu {v[2]}, gradient_accumulation_steps {v[3]}"  # noqa: E731
        raise ConfigError(f"batch sizes differ across ranks: rank 0 has {show(every[0])} but rank {r} has {show(every[r])}; every rank must run the same config")


def _make_dataloader(training_data: Any, collate_fn: Callable | None, cfg: ZeroConfig,
                     place: tuple[int, int]) -> torch.utils.data.DataLoader:
    """A loader that gives each data-parallel rank its own micro-batches, shuffled with the config seed.

    ``place`` is this rank's ``(dp_rank, dp_size)`` on the grid: under sequence parallelism the ranks
    of an sp group draw the same micro-batches (the caller wraps the loader so that each keeps its
    shard of the sequence), under tensor parallelism the ranks of a tp group do (they compute parts of
    one result), and a pipeline's stages of one replica do.
    """
    if not isinstance(training_data, torch.utils.data.Dataset) and not hasattr(training_data, "__getitem__"):
        raise UsageError(
            f"initialize(training_data=...) expects a torch Dataset (or anything with __len__ and __getitem__), got {type(training_data).__name__}"
        )
    sampler = ResumableDistributedSampler(
        training_data,
        num_replicas=place[1],
        rank=place[0],
        shuffle=True,
        seed=cfg.seed if cfg.seed is not None else 0,
    )
    # The loader draws its worker base seed from this generator, not from the global RNG, so
    # starting an epoch (or resuming in the middle of one) does not shift dropout's random stream.
    generator = torch.Generator().manual_seed(cfg.seed if cfg.seed is not None else 0)
    return torch.utils.data.DataLoader(
        training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn,
        generator=generator,
    )


def _optimizer(optimizer: Any, cfg: ZeroConfig, groups: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer: the one given, one a given callable builds, or the config's.

    Given both, the one passed to ``initialize`` is used and the config's is ignored, as DeepSpeed does (its
    ``_configure_optimizer`` never reads the config's section when a client optimizer is given); a warning
    says so, since the two may differ.
    """
    if optimizer is not None and cfg.optimizer is not None:
        warnings.warn(f"initialize() got an optimizer and the config names one too (optimizer.type "
                      f"{cfg.optimizer.type!r}): using the one given to initialize(), as DeepSpeed does; the config's "
                      "optimizer section is ignored", UserWarning, stacklevel=3)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if optimizer is not None:
        if not callable(optimizer):
            raise UsageError(
                f"initialize(optimizer=...) expects a torch.optim.Optimizer or a callable taking parameters, got {type(optimizer).__name__}"
            )
        built = optimizer(groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise UsageError(
                f"initialize(optimizer=callable) must return a torch.optim.Optimizer, it returned {type(built).__name__}"
            )
        return built
    if cfg.optimizer is not None:
        return build_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups)
    return None


def _scheduler(lr_scheduler: Any, cfg: ZeroConfig, torch_opt: torch.optim.Optimizer | None) -> Any:
    """The LR scheduler: the one given, one a given callable builds on the optimizer, or the config's (never two)."""
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise UsageError("initialize() got an lr_scheduler and the config names one too (scheduler.type); keep only one")
    if lr_scheduler is not None:
        if hasattr(lr_scheduler, "step") and not isinstance(lr_scheduler, type):
            return lr_scheduler
        if callable(lr_scheduler):
            if torch_opt is None:
                raise UsageError("initialize(lr_scheduler=callable) needs an optimizer to build the scheduler on")
            return lr_scheduler(torch_opt)
        raise UsageError(
            f"initialize(lr_scheduler=...) expects a scheduler or a callable taking the optimizer, got {type(lr_scheduler).__name__}"
        )
    if cfg.scheduler is not None:
        if torch_opt is None:
            raise ConfigError("scheduler: a scheduler needs an optimizer; add an optimizer section to the config")
        return build_scheduler(cfg.scheduler.type, cfg.scheduler.params, torch_opt)
    return None


def initialize(
    args: argparse.Namespace | None = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: str | dict | ZeroConfig | None = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[ZeroEngine, Any, torch.utils.data.DataLoader | None, Any]:
    """Wrap ``model`` in a ZeRO engine; returns ``(engine, optimizer, dataloader, lr_scheduler)``."""
    if mpu is not None or mesh_param is not None:
        raise UsageError("initialize(mpu=..., mesh_param=...) (model parallelism) is not supported; leave them unset")
    if isinstance(args, torch.nn.Module):  # DeepSpeed's first positional parameter is args, not the model
        raise InitializeArgumentError("initialize() got a torch.nn.Module as its first positional argument, which is "
                                      "args (the argparse namespace); pass the model as initialize(model=...)")
    if not isinstance(model, torch.nn.Module):
        raise InitializeArgumentError(f"initialize(model=...) expects a torch.nn.Module, got {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise UsageError(f"initialize(model=...) got a {type(model).__name__} with no parameters; there is nothing to train")
    cfg = ZeroConfig.load(_config_from(args, config, config_params))
    hz_dist.init_distributed(distributed_port=distributed_port)
    pipeline = isinstance(model, PipelineModule)
    # The one grid of the run. A PipelineModule cut its pp axis when it was built (its stage had to be known then);
    # the config cuts each stage's ranks further (tensor parallelism, hybrid sharding) and the module adopts that.
    # Hybrid sharding (mics_shard_size) is the dp_replicate axis; what it does not compose with is refused here.
    world = dist.get_world_size()
    pp = model.grid.size("pp") if pipeline else 1
    # sequence parallelism with a pipeline is refused (setup_sequence_parallel's sentence) before any grid is cut
    sp = setup_sequence_parallel(model, cfg, model.grid, True) if pipeline else None
    replicas = replicas_for(world, cfg.zero_optimization.mics_shard_size, zero_stage=cfg.zero_optimization.stage,
                            pp=pp, sp=cfg.sequence_parallel_size, tp=cfg.tensor_parallel_size)
    shape = GridShape.fill(world, pp=pp, sp=cfg.sequence_parallel_size, tp=cfg.tensor_parallel_size, dp_replicate=replicas)
    grid = grid_for(shape, hz_dist.get_device().type)
    if pipeline and grid is not model.grid:
        model.adopt_grid(grid)
    if not pipeline:
        sp = setup_sequence_parallel(model, cfg, grid, False)  # None unless sequence_parallel_size > 1
    setup_tensor_parallel(model, cfg, grid, hz_dist.get_device())  # splits the model when autotp_size > 1
    setup_expert_parallel(model, cfg, grid, hz_dist.get_device())  # splits the experts when autoep_size > 1
    _resolve_batch_sizes_on_every_rank(cfg, grid.dp_size)

    torch_opt = _optimizer(optimizer, cfg, _param_groups(model, model_parameters))
    if pipeline:
        engine = PipelineEngine(model, cfg, torch_opt)  # a ZeroEngine over the stage, on the module's grid
    else:
        engine = ZeroEngine(model, cfg, torch_opt, grid=grid)

    sched = _scheduler(lr_scheduler, cfg, torch_opt)
    engine.lr_scheduler = sched

    loader = _make_dataloader(training_data, collate_fn, cfg, (grid.dp_rank, grid.dp_size)) if training_data is not None else None
    loader = wrap_sequence_loader(loader, sp, model, engine.device) if loader is not None else None
    engine.training_dataloader = loader
    if loader is not None and engine.zero_optimizer is not None:
        # ZenFlow's "epoch" reselection counts optimizer steps of this loader, as DeepSpeed's counts its length
        with contextlib.suppress(TypeError):
            engine.zero_optimizer.set_epoch_length(max(1, len(loader) // cfg.gradient_accumulation_steps))
    _latest[0] = weakref.ref(engine)
    return engine, engine.optimizer, loader, sched
