"""Checkpoint cost on a Llama shape: seconds to save, seconds training is blocked per save (with and without
``checkpoint.async_save``), seconds to load, beside torch DCP (``dcp.save`` / ``dcp.async_save`` of an FSDP2
model and its optimizer), DeepSpeed's ``save_checkpoint`` (when ``deepspeed`` imports) and ``dd`` of the same
bytes to the same disk.

On the GPU machine (each engine in its own torchrun, one process per GPU)::

    python benchmarks/bench_checkpoint.py --gpus 8 --model 8b --out /local_disk/ckpt_bench
    python benchmarks/bench_checkpoint.py --gpus 8 --model 8b --engines hf,dcp --stage 2 --out /local_disk/ckpt_bench

A CPU smoke test (one process, every engine in it, fp32)::

    python benchmarks/bench_checkpoint.py --device cpu --model tiny --gpus 1 --out /tmp/ckpt_bench

What is timed, per engine (every figure is the slowest rank's):

- ``step_s``: the median training step (forward, backward, optimizer) without saving; ``step_watch_s`` (hf) the
  same with ``checkpoint.save_on_signal``'s agreement on (one all-reduce per step, read a step later);
- ``save_s``: a synchronous save, call to return (hf_zero ``save_checkpoint``, ``dcp.save``, DeepSpeed's);
- ``blocked_s``: what one save costs the training loop: the save call plus, over the ``--steps`` steps that
  follow it, their time beyond ``step_s`` (a background write competes for the CPU, PCIe and the disk);
  ``blocked_async_s`` the same with ``async_save`` / ``dcp.async_save``, whose ``call_async_s`` is the call alone
  and ``drain_s`` what waiting for the write still took after those steps (0 when it had finished);
- ``load_s``: loading that checkpoint back into the same engine;
- ``bytes``: the checkpoint's size on disk; ``dd_s``: every rank writing its share of those bytes with ``dd``
  (``oflag=direct``, or ``conv=fdatasync`` where direct I/O is refused) at the same time, to the same folder:
  the disk's bandwidth for this write pattern, ``bytes / dd_s``.

Each checkpoint is removed once it has been timed, so the disk needs room for one at a time (8B with Adam: 96 GB,
DeepSpeed's with its 16-bit weights 112 GB); ``--sync-only`` leaves out the background saves (the 8B rows on a
128 GiB disk in a 10-minute call) and ``--no-dd`` the ``dd`` write. ``--profile N`` prints the N costliest
functions of hf_zero's save and load (cProfile, rank 0).

Rows are printed as a table and as JSON lines (``RESULT {...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# the repository root first, so that hf_zero and tests import without an install (the device machine has none)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 vocab_size=32000),
    # Llama-3-8B's shape (8.03B parameters with its 128,256-token vocabulary)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256),
}
ENGINES = ("hf", "dcp", "ds")


# ------------------------------------------------------------------------------ helpers


def _cuda(args: argparse.Namespace) -> bool:
    return args.device == "cuda"


def _sync(args: argparse.Namespace) -> None:
    if _cuda(args):
        torch.cuda.synchronize()


def _slowest(seconds: float, args: argparse.Namespace) -> float:
    """The largest of every rank's figure."""
    t = torch.tensor([seconds], dtype=torch.float64, device="cuda" if _cuda(args) else "cpu")
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _drop(path: str) -> None:
    """Remove a checkpoint folder once every rank is done with it (rank 0 removes it), so the next one has the disk."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _keep(row: dict, args: argparse.Namespace) -> None:
    """Rank 0 writes the row measured so far where the driver reads it, so that a load that fails afterwards
    (DeepSpeed ZeRO-3's at 8B on 80 GB cards runs out of memory) still reports the save it timed."""
    if args.json and dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(row))


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=args.seq, use_cache=False, **SHAPES[args.model])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        return LlamaForCausalLM(cfg)


