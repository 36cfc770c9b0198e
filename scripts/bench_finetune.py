"""The main job's throughput on GPUs: ``scripts/finetune.py`` under ``accelerate launch``, plain Trainer
(DDP, bf16 autocast) beside ``zero_config`` stage 2 and stage 3 (bf16), on the same model and data.

    python scripts/bench_finetune.py --gpus 2 --model minilm=/path/to/all-MiniLM-L6-v2 --model bert-large

``NAME=PATH`` fine-tunes a saved model; ``bert-large`` builds a randomly initialised BERT-large-shaped
classifier (335M parameters, the MiniLM tokenizer) so the step is long enough that the engine's cost
shows rather than Python overhead. Each run is a fresh ``accelerate launch`` of the script exactly as a
user runs it; the figures are the Trainer's own ``train_samples_per_second`` (the whole ``train()``,
first steps included) and rank 0's peak allocated CUDA memory.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"\[finetune\] accuracy (\S+) -> (\S+), train loss (\S+), (\d+) steps, (\S+) samples/s")
STEADY = re.compile(r"\[finetune\] steady state (\S+) samples/s")
PEAK = re.compile(r"\[finetune\] peak CUDA memory (\S+) GiB")


def build_bert_large(tokenizer_from: str, out: str) -> str:
    """A BERT-large-shaped classifier with the given tokenizer, saved where ``from_pretrained`` reads it."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run(gpus: int, model: str, mode: str, steps: int, batch: int, length: int, work: str) -> dict:
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
            "samples_s": float(found.group(5)),
            "steady_s": float(steady.group(1)) if steady else float("nan"), "peak_gib": float(peak.group(1)) if peak else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH, or bert-large")
    ap.add_argument("--modes", default="ddp,zero2,zero3")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench_finetune_")
    named = [m.split("=", 1) if "=" in m else [m, m] for m in args.model]
    tokenizer_from = next((p for n, p in named if n != "bert-large"), None)
    rows = []
    for name, path in named:
        if name == "bert-large":
            if tokenizer_from is None:
                ap.error("bert-large needs a tokenizer: give a NAME=PATH model too")
            path = build_bert_large(tokenizer_from, os.path.join(work, "bert-large"))
        for mode in args.modes.split(","):
            r = run(args.gpus, path, mode, args.steps, args.batch, args.length, os.path.join(work, name))
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


if __name__ == "__main__":
    main()
