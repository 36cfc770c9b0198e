"""DeepSpeed's AutoTP training on the CPU, the oracle of tests/test_tensor_parallel.py; run with DeepSpeed's interpreter.

    python -m torch.distributed.run --nproc-per-node 2 tests/ds_oracle_autotp.py OUT.json

(``tests/dsenv.py:run_torchrun`` starts it.) For each case of :data:`CASES` it builds the same Llama as the
test (:func:`tests.test_tensor_parallel._llama`'s shape, seed 0), trains it through ``deepspeed.initialize`` with
``"tensor_parallel": {"autotp_size": 2}`` for :data:`STEPS` steps on the same batches, and rank 0 writes every
step's loss. Nothing but torch, transformers and deepspeed is imported.
"""

from __future__ import annotations

import json
import os
import sys

import torch

STEPS, MICRO, SEQ, VOCAB = 3, 2, 24, 80
CASES = [
    {"name": "z1_fp32_clip", "stage": 1, "dtype": "fp32", "gas": 1, "clip": 0.5},
    {"name": "z2_fp32_gas2", "stage": 2, "dtype": "fp32", "gas": 2, "clip": 0.0},
    {"name": "z2_bf16", "stage": 2, "dtype": "bf16", "gas": 1, "clip": 1.0},
]


def config(case: dict) -> dict:
    """The DeepSpeed config of a case (hf_zero reads the same one)."""
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": case["gas"],
            "gradient_clipping": case["clip"], "zero_optimization": {"stage": case["stage"]},
            "bf16": {"enabled": case["dtype"] == "bf16"}, "tensor_parallel": {"autotp_size": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-4, "weight_decay": 0.01}},
            "steps_per_print": 1000}


def model():  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_bias=True))


def batches(gas: int) -> torch.Tensor:
    """``[step, micro-step]`` batches of token ids; every rank of the (single) tp group takes the same ones."""
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (STEPS, gas, MICRO, SEQ), generator=g)


def train(engine, gas: int) -> list[float]:  # noqa: ANN001
    """Each step's loss (the mean over its ``gas`` micro-steps) of a DeepSpeed-shaped engine on :func:`batches`:
    the same loop for DeepSpeed's engine here and hf_zero's in tests/test_tensor_parallel.py."""
    ids = batches(gas)
    losses = []
    for t in range(STEPS):
        total = 0.0
        for k in range(gas):
            loss = engine(input_ids=ids[t, k], labels=ids[t, k]).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
    return losses


def main(out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for case in CASES:
        cfg = config(case)
        cfg["optimizer"]["params"]["torch_adam"] = True  # torch's AdamW, as hf_zero steps (no compiled op on the CPU)
        m = model()
        engine, _, _, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        result[case["name"]] = train(engine, case["gas"])
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    # every rank has passed the barrier after rank 0 wrote the result: leave here, without freeing the engines or
    # gloo's C++ teardown, which aborted a rank now and then ("terminate called without an active exception", as
    # tests/distributed.py says)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
