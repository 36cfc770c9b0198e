"""Parameters per second of Adam/AdamW steps on the host: hf_zero's DeepSpeedCPUAdam, torch's kernels, DeepSpeed's.

    python benchmarks/bench_cpu_adam.py --numel 268435456 --threads 1,2,4,8,16 \\
        --deepspeed-python /path/to/venv-with-deepspeed/bin/python --json cpu_adam.json

Every (variant, thread count) runs in a fresh process with ``OMP_NUM_THREADS`` and
``torch.set_num_threads`` set to the count, over one flat fp32 tensor of ``--numel`` parameters
(master, gradient and both moments in host memory: ZeRO-Offload's case), a few warm-up steps,
then ``--steps`` timed ones. It prints median and best parameters/s and the memory traffic they
imply (28 bytes per parameter per step, 30 with the bf16 write-back, 42 with the undo copy too).
Variants:

- ``torch_loop`` / ``torch_foreach`` / ``torch_fused``: ``torch.optim.AdamW`` with
  ``foreach=False`` (torch's CPU default), ``foreach=True``, ``fused=True`` (what FSDP2's
  ``CPUOffloadPolicy`` runs).
- ``hf_zero``: ``hf_zero.ops.adam.DeepSpeedCPUAdam.step()`` (torch's fused CPU kernel underneath).
- ``hf_zero_bf16``: the same plus the cast of the updated masters into a bf16 host buffer
  (pinned when CUDA is present), which the offload engine copies to the GPU.
- ``hf_zero_subgroups``: ``begin_step`` then ``step_range`` over ``--sub-group-size`` ranges,
  with the bf16 write-back (how the offload engine pipelines transfers with the step).
- ``hf_zero_pool``: the flat tensor cut into aligned chunks of at most 1M elements, each stepped
  with its write-back (while the chunk is still in cache) by whichever of ``threads`` Python
  worker threads is free (torch ops release the GIL), torch's own intra-op threads set to 1:
  a dynamically scheduled thread pool instead of ``at::parallel_for``'s static split.
- ``hf_zero_bf16_grads``: fp32 masters stepped with bf16 gradients (half the device-to-host
  bytes), converted a chunk at a time inside the step, with the bf16 write-back.
- ``hf_zero_fused``: ``hf_zero.optim.host_adam.adam_step``, the JIT-built one-pass kernel (bit for
  bit torch's fused update) with the bf16 write-back in the same pass; the build happens before timing.
- ``hf_zero_fused_backup``: the same plus the undo copy of master and both moments taken in the
  pass (what a speculative step needs; 12 more bytes written per parameter: 42 in all).
- ``hf_zero_fused_out``: the same step out of place, into a second set of buffers swapped with the first after each
  step (what ``super_offload``'s speculative step does now instead of the undo copy: 30 bytes, as ``hf_zero_fused``).
- ``inductor_bf16``: not what hf_zero runs, a measured alternative: AdamW written as tensor
  expressions and compiled by ``torch.compile`` (Inductor's C++ backend: one vectorised
  OpenMP loop with one sqrt, one division and the bf16 store, like DeepSpeed's kernel; needs a
  C++ compiler at run time, as DeepSpeed's op does). Compilation happens in the warm-up.
- ``deepspeed`` / ``deepspeed_bf16``: DeepSpeed's ``DeepSpeedCPUAdam`` (its JIT-built AVX op;
  needs ``--deepspeed-python``, an interpreter with deepspeed and ninja), and the same followed by
  the bf16 cast (DeepSpeed's engine casts on the GPU instead; the row shows what the host cast costs).

The machine is named in the output; numbers from a shared or throttled machine are only
comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("torch_loop", "torch_foreach", "torch_fused", "hf_zero", "hf_zero_bf16", "hf_zero_subgroups", "hf_zero_pool",
            "hf_zero_bf16_grads", "hf_zero_fused", "hf_zero_fused_backup", "hf_zero_fused_out", "inductor_bf16", "deepspeed",
            "deepspeed_bf16")
BYTES = 28  # per parameter and step: read master, grad, exp_avg, exp_avg_sq (16); write master and moments (12)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _tensors(numel: int, grad_dtype=None):  # noqa: ANN001, ANN202
    import torch

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.empty(numel).uniform_(-1, 1, generator=g))
    if grad_dtype is not None:
        p.grad_dtype = grad_dtype  # torch >= 2.10 lets a gradient differ from its parameter's dtype
    p.grad = torch.empty(numel).uniform_(-1e-2, 1e-2, generator=g).to(grad_dtype or torch.float32)
    return p


def _bf16_buffer(numel: int):  # noqa: ANN202
    import torch

    return torch.empty(numel, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())


def _inductor_step(p, out):  # noqa: ANN001, ANN202
    """One compiled pass: AdamW on (master, grad, exp_avg, exp_avg_sq) and the bf16 cast of the result."""
    import torch

    def update(p, g, m, v, out, sc):  # noqa: ANN001, ANN202
        # sc: beta1, 1-beta1, beta2, 1-beta2, 1/sqrt(bc2), eps, 1-lr*wd, -lr/bc1 (tensors: no recompiles)
        m_new = m * sc[0] + g * sc[1]
        v_new = v * sc[2] + g * g * sc[3]
        p_new = p * sc[6] + m_new / (v_new.sqrt() * sc[4] + sc[5]) * sc[7]
        m.copy_(m_new)
        v.copy_(v_new)
        p.copy_(p_new)
        out.copy_(p_new)

    compiled = torch.compile(update, dynamic=True)
    data, grad = p.detach(), p.grad
    m, v = torch.zeros_like(data), torch.zeros_like(data)
    count = [0]

    def step() -> None:
        count[0] += 1
        t = count[0]
        b1, b2 = BETAS
        sc = torch.tensor([b1, 1 - b1, b2, 1 - b2, (1 - b2 ** t) ** -0.5, EPS, 1 - LR * WD, -LR / (1 - b1 ** t)])
        compiled(data, grad, m, v, out, sc)
    return step


def _fused_step(p, backup: bool, swap: bool = False):  # noqa: ANN001, ANN202
    """hf_zero's one-pass kernel on the flat tensors: the update, the bf16 write-back (and the undo copy, or the results
    written out of place into buffers swapped each step) at once."""
    import torch

    sys.path.insert(0, str(REPO))
    from hf_zero.optim import host_adam
    from hf_zero.optim.cpu_adam import host_buffer

    if not host_adam.available():
        raise RuntimeError(f"hf_zero.optim.host_adam unavailable: {host_adam.unavailable_reason()}")
    data, grad = p.detach(), p.grad
    m, v = torch.zeros_like(data), torch.zeros_like(data)
    out = host_buffer(data.numel(), torch.bfloat16)
    saved = tuple(torch.empty_like(data) for _ in range(3)) if backup or swap else None
    count = [0]
    state = [(data, m, v), saved]

    def step() -> None:
        count[0] += 1
        now, other = state
        host_adam.adam_step(now[0], grad, now[1], now[2], count[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                            weight_decay=WD, adamw=True, out16=out, backup=saved if backup else None,
                            out=other if swap else None)
        if swap:  # the step stands: its results become the state, the old buffers the next step's destination
            state[:] = [other, now]
    return step


def _step_fn(variant: str, numel: int, threads: int, sub_group_size: int):  # noqa: ANN202, C901
    """The variant's one-step callable (state built, nothing timed yet)."""
    import torch

    p = _tensors(numel, torch.bfloat16 if variant == "hf_zero_bf16_grads" else None)
    if variant.startswith("torch_"):
        kind = variant.split("_", 1)[1]
        opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                foreach=kind == "foreach", fused=True if kind == "fused" else None)
        return opt.step
    if variant.startswith("deepspeed"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam as DSCPUAdam

        opt = DSCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        if variant == "deepspeed":
            return opt.step
        buf = _bf16_buffer(numel)
        return lambda: (opt.step(), buf.copy_(p.detach()))

    if variant == "inductor_bf16":
        return _inductor_step(p, _bf16_buffer(numel))
    if variant.startswith("hf_zero_fused"):
        return _fused_step(p, backup=variant == "hf_zero_fused_backup", swap=variant == "hf_zero_fused_out")
    sys.path.insert(0, str(REPO))
    from hf_zero.ops.adam import DeepSpeedCPUAdam
    from hf_zero.optim.cpu_adam import ALIGN, host_buffer, sub_group_ranges

    opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    if variant == "hf_zero":
        return opt.step
    opt.bind_16bit_copy(p, host_buffer(numel, torch.bfloat16))
    if variant in ("hf_zero_bf16", "hf_zero_bf16_grads"):
        return opt.step
    if variant == "hf_zero_subgroups":
        ranges = sub_group_ranges(numel, sub_group_size)

        def subgroups() -> None:
            opt.begin_step()
            for lo, hi in ranges:
                opt.step_range(p, lo, hi)
        return subgroups
    # hf_zero_pool: aligned chunks handed to free worker threads, torch's intra-op threads off
    from concurrent.futures import ThreadPoolExecutor

    torch.set_num_threads(1)  # before the workers start: each takes the count on its first torch call
    pool = ThreadPoolExecutor(threads)
    ranges = sub_group_ranges(numel, min(1 << 20, -(-numel // threads)), ALIGN)

    def pooled() -> None:
        opt.begin_step()
        list(pool.map(lambda r: opt.step_range(p, *r), ranges))
    return pooled


def child(variant: str, numel: int, threads: int, steps: int, warmup: int, sub_group_size: int) -> dict:
    """Time one variant in this process; the parent set OMP_NUM_THREADS to ``threads``."""
    import torch

    torch.set_num_threads(threads)
    step = _step_fn(variant, numel, threads, sub_group_size)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    write_back = variant in ("hf_zero_bf16", "hf_zero_subgroups", "hf_zero_pool", "hf_zero_bf16_grads", "inductor_bf16",
                             "deepspeed_bf16", "hf_zero_fused", "hf_zero_fused_backup", "hf_zero_fused_out")
    bytes_per = (BYTES + 2 * write_back - 2 * (variant == "hf_zero_bf16_grads")  # a bf16 gradient is 2 bytes read
                 + 12 * (variant == "hf_zero_fused_backup"))  # the undo copy: master and both moments written
    med, best = statistics.median(times), min(times)
    return {"variant": variant, "threads": threads, "numel": numel, "median_s": med, "best_s": best,
            "params_per_s": numel / med, "best_params_per_s": numel / best, "GB_per_s": numel * bytes_per / med / 1e9,
            "torch": torch.__version__}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} logical CPUs, load average {load:.1f}"


def _run_child(python: str, variant: str, threads: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if variant.startswith("deepspeed"):
        env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"  # its ninja, for the JIT build
        import torch

        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [python, str(Path(__file__).resolve()), "--child", variant, "--numel", str(args.numel), "--threads", str(threads),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--sub-group-size", str(args.sub_group_size)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"variant": variant, "threads": threads, "error": tail[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24, help="parameters in the flat tensor (default 16M; 2**28 on a big host)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole sweep, interleaved, and keep each row's fastest median (for shared machines)")
    ap.add_argument("--sub-group-size", type=int, default=0, help="hf_zero_subgroups: elements per range (default numel/8)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--deepspeed-python", default=os.environ.get("HF_ZERO_DEEPSPEED_PYTHON", ""),
                    help="an interpreter with deepspeed (and ninja) for the deepspeed rows")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child (DeepSpeed's first JIT build is slow)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sub_group_size = args.sub_group_size or max(1, args.numel // 8)
    if args.child:
        print(json.dumps(child(args.child, args.numel, int(args.threads), args.steps, args.warmup, args.sub_group_size)))
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        sys.exit(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    threads = [int(t) for t in args.threads.split(",") if t]
    print(f"[bench_cpu_adam] {_machine()}; {args.numel:,} parameters, {args.steps} timed steps after {args.warmup}")
    print(f"{'variant':<20}{'threads':>8}{'Mparams/s':>12}{'best':>10}{'GB/s':>8}")
    best: dict[tuple[str, int], dict] = {}
    for r in range(args.rounds):
        for t in threads:
            for v in variants:
                if v.startswith("deepspeed") and not args.deepspeed_python:
                    row = {"variant": v, "threads": t, "error": "skipped: no --deepspeed-python"}
                else:
                    row = _run_child(args.deepspeed_python if v.startswith("deepspeed") else sys.executable, v, t, args)
                kept = best.get((v, t))
                if kept is None or "error" in kept or row.get("params_per_s", 0) > kept.get("params_per_s", 0):
                    best[(v, t)] = row
                tag = f"{v:<20}{t:>8}" + (f"  (round {r + 1})" if args.rounds > 1 else "")
                if "error" in row:
                    print(f"{tag}  {row['error']}", flush=True)
                elif args.rounds == 1:
                    print(f"{tag}{row['params_per_s'] / 1e6:>12.0f}{row['best_params_per_s'] / 1e6:>10.0f}"
                          f"{row['GB_per_s']:>8.1f}", flush=True)
    rows = list(best.values())
    if args.rounds > 1:
        print(f"fastest median of {args.rounds} rounds; load average now {os.getloadavg()[0]:.1f}")
        for row in rows:
            if "error" not in row:
                print(f"{row['variant']:<20}{row['threads']:>8}{row['params_per_s'] / 1e6:>12.0f}"
                      f"{row['best_params_per_s'] / 1e6:>10.0f}{row['GB_per_s']:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": _machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
