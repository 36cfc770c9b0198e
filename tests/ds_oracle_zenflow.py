"""DeepSpeed 0.19.8's ZenFlow, run with DeepSpeed's own interpreter, for ``tests/test_zenflow_deepspeed.py``.

    python -m torch.distributed.run --nproc-per-node 1 tests/ds_oracle_zenflow.py OUT_DIR CASES_JSON

(``tests/dsenv.py:run_torchrun`` starts it; a CPU process over gloo, DeepSpeed's CPU accelerator, its ``cpu_adam`` op
JIT-built.) For each case it trains :func:`make_model` on :func:`batch` through ``deepspeed.initialize`` with ZeRO 2,
``offload_optimizer`` on the cpu and the case's ``zenflow`` section, and writes every step's loss and the final weights
(``OUT_DIR/<case>.json`` and ``.safetensors``). The builders import only torch, so the hf_zero side trains the same.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

IN, HIDDEN, OUT, ROWS = 7, 15, 6, 3


def make_model() -> torch.nn.Module:
    """Three linear layers without biases: 2-D weights of 7, 15 and 11 columns, ZenFlow's to choose among.

    No 1-D parameter: DeepSpeed 0.19.8's ``update_selected_channels`` skips one without advancing its offset into
    the gradient bucket, so each 2-D weight after a bias or a norm in the bucket is scored on the gradient of whatever
    lies that many elements earlier (measured: a weight after a bias of 6 got the column sums of its own columns
    0-13 moved one column along, the bias's in front). With only 2-D weights the offsets are right.
    """
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, 11, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(11, OUT, bias=False))


def patch_deepspeed_views() -> None:
    """The one line of DeepSpeed 0.19.8's ZenFlow the oracle corrects, so that what it computes is its algorithm.

    Its stage 1-2 ZenFlow lays every 2-D weight out column-major in the flat buffers (``zenflow_utils.
    _flatten_dense_tensors``; the gradients go in column-major too, and its column selection reads them so), but
    ``_update_model_bit16_weights`` points the parameters at that buffer row-major: the model then computes with a
    permutation of each weight and the host update steps each element with another element's gradient (on a fixed
    batch this model at topk_ratio 0.3 reaches a loss of 0.31 after 40 steps, plain offload 0.0024; a weight of one
    row, where the two orders agree, crashes its selection instead). Here the parameters view the buffer as
    ``zenflow_utils._unflatten_dense_tensors`` does; nothing else of DeepSpeed's is touched.
    """
    from deepspeed.runtime.zero import stage_1_and_2 as s12

    def update(self: Any, group_index: int) -> None:
        flat = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(self.round_robin_bit16_groups[group_index], self.round_robin_bit16_meta[group_index],
                                   self.round_robin_bit16_offsets[group_index]):
            part = flat.narrow(0, offset, meta.numel())
            two_d = self.zenflow and len(meta.shape) == 2
            p.data = (part.view(meta.shape[1], meta.shape[0]).t() if two_d else part.view(meta.shape)).data
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            new_index = self.round_robin_bit16_indices[group_index][param_index]
            param.data = self.round_robin_bit16_groups[group_index][new_index].data

    s12.DeepSpeedZeroOptimizer._update_model_bit16_weights = update


def batch(t: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``t``'s inputs and targets for ``rank``: its rows of one global batch drawn from seed ``100 + t``."""
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(world * ROWS, IN, generator=g)
    y = torch.randn(world * ROWS, OUT, generator=g)
    return x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def config(zenflow: dict, lr: float = 1e-2) -> dict:
    """The config both sides read (DeepSpeed's keys only)."""
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 1,
        # DeepSpeed clips only the host's summed gradient, hf_zero every step's (hf_zero/zero/zenflow.py): compared
        # without clipping (DeepSpeed's default is 1.0)
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                              "zenflow": zenflow},
        "steps_per_print": 1000,
    }


def main() -> None:
    import deepspeed
    from safetensors.torch import save_file

    out_dir, cases_path = sys.argv[1], sys.argv[2]
    patch_deepspeed_views()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for case in json.loads(open(cases_path).read()):
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(case["zenflow"]))
        losses = []
        for t in range(case["steps"]):
            x, y = batch(t, world, rank)
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        if getattr(engine.optimizer, "process", None) is not None:  # overlap_step: the update in flight finishes
            engine.optimizer._wait_for_optimizer_process()
        weights = {n: p.detach().float().contiguous().clone() for n, p in engine.module.named_parameters()}
        if rank == 0:
            save_file(weights, os.path.join(out_dir, f"{case['name']}.safetensors"))
            with open(os.path.join(out_dir, f"{case['name']}.json"), "w") as f:
                json.dump({"losses": losses}, f)
        engine.destroy()


if __name__ == "__main__":
    main()
