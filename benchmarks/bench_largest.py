"""The largest Llama-shape model an engine trains on this machine, found by doubling then bisection.

    python benchmarks/bench_largest.py --gpus 1 --engines hf3op,fsdp2o --model 7.2b --start 16
    python benchmarks/bench_largest.py --gpus 4 --engines hf3op --model 13b --start 40 --zero_init
    python benchmarks/bench_largest.py --gpus 1 --engines hf3op --model 6b --lo 32 --hi 48 --resolution 2   # bisection only

Each trial is one ``benchmarks/bench.py`` run (its own torchrun, so a trial that runs out of GPU or host memory,
or is killed by the kernel's OOM killer, ends only itself) of the ``--model`` shape with ``--layers L`` decoder
layers, one warm-up and one timed step. ``L`` doubles from ``--start`` until a trial fails (or ``--max`` is
reached), then the last success and the first failure are bisected down to one layer. A trial that passes
``--timeout`` counts as a failure and says so: whether that size fits is then not known.

Each engine's row prints its largest size, its tokens/s there, its GPU and host peaks, and the floor the engine is
held to: bytes per parameter in host memory (and on disk for NVMe) for its layout, and the parameter count
that the machine's memory divided by those bytes allows. ``ratio`` is the largest measured against that floor: a
figure near 1.0 means the engine wastes little beyond what its layout must store.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: bytes per parameter each engine must keep in host memory (and on disk) for a bf16 model trained with AdamW,
#: whatever the number of GPUs: the fp32 master and two fp32 moments (12), plus what the layout keeps beside them.
#: hf3op: the 16-bit shards the all-gathers read (2) and, unless the streamed mode is taken, an fp32 gradient
#: copy (4; hf_zero/zero/offload.py drops it when the host cannot hold it, so the floor is 14).
#: fsdp2o: CPUOffloadPolicy keeps fp32 parameters (the master, 4), fp32 gradients (4) and the moments (8) on the host.
#: ds3op: DeepSpeed's ZeRO-3 offload keeps the fp32 master, moments and an fp32 gradient partition (16) and its
#: 16-bit parameter partitions (2) in host memory.
HOST_BYTES = {"hf3op": 14, "hf3o": 12, "fsdp2o": 16, "ds3op": 18, "ds3o": 16}


def trial(engine: str, layers: int, args: argparse.Namespace) -> dict:
    """One bench.py run at ``layers`` layers: its row, or ``{"ok": False, "why": ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.join(HERE, "bench.py"), "--gpus", str(args.gpus), "--model", args.model,
               "--layers", str(layers), "--engines", engine, "--micro", str(args.micro), "--seq", str(args.seq),
               "--steps", "1", "--warmup", "1", "--bucket", str(args.bucket), "--rows_json", out,
               *(["--zero_init"] if args.zero_init else []), *args.extra]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"ok": False, "why": f"past --timeout {args.timeout} s", "seconds": time.time() - t0}
        if proc.returncode != 0 or not os.path.exists(out):
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and not ln.startswith("=")]
            why = next((ln for ln in reversed(lines) if any(k in ln for k in ("Error", "memory", "Killed", "signal"))),
                       lines[-1] if lines else f"exit {proc.returncode}")
            # the trial's last lines, so the reason survives (a ChildFailedError line alone does not say what failed)
            print("\n".join(f"    | {ln}" for ln in lines[-25:]), flush=True)
            return {"ok": False, "why": why.strip()[:300], "seconds": time.time() - t0}
        with open(out) as f:
            rows = json.load(f)
        row = rows[0] if rows else {}
        return {"ok": bool(rows), **row, "seconds": time.time() - t0}


