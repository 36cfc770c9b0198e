"""The CPU test suite's arithmetic oracles, run with NCCL on GPUs.

    torchrun --nproc_per_node 2 scripts/gpu_check.py

Each rank trains on its GPU (NCCL collectives, side streams); the single-process oracle runs on
the CPU. Prints one line per case with the largest relative loss and weight errors, and exits
non-zero if any exceeds the tolerance.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import test_parity, test_stage3  # noqa: E402

TOL = 1e-5


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [("stages 0-2", r) for r in test_parity._run_grid(rank, world, test_parity.CASES)]
    rows += [("stage 3", r) for r in test_stage3._grid(rank, world, test_stage3.CASES)]
    worst = torch.tensor([max(r["loss_err"], r["w_err"]) for _, r in rows], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    failed = 0
    if rank == 0:
        print(f"NCCL parity on {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, tolerance {TOL:g}")
        print("| suite | case (stage/model, accumulation, clip[, scheduler]) | max rel. loss err | max rel. weight err | |")
        print("|---|---|---|---|---|")
        for (suite, r), w in zip(rows, worst.tolist()):
            ok = w < TOL
            failed += not ok
            print(f"| {suite} | {r['case']} | {r['loss_err']:.2e} | {r['w_err']:.2e} | {'ok' if ok else 'FAIL'} |")
        print(f"{len(rows) - failed} passed, {failed} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
