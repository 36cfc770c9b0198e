"""Process groups, device and backend choice, and rank helpers.

One rule drives this file: the device and the backend come from the environment, so the
same training code runs on NCCL with one process per GPU and on gloo with CPU processes
(which is how the test suite exercises every distributed algorithm).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys

import torch
import torch.distributed as dist


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def local_rank() -> int:
    """The process's rank on its node, as torchrun (and DeepSpeed's launcher) export it."""
    return _env_int("LOCAL_RANK", 0)


def get_device() -> torch.device:
    """The device this process trains on: its local GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend() -> str:
    """NCCL when GPUs are present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise ``torch.distributed`` once, as ``deepspeed.init_distributed`` does.

    Under torchrun (or ``hf-zero launch``) the rendezvous variables are in the environment.
    A plain ``python train.py`` has none of them; it then becomes a world of one, created
    over an in-memory store so that no port is opened. Calling this twice is harmless.
    ``auto_mpi_discovery``, ``distributed_port``, ``verbose`` and ``config`` are accepted
    for signature compatibility with DeepSpeed.
    """
    del auto_mpi_discovery, distributed_port, verbose, config, dist_init_required
    if dist.is_initialized():
        return
    backend = dist_backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(get_device())
    kwargs: dict = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # A process group still alive at interpreter exit can abort the process ("terminate called
    # without an active exception") once gloo's worker threads are torn down in arbitrary order;
    # tutorial scripts never destroy it, so the group hf_zero created is destroyed at exit.
    atexit.register(_destroy_at_exit)
    _watch_uncaught_exceptions()
    if init_method is not None or launched:
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank if rank >= 0 else _env_int("RANK", 0),
            world_size=world_size if world_size >= 0 else _env_int("WORLD_SIZE", 1),
            **kwargs,
        )
        return
    if world_size not in (-1, 1):
        raise RuntimeError(
            f"init_distributed: world_size={world_size} was asked for but no launcher variables "
            "(RANK, WORLD_SIZE, MASTER_ADDR) are set; start the script with `hf-zero launch` or torchrun."
        )
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


_failed = False


def _watch_uncaught_exceptions() -> None:
    """Remember whether the script dies of an exception, so the exit barrier is skipped then."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        global _failed
        _failed = True
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _destroy_at_exit() -> None:
    """Leave together on a clean exit: wait (bounded) for every rank, then destroy the group."""
    if dist.is_initialized():
        try:
            if not _failed and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            dist.destroy_process_group()
        except Exception:  # the interpreter is exiting; never turn a clean exit into a failure
            pass


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0
