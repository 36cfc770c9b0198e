"""``activation_checkpointing.checkpoint_blocks``: blocks are recomputed in backward, so the activation
peak falls (measured), at stages 2 and 3; the numbers stay the same (tests/test_stage3.py has the
parity cases with it on)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.distributed import spawn
from tests.memtrack import PeakBytes


def _peaks(rank: int, world: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    out = {}
    for stage in (2, 3):
        for on in (False, True):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256))
            cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
                   "activation_checkpointing": {"checkpoint_blocks": on}}
            engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
            ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(1))
            losses = []
            for step in range(2):
                if step == 1:
                    with PeakBytes() as m:
                        loss = engine(input_ids=ids, labels=ids).loss
                        engine.backward(loss)
                else:
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[f"{stage}-{on}"] = {"peak": m.peak, "losses": losses}
    return out


def test_checkpoint_blocks_lowers_the_activation_peak() -> None:
    r = spawn(_peaks, 1)[0]
    for stage in (2, 3):
        off, on = r[f"{stage}-False"], r[f"{stage}-True"]
        assert on["peak"] < 0.7 * off["peak"], (stage, on["peak"], off["peak"])
        for a, b in zip(on["losses"], off["losses"]):
            assert abs(a - b) / b < 1e-6, (stage, on["losses"], off["losses"])


def _checkpoint_calls(model: torch.nn.Module, reentrant: bool) -> None:
    """Checkpoint each decoder layer's ``__call__``, hooks included, as transformers up to 5.17 do (5.24 wraps
    ``forward``) and as model code calling ``torch.utils.checkpoint.checkpoint(layer, hidden)`` does: stage 3's
    unit hooks then run again in backward, inside the recomputation."""
    import functools

    for layer in model.model.layers:
        cls = type(layer)

        def call(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
            if self.training:
                run = functools.partial(torch.nn.Module.__call__, self, **kwargs)
                return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=reentrant)
            return torch.nn.Module.__call__(self, *args, **kwargs)

        # same class name, so that stage 3 still finds the layers through _no_split_modules
        layer.__class__ = type(cls.__name__, (cls,), {"__call__": call})


def _count_gathered(runtime: object) -> tuple[list[str], dict[str, int]]:
    """Record, after every gather (a unit's own and the prefetches all go through ``Unit.gather``), the most
    units gathered at once in the phase named by ``phase[0]``, and how often backward gathered the input embedding."""
    phase, most = ["forward"], {"forward": 0, "backward": 0, "embedding_in_backward": 0}
    for u in runtime.units:
        def gather_and_count(stream: object, _gather: Callable = u.gather, _unit: object = u) -> None:
            if phase[0] == "backward" and _unit.name.endswith("embed_tokens") and not _unit.gathered:
                most["embedding_in_backward"] += 1
            _gather(stream)
            most[phase[0]] = max(most[phase[0]], sum(v.gathered for v in runtime.units))

        u.gather = gather_and_count
    return phase, most


def _units_gathered(rank: int, world: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    out = {}
    for lora in (False, True):
        for case in ("off", "hf-False", "hf-True", "call-False", "call-True"):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                                 use_cache=False))
            kind, _, reentrant = case.partition("-")
            if kind == "hf":  # what Trainer(gradient_checkpointing=True) calls, in whichever way this transformers does it
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant == "True"})
            elif kind == "call":
                _checkpoint_calls(model, reentrant == "True")
            if lora:  # each layer: a trainable group (the adapters) and a frozen one (the rest); a frozen embedding
                model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
                if kind != "off":
                    model.enable_input_require_grads()  # as the Trainer does for a peft model under checkpointing
            # a layer holds 41,088 elements: the budget prefetches one unit ahead, so two are gathered at once
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                         "stage3_prefetch_bucket_size": 40000}}
            engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
            runtime = engine.zero_optimizer.runtime
            phase, most = _count_gathered(runtime)
            ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
            losses = []
            for _ in range(2):
                phase[0] = "forward"
                loss = engine(input_ids=ids, labels=ids).loss
                phase[0] = "backward"
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[("lora-" if lora else "") + case] = {"units": len(runtime.units), **most, "losses": losses}
    return out


def test_units_are_released_after_their_backward_with_checkpointing_and_lora() -> None:
    """With gradient checkpointing, or LoRA, no more units are gathered at once than without them, in forward
    and in backward; the losses do not change.

    When the checkpoint wraps a unit's ``__call__``, stage 3's hooks run again in the recomputation, inside
    backward. They used to treat it as a forward: prefetching in forward order re-gathered the units whose
    backward was done, and nothing released them before the end of backward, so every layer was gathered
    at the end (1.8 GiB of a 1.1B Llama in bf16). A reentrant checkpoint's forward runs without grad, and the
    units were kept gathered as in inference, every layer by the end of forward. Under LoRA, a layer's frozen
    parameters (the base weights) were released only at the end of backward, all layers of them by then,
    and backward gathered the input embedding, whose weight no backward reads.
    """
    pytest.importorskip("peft")
    r = spawn(_units_gathered, 2)[0]
    off = r["off"]
    assert off["units"] == 7 and off["forward"] <= 2 and off["backward"] <= 2, off  # 6 layers + the input embedding
    # No backward reads the input embedding's weight (its gradient is a scatter by the token ids): gathering it
    # there cost an all-gather per step and held it at the end of backward, trainable or frozen (LoRA), also when
    # enable_input_require_grads makes a frozen one's output require grad (checkpointing on).
    for case, got in r.items():
        assert got["embedding_in_backward"] == 0, (case, got)
    for case, got in r.items():
        assert got["forward"] <= off["forward"] and got["backward"] <= off["backward"], (case, got, off)
        same = r["lora-off" if case.startswith("lora") else "off"]["losses"]
        for a, b in zip(got["losses"], same):
            assert abs(a - b) / b < 1e-6, (case, got["losses"], same)
