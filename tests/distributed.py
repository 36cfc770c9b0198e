"""Run a function on N CPU processes over gloo, rendezvous through a FileStore.

Each test spawns one group of processes and runs a whole grid of cases inside it, because
starting Python + torch costs seconds on the two-core CI machine. Results come back as
JSON written by rank 0 (and by other ranks when asked), never through pickle.

The ranks start from a fork server that has imported torch and transformers once (:data:`PRELOAD`): a fresh
interpreter per rank spent 3 s of CPU importing torch alone, 8-10 s with transformers, on every one of some 150
spawns of a suite run. The server never runs an operator, so no OpenMP pool exists when it forks. Its children
would inherit the server's environment, not the test's: each rank gets the environment of the moment it was
spawned instead (monkeypatched variables included). ``HF_ZERO_TEST_START=spawn`` goes back to fresh interpreters.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

#: What the fork server imports once; each rank then starts with them loaded.
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2"]


def _start_method() -> str:
    method = os.environ.get("HF_ZERO_TEST_START", "forkserver")
    if method == "forkserver":
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return method


def _entry(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable, args: tuple,
           environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the spawning test's environment, not the fork server's
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        # Leave together, as hf_zero.distributed.dist does at exit: torch 2.13's gloo can abort a process
        # ("terminate called without an active exception") whose group is torn down while a peer
        # is still using its connection.
        if world_size > 1:
            import datetime

            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every rank has written its result and passed the barrier: leave without running gloo's C++ teardown,
    # which still aborted a worker now and then after the barrier (once in a full suite run of session 11,
    # failing a module's tests whose results were all written). The kernel closes the connections.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(world_size, store, tmp, fn, args, dict(os.environ)), nprocs=world_size,
                           start_method=_start_method())
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