def _batches(args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    rank = dist.get_rank()
    g = torch.Generator(device=args.device).manual_seed(1234 + rank)
    vocab = SHAPES[args.model]["vocab_size"]
    return lambda: torch.randint(0, vocab, (args.micro, args.seq), device=args.device, generator=g)


def _timed_steps(step: Callable[[], None], n: int, args: argparse.Namespace) -> list[float]:
    out = []
    for _ in range(n):
        _sync(args)
        t0 = time.perf_counter()
        step()
        _sync(args)
        out.append(time.perf_counter() - t0)
    return out


def _blocked(call: Callable[[], Any], step: Callable[[], None], base: float, args: argparse.Namespace) -> tuple[float, float, Any]:
    """(call seconds, blocked seconds: the call plus the following steps' time beyond ``base``, the call's result)."""
    _sync(args)
    dist.barrier()
    t0 = time.perf_counter()
    result = call()
    call_s = time.perf_counter() - t0
    after = _timed_steps(step, args.steps, args)
    return call_s, call_s + sum(max(0.0, s - base) for s in after), result


def _dd(path: str, nbytes: int) -> float:
    """Seconds for ``dd`` to write ``nbytes`` to ``path`` (direct I/O where the filesystem allows it)."""
    block = 64 * 2**20
    count = max(1, -(-nbytes // block))
    for flags in (["oflag=direct", "conv=fsync"], ["conv=fdatasync"]):
        t0 = time.perf_counter()
        done = subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", *flags],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode == 0:
            os.remove(path)
            return seconds * nbytes / (count * block)
    raise RuntimeError(f"dd failed: {done.stderr.strip()}")


def _profiled(call: Callable[[], Any], what: str, args: argparse.Namespace) -> Callable[[], Any]:
    """``call``, under cProfile on rank 0 when ``--profile`` is given (its top functions printed after it)."""
    if not args.profile or dist.get_rank() != 0:
        return call

    def run() -> Any:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        result = prof.runcall(call)
        for key in ("tottime", "cumulative"):
            print(f"--- profile of hf {what}, by {key}, rank 0", flush=True)
            pstats.Stats(prof, stream=sys.stdout).sort_stats(key).print_stats(args.profile)
        return result

    return run


# ------------------------------------------------------------------------------ engines


def _engine_and_step(initialize: Callable[..., tuple], args: argparse.Namespace, *, bf16: bool) -> tuple[Any, Callable[[], None], float]:
    """A DeepSpeed-API engine (hf_zero's or DeepSpeed's ``initialize``) of the same config, its training step, and the
    median step time after the warm-up: what both engines' rows start from."""
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
           "zero_optimization": {"stage": args.stage}}
    engine = initialize(model=build_model(args), config=cfg)[0]
    batch = _batches(args)

    def step() -> None:
        ids = batch()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    _timed_steps(step, args.warmup, args)
    return engine, step, statistics.median(_timed_steps(step, args.steps, args))


def run_hf(args: argparse.Namespace, out: str) -> dict:
    import hf_zero

    engine, step, base = _engine_and_step(hf_zero.initialize, args, bf16=_cuda(args))
    row: dict[str, Any] = {"step_s": _slowest(base, args)}
    # checkpoint.save_on_signal's agreement (one all-reduce per step, read a step later): what it costs a step
    from hf_zero.training import preemption

    engine.long_runs.preemption = preemption.Agreement([int(signal.SIGUSR2)], None)
    row["step_watch_s"] = _slowest(statistics.median(_timed_steps(step, args.steps, args)), args)
    engine.long_runs.close()
    sync_dir, async_dir = os.path.join(out, "hf_sync"), os.path.join(out, "hf_async")
    call, blocked, _ = _blocked(_profiled(lambda: engine.save_checkpoint(sync_dir), "save", args), step, base, args)
    row["save_s"], row["blocked_s"] = _slowest(call, args), _slowest(blocked, args)
    tag = os.path.join(sync_dir, open(os.path.join(sync_dir, "latest")).read().strip())
    rank = dist.get_rank()
    mine = sum(f.stat().st_size for f in Path(tag).glob(f"rank{rank:05d}*"))  # this rank's share, for its dd
    row["bytes"] = _folder_bytes(tag)
    _keep(row, args)
    dist.barrier()
    t0 = time.perf_counter()
    _profiled(lambda: engine.load_checkpoint(sync_dir), "load", args)()
    row["load_s"] = _slowest(time.perf_counter() - t0, args)
    _drop(sync_dir)  # the disk holds one checkpoint at a time (8B: 96 GB)
    if not args.sync_only:
        engine.config.checkpoint_async_save = True
        engine.persistence.save(async_dir, background=True)  # the first background save allocates (and pins) its host buffers
        engine.wait_for_checkpoint()
        _drop(async_dir)
        call, blocked, _ = _blocked(lambda: engine.save_checkpoint(async_dir), step, base, args)
        t0 = time.perf_counter()
        engine.wait_for_checkpoint()
        row["call_async_s"], row["blocked_async_s"] = _slowest(call, args), _slowest(blocked, args)
        row["drain_s"] = _slowest(time.perf_counter() - t0, args)
        _drop(async_dir)
    if not args.no_dd:
        dist.barrier()
        row["dd_s"] = _slowest(_dd(os.path.join(out, f"dd.rank{rank}"), mine), args)
    engine.destroy()
    return row


def run_dcp(args: argparse.Namespace, out: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if _cuda(args) else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    batch = _batches(args)
    writers = dist.new_group(backend="gloo")  # as torchtitan does: async_save's collectives off the training group

    def step() -> None:
        ids = batch()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state() -> dict:
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    _timed_steps(step, args.warmup, args)
    base = statistics.median(_timed_steps(step, args.steps, args))
    row: dict[str, Any] = {"step_s": _slowest(base, args)}
    sync_dir, async_dir = os.path.join(out, "dcp_sync"), os.path.join(out, "dcp_async")
    call, blocked, _ = _blocked(lambda: dcp.save(state(), checkpoint_id=sync_dir), step, base, args)
    row["save_s"], row["blocked_s"] = _slowest(call, args), _slowest(blocked, args)
    row["bytes"] = _folder_bytes(sync_dir)
    _keep(row, args)
    dist.barrier()
    t0 = time.perf_counter()
    sd = state()
    dcp.load(sd, checkpoint_id=sync_dir)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    row["load_s"] = _slowest(time.perf_counter() - t0, args)
    _drop(sync_dir)
    if not args.sync_only:
        dcp.async_save(state(), checkpoint_id=async_dir + "_warm", process_group=writers).result()  # its staging buffers
        _drop(async_dir + "_warm")
        call, blocked, future = _blocked(lambda: dcp.async_save(state(), checkpoint_id=async_dir, process_group=writers),
                                         step, base, args)
        t0 = time.perf_counter()
        future.result()
        row["call_async_s"], row["blocked_async_s"] = _slowest(call, args), _slowest(blocked, args)
        row["drain_s"] = _slowest(time.perf_counter() - t0, args)
        _drop(async_dir)
    return row


def run_ds(args: argparse.Namespace, out: str) -> dict:
    import deepspeed

    engine, step, base = _engine_and_step(deepspeed.initialize, args, bf16=True)
    row: dict[str, Any] = {"step_s": _slowest(base, args)}
    d = os.path.join(out, "ds")
    call, blocked, _ = _blocked(lambda: engine.save_checkpoint(d), step, base, args)
    row["save_s"], row["blocked_s"] = _slowest(call, args), _slowest(blocked, args)
    row["bytes"] = _folder_bytes(d)
    _keep(row, args)
    dist.barrier()
    t0 = time.perf_counter()
    engine.load_checkpoint(d)
    row["load_s"] = _slowest(time.perf_counter() - t0, args)
    return row


def run_engine(name: str, args: argparse.Namespace) -> dict:
    out = os.path.join(args.out, name)
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
    dist.barrier()
    row = {"hf": run_hf, "dcp": run_dcp, "ds": run_ds}[name](args, out)
    row.update(engine=name, model=args.model, world=dist.get_world_size(), device=args.device,
               stage=args.stage if name != "dcp" else "fsdp2")
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    return row


# ------------------------------------------------------------------------------ driver


def child(args: argparse.Namespace) -> None:
    """Inside torchrun (or inline at one process): run one engine, rank 0 writes its row as JSON."""
    import hf_zero

    if _cuda(args):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    hf_zero.init_distributed()
    row = run_engine(args.engines, args)
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(row))


def table(rows: list[dict]) -> list[str]:
    head = (f"{'engine':<7} {'GB':>8} {'step s':>7} {'watch s':>7} {'save s':>8} {'blocked s':>9} {'async call s':>12} "
            f"{'blocked async s':>15} {'drain s':>8} {'load s':>8} {'GB/s write':>10} {'dd GB/s':>8}")
    lines = [head]
    for r in rows:
        if "save_s" not in r:
            lines.append(f"{r['engine']:<7} failed: {r['error']}")
            continue
        gb = r["bytes"] / 1e9

        def f(key: str, width: int, r: dict = r) -> str:
            v = r.get(key)
            return f"{v:>{width}.3f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"

        dd = f"{gb / r['dd_s']:>8.2f}" if r.get("dd_s") else f"{'-':>8}"
        lines.append(f"{r['engine']:<7} {gb:>8.3f} {f('step_s', 7)} {f('step_watch_s', 7)} {f('save_s', 8)} {f('blocked_s', 9)} "
                     f"{f('call_async_s', 12)} {f('blocked_async_s', 15)} {f('drain_s', 8)} {f('load_s', 8)} "
                     f"{gb / r['save_s']:>10.2f} {dd}" + (f"  (then failed: {r['error']})" if "error" in r else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--engines", default="hf,dcp,ds", help="comma-separated, of " + ", ".join(ENGINES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--gpus", type=int, default=0, help="processes (GPUs) per engine; default: every visible GPU, 1 on CPU")
    ap.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage of the hf and ds engines")
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="timed steps (and steps after each save)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_checkpoint"),
                    help="where the checkpoints go: the disk being measured")
    ap.add_argument("--sync-only", action="store_true",
                    help="no background saves (async_save, dcp.async_save): the synchronous save, what it blocks, the load")
    ap.add_argument("--no-dd", action="store_true", help="leave out dd's write of the same bytes")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N costliest functions of hf_zero's synchronous save and its load (cProfile, rank 0)")
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:  # a child: one engine
        return child(args)
    gpus = args.gpus or (torch.cuda.device_count() if _cuda(args) else 1)
    names = [n for n in args.engines.split(",") if n]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        ap.error(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    rows = []
    for name in names:
        if name == "ds":
            try:
                import deepspeed  # noqa: F401
            except Exception as e:  # noqa: BLE001 - not installed, or installed without its ops
                print(f"ds: skipped, deepspeed does not import ({type(e).__name__}: {e})", flush=True)
                continue
        if gpus == 1 and not _cuda(args):  # one CPU process (the smoke test): every engine in this one
            import hf_zero

            hf_zero.init_distributed()
            rows.append(run_engine(name, args))
            print("RESULT " + json.dumps(rows[-1]), flush=True)
            continue
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result = f.name
        child_args = [*sys.argv[1:], "--engines", name, "--json", result]
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", __file__, *child_args]
        print(f"{name}: {' '.join(argv)}", flush=True)
        try:
            error = "" if (rc := subprocess.run(argv, timeout=args.timeout).returncode) == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            error = f"ran past --timeout {args.timeout} s"
        try:  # a failed child may still have kept the figures it measured before failing (its save)
            row = json.loads(Path(result).read_text() or "{}")
        except (OSError, ValueError):
            row = {}
        os.remove(result)
        if error or "engine" not in row:
            row = {**row, "engine": name, "error": error or "no result written"}
        rows.append(row)
        print("RESULT " + json.dumps(rows[-1]), flush=True)
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