def search(engine: str, args: argparse.Namespace) -> tuple[int, dict, list[tuple[int, dict]]]:
    """Doubling from ``--start`` layers, then bisection: the largest layer count that trains, its row, all trials."""
    tried: list[tuple[int, dict]] = []

    def run(n: int) -> bool:
        r = trial(engine, n, args)
        tried.append((n, r))
        state = "ok" if r["ok"] else f"failed ({r['why']})"
        extra = (f", {r['params'] / 1e9:.2f}B, {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, GPU {r['peak_gib']:.1f} GiB, "
                 f"host {r.get('host_peak_sum_gib', 0):.1f} GiB") if r["ok"] else ""
        print(f"[largest] {engine} layers {n}: {state}{extra} in {r['seconds']:.0f} s", flush=True)
        return r["ok"]

    good, bad = args.lo, args.hi
    n = args.start
    while not bad and n <= args.max:
        if run(n):
            good = n
            n *= 2
        else:
            bad = n
            break
    if good == 0:  # even the start failed: bisect down from it
        lo, hi = 0, bad
    else:
        lo, hi = good, bad or args.max + 1
    while hi - lo > args.resolution:
        mid = (lo + hi) // 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    best = next((r for n_, r in tried if n_ == lo and r["ok"]), {})
    if not best and lo:  # the bracket's lower end came from --lo: measure it, so the row has its figures
        run(lo)
        best = tried[-1][1] if tried[-1][1]["ok"] else {}
    return lo, best, tried


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="hf3op,fsdp2o")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--model", default="7.2b", help="bench.py's shape whose layer count is searched")
    ap.add_argument("--start", type=int, default=16, help="layers of the first trial")
    ap.add_argument("--max", type=int, default=512, help="layers past which the doubling stops")
    ap.add_argument("--lo", type=int, default=0,
                    help="a layer count known to train (from an earlier run): the search starts above it")
    ap.add_argument("--hi", type=int, default=0,
                    help="a layer count known not to fit (e.g. past the host-memory floor): no doubling, bisection only")
    ap.add_argument("--resolution", type=int, default=1, help="stop bisecting when the bracket is this many layers wide")
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bucket", type=float, default=1e8)
    ap.add_argument("--timeout", type=int, default=900, help="seconds one trial may take")
    ap.add_argument("--zero_init", action="store_true", help="pass --zero_init to bench.py (hf_zero stage-3 engines)")
    ap.add_argument("--host_gib", type=float, default=0.0, help="host memory for the floor (default: MemTotal)")
    ap.add_argument("--disk_path", default="/tmp", help="the file system whose free space the NVMe floor uses")
    args, extra = ap.parse_known_args()
    args.extra = extra
    args.bucket = int(args.bucket)
    host = args.host_gib or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    disk = shutil.disk_usage(args.disk_path).free / 2**30
    results = []
    for engine in args.engines.split(","):
        layers, row, tried = search(engine, args)
        results.append((engine, layers, row, tried))
    print(f"\nlargest trainable {args.model}-family model (micro-batch {args.micro}, seq {args.seq}), {args.gpus} GPU(s), "
          f"host {host:.0f} GiB, free disk {disk:.0f} GiB at {args.disk_path}")
    print("| engine | layers | parameters | tokens/s/GPU | GPU peak GiB | host peak GiB (ranks summed) | "
          "host bytes/param floor | floor's largest | measured / floor | trials |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for engine, layers, row, tried in results:
        if not row:
            print(f"| {engine} | none | | | | | | | | {len(tried)} |")
            continue
        per = HOST_BYTES.get(engine)
        floor = host * 2**30 / per if per else None
        print(f"| {engine} | {layers} | {row['params'] / 1e9:.2f}B | {row['tokens_per_s_per_gpu']:,.0f} | "
              f"{row['peak_gib']:.1f} | {row.get('host_peak_sum_gib', 0):.1f} | {per or '?'} | "
              f"{(floor / 1e9) if floor else 0:.2f}B | {(row['params'] / floor) if floor else 0:.2f} | {len(tried)} |")


if __name__ == "__main__":
    main()
