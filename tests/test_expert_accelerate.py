"""Expert parallelism through Accelerate: ``hf_zero.Accelerator(zero_config=...)`` whose config holds
``"expert_parallel": {"enabled": true, "autoep_size": 2}``, and an Accelerate YAML of ``distributed_type: DEEPSPEED``
whose ``deepspeed_config_file`` holds the section, started with ``hf-zero launch --config_file`` (the path
``tests/test_accelerate_deepspeed_yaml.py`` checks for the other sections; ``accelerate launch`` itself stops on a
missing ``deepspeed`` package, docs/accelerate.md).

The loop is Accelerate's usual one on a tiny Mixtral (8 experts, top-2, aux loss on): ``prepare(model, optimizer,
loader)``, 2 accumulated micro-batches per step through ``accumulate()``, ``clip_grad_norm_`` at 0.3, 3 steps, fp32,
4 gloo ranks, ZeRO-3 with EP 2. The oracle is the same loop without the section (every expert on every rank;
``tests/test_expert_parallel.py`` checks that it equals one process): every step's loss averaged over the ranks
(``accelerator.gather``), every pre-clip norm and the whole weights ``get_state_dict`` gathers, 1e-5. The script the
YAML launches is that loop, written out, at ZeRO-2 with EP 2 (the stages train alike, so the ZeRO-3 loop without the
section is its oracle too).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn
from tests.test_accelerate_deepspeed_yaml import _free_port, _run
from tests.test_expert_parallel import SEQ, VOCAB, tiny_moe

WORLD, STEPS, GAS, MICRO, LR, CLIP, TOL = 4, 3, 2, 2, 5e-3, 0.3, 1e-5


def _config(stage: int, ep: int) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0}}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return cfg


def loop(accelerator, model: torch.nn.Module) -> dict:  # noqa: ANN001
    """Accelerate's usual loop over this rank's share of the data; each step's loss averaged over every rank."""
    ids = torch.randint(0, VOCAB, (STEPS * GAS * MICRO * WORLD, SEQ), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=MICRO, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms, total = [], [], 0.0
    for (batch,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            total += accelerator.gather(loss.detach()).mean().item() / GAS
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                losses.append(total)
                total = 0.0
            optimizer.step()
            optimizer.zero_grad()
    # the whole weights (an EP rank's experts gathered from its EP group), collective; kept by the first rank
    state = accelerator.get_state_dict(model)
    weights = {k: v.float().reshape(-1).tolist() for k, v in state.items()} if accelerator.is_main_process else None
    return {"losses": losses, "norms": norms, "weights": weights}


def _loops(rank: int, world: int, cases: list) -> list:
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero
    from hf_zero.expert.setup import find_experts

    out = []
    for stage, ep in cases:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            acc = hf_zero.Accelerator(cpu=True, gradient_accumulation_steps=GAS, zero_config=_config(stage, ep))
            model = tiny_moe("mixtral")
            res = loop(acc, model)
        res["local_experts"] = [m.num_experts for _, m in find_experts(model)]
        out.append(res)
    return out


CASES = [(3, 2), (3, 1)]


@pytest.fixture(scope="module")
def loops() -> list:
    return spawn(_loops, WORLD, CASES)


def test_accelerator_with_the_section_equals_the_loop_without(loops: list) -> None:
    ep, plain = CASES.index((3, 2)), CASES.index((3, 1))
    for rank, res in enumerate(loops):
        got, want = res[ep], res[plain]
        assert got["local_experts"] == [4, 4] and want["local_experts"] == [8, 8], (rank, got, want)  # split, or not
        assert len(got["losses"]) == len(want["losses"]) == STEPS, (rank, got, want)
        for a, b in zip(got["losses"] + got["norms"], want["losses"] + want["norms"]):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), (rank, got, want)
        assert want["norms"][0] > CLIP  # clipping acted
    got, want = loops[0][ep]["weights"], loops[0][plain]["weights"]
    assert got.keys() == want.keys()
    worst = max(abs(a - b) for k in want for a, b in zip(got[k], want[k], strict=True))
    print("ZeRO-3 EP 2 against no EP: losses", loops[0][ep]["losses"], loops[0][plain]["losses"],
          "largest weight difference", worst)
    assert worst < TOL


SCRIPT = '''
import json, sys, warnings
sys.path.insert(0, {root!r})
import hf_zero
from hf_zero.expert.setup import find_experts
from tests.test_expert_accelerate import GAS, loop
from tests.test_expert_parallel import tiny_moe

warnings.simplefilter("ignore")
acc = hf_zero.Accelerator(gradient_accumulation_steps=GAS)
model = tiny_moe("mixtral")
res = loop(acc, model)
res["local_experts"] = [m.num_experts for _, m in find_experts(model)]
res["section"] = acc.state.deepspeed_plugin.deepspeed_config.get("expert_parallel")
if acc.is_main_process:
    print("RESULT " + json.dumps(res))
'''


def test_deepspeed_yaml_with_the_section_through_hf_zero_launch(loops: list, tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    (tmp_path / "ds.json").write_text(json.dumps({**_config(2, 2), "gradient_clipping": "auto"}))
    (tmp_path / "ep.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 4\n"
        f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: false\n")
    (tmp_path / "train.py").write_text(SCRIPT.format(root=root))
    done = _run(["-m", "hf_zero.launch.cli", "launch", "--config_file", str(tmp_path / "ep.yaml"),
                 "--main_process_port", str(_free_port()), str(tmp_path / "train.py")], tmp_path)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    got, want = json.loads(line.removeprefix("RESULT ")), loops[0][CASES.index((3, 1))]
    worst = max(abs(a - b) for k in want["weights"] for a, b in zip(got["weights"][k], want["weights"][k]))
    print("YAML run, EP 2 against the loop without the section: losses", got["losses"], want["losses"],
          "largest weight difference", worst)
    assert worst < TOL
    assert got["section"] == {"enabled": True, "autoep_size": 2} and got["local_experts"] == [4, 4], got
    for a, b in zip(got["losses"] + got["norms"], want["losses"] + want["norms"], strict=True):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), (got, want)
