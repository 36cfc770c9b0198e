"""The Hub token never appears in logs, model cards or checkpoint metadata (issue 8, item 8).

A training script, logging everything at DEBUG (hf_zero, huggingface_hub, urllib3, the root
logger) and with ``HF_DEBUG=1``, trains two ranks, saves resume checkpoints, writes its
TrainingArguments (``hub_token`` set), and pushes with the token given explicitly to
``engine.push_to_hub`` against the local Hub server (which refuses requests without it), then
once more with a wrong token. The tokens are then looked for in everything the run printed,
every file it wrote, every file the Hub holds and every request body.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.hub_server import HubServer

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, logging, os, sys
import torch, torch.distributed as dist
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
from huggingface_hub.utils import logging as hf_logging
hf_logging.set_verbosity_debug()
import hf_zero
from hf_zero import TrainingArguments
from hf_zero.hub.transfer import HubError
from tests.models import make_data, make_model

token, wrong, out = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 2}, "steps_per_print": 1}
engine, _, _, _ = hf_zero.initialize(model=make_model(), config=cfg)
ids, labels = make_data(2, 4)
r = dist.get_rank()
for t in range(2):
    engine.backward(engine(ids[t, 2 * r : 2 * r + 2], labels[t, 2 * r : 2 * r + 2]))
    engine.step()
engine.save_checkpoint(out, client_state={"epoch": 1})
if r == 0:
    args = TrainingArguments(output_dir=out, hub_token=token, report_to=[])
    open(os.path.join(out, "training_args.json"), "w").write(args.to_json_string())
    logging.getLogger("train").info("arguments: %s", args)  # str(): how scripts and the Trainer log them
url = engine.push_to_hub("user/secret-run", out, token=token, include_resume_state=True)
sys.stdout.write(f"URL {url}\n")  # one write: lines of two ranks never mix
try:
    engine.push_to_hub("user/secret-run", out, token=wrong)
except HubError as e:
    sys.stdout.write(f"REFUSED {e}\n")
"""


def test_hub_token_never_reaches_logs_cards_or_checkpoints(tmp_path: Path) -> None:
    token, wrong = "hf_" + secrets.token_hex(16), "hf_" + secrets.token_hex(16)
    hub = HubServer(token=token).start()
    try:
        (tmp_path / "hf_home").mkdir()
        out = tmp_path / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_", "TRANSFORMERS_"))}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf_home"), HF_DEBUG="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
        (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=0", "--rdzv-backend=c10d",
             "--rdzv-endpoint=127.0.0.1:0", str(tmp_path / "script.py"), token, wrong, str(out)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
        )
        printed = proc.stdout + proc.stderr
        assert proc.returncode == 0, printed[-4000:]
        assert "URL " in printed and "REFUSED the Hub rejected the token" in printed, [x for x in printed.splitlines() if "curl" not in x][-40:]
        assert "hf_zero INFO step=2" in printed and "DEBUG" in printed  # the logs were on, and verbose
        assert "hub_token=<HUB_TOKEN>" in printed  # transformers' redaction, kept by hf_zero's TrainingArguments
        assert (out / "README.md").exists() and (out / "global_step2" / "checkpoint.json").exists()
        assert "<HUB_TOKEN>" in (out / "training_args.json").read_text()
        stored = [e.content or b"" for repo in hub.repos.values() for c in repo.commits.values() for e in c.files.values()]
        assert len(stored) >= 5 and any(b"hf_zero.resume/1" in b for b in stored)  # card, weights, resume state
        for secret in (token, wrong):
            assert secret not in printed, [line[:300] for line in printed.splitlines() if secret in line][:3]
            for path in tmp_path.rglob("*"):
                if path.is_file():
                    assert secret.encode() not in path.read_bytes(), path
            assert all(secret.encode() not in body for body in stored)
            assert all(secret.encode() not in body for body in hub.bodies)
    finally:
        hub.stop()


def test_training_arguments_repr_hides_the_hub_token(tmp_path: Path) -> None:
    from hf_zero import TrainingArguments

    token = "hf_" + secrets.token_hex(16)
    args = TrainingArguments(output_dir=str(tmp_path), hub_token=token, report_to=[])
    assert token not in str(args) and token not in args.to_json_string()
    assert token not in repr(args)
