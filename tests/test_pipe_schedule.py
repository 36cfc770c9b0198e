"""The pipeline schedules as data: ordering, matching, memory, and freedom from deadlock (no processes)."""

from __future__ import annotations

import itertools

import pytest

from hf_zero.pipe import schedule as S

GRID = list(itertools.product(["1f1b", "gpipe"], [1, 2, 3, 4], [1, 2, 4, 8]))


def _all(name: str, stages: int, m: int) -> list[list[S.Action]]:
    return [S.build(name, stages, s, m) for s in range(stages)]


@pytest.mark.parametrize("name,stages,m", GRID)
def test_every_micro_batch_forward_once_then_backward_once(name: str, stages: int, m: int) -> None:
    for acts in _all(name, stages, m):
        fwd = [a.micro for a in acts if isinstance(a, S.Forward)]
        bwd = [a.micro for a in acts if isinstance(a, S.Backward)]
        assert sorted(fwd) == sorted(bwd) == list(range(m))
        for i in range(m):
            assert acts.index(S.Forward(i)) < acts.index(S.Backward(i))
        assert acts[-2:] == [S.ReduceGrads(), S.OptimizerStep()]  # the step comes after every backward


@pytest.mark.parametrize("name,stages,m", GRID)
def test_sends_are_matched_by_the_neighbours_receives_in_order(name: str, stages: int, m: int) -> None:
    sched = _all(name, stages, m)
    for s in range(stages - 1):
        sent_act = [a.micro for a in sched[s] if isinstance(a, S.SendActivation)]
        recv_act = [a.micro for a in sched[s + 1] if isinstance(a, S.RecvActivation)]
        sent_grad = [a.micro for a in sched[s + 1] if isinstance(a, S.SendGrad)]
        recv_grad = [a.micro for a in sched[s] if isinstance(a, S.RecvGrad)]
        assert sent_act == recv_act == list(range(m))
        assert sent_grad == recv_grad
        assert sorted(sent_grad) == list(range(m))
    assert not any(isinstance(a, (S.RecvActivation, S.SendGrad)) for a in sched[0])
    assert not any(isinstance(a, (S.SendActivation, S.RecvGrad)) for a in sched[-1])


@pytest.mark.parametrize("name,stages,m", GRID)
def test_data_is_loaded_where_it_is_used(name: str, stages: int, m: int) -> None:
    for s, acts in enumerate(_all(name, stages, m)):
        loads = [a.micro for a in acts if isinstance(a, S.LoadMicroBatch)]
        assert loads == (list(range(m)) if s in (0, stages - 1) else [])
        for i in loads:
            assert acts.index(S.LoadMicroBatch(i)) < acts.index(S.Forward(i))
        for i in range(m):  # a forward's input arrives before it runs; a backward's gradient too
            if s > 0:
                assert acts.index(S.RecvActivation(i)) < acts.index(S.Forward(i))
            if s < stages - 1:
                assert acts.index(S.RecvGrad(i)) < acts.index(S.Backward(i))


@pytest.mark.parametrize("stages,m", [(p, m) for _, p, m in GRID if _ == "1f1b"])
def test_1f1b_keeps_at_most_stages_minus_stage_id_activations(stages: int, m: int) -> None:
    for s, acts in enumerate(_all("1f1b", stages, m)):
        assert S.max_live_activations(acts) == min(stages - s, m)


@pytest.mark.parametrize("stages,m", [(p, m) for _, p, m in GRID if _ == "gpipe"])
def test_gpipe_keeps_every_micro_batch(stages: int, m: int) -> None:
    for acts in _all("gpipe", stages, m):
        assert S.max_live_activations(acts) == m


@pytest.mark.parametrize("name,stages,m", GRID)
def test_no_deadlock_under_nccl_rendezvous(name: str, stages: int, m: int) -> None:
    S.simulate(_all(name, stages, m))


def test_1f1b_steady_state_pairs_each_send_with_the_opposite_receive() -> None:
    """Stage 1 of 4 with 6 micro-batches, as the 1F1B picture draws it; the pairs become one exchange."""
    acts = S.one_f_one_b(4, 1, 6)
    text = " ".join(str(a) for a in acts)
    assert text.startswith(
        "RecvActivation(0) Forward(0) SendActivation(0) RecvActivation(1) Forward(1) SendActivation(1) "
        "RecvActivation(2) Forward(2) SendActivation(2) RecvGrad(0) Backward(0) SendGrad(0) RecvActivation(3) Forward(3)"
    )
    steps = S.exchanges(acts, 1)
    assert [S.SendActivation(2), S.RecvGrad(0)] in steps  # same neighbour (stage 2): posted together
    assert [S.SendGrad(0), S.RecvActivation(3)] in steps  # same neighbour (stage 0)
    assert [S.SendActivation(0)] in steps and [S.RecvActivation(1)] in steps  # different neighbours: apart


def test_simulator_catches_a_deadlock() -> None:
    """Both neighbours receive before sending: each waits for the other forever."""
    bad = [[S.RecvGrad(0), S.Forward(0), S.SendActivation(0)], [S.RecvActivation(0), S.Forward(0), S.SendGrad(0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        S.simulate(bad)


def test_inference_is_forwards_only_and_bad_arguments_say_so() -> None:
    acts = S.inference(3, 1, 2)
    assert [str(a) for a in acts] == ["RecvActivation(0)", "Forward(0)", "SendActivation(0)",
                                      "RecvActivation(1)", "Forward(1)", "SendActivation(1)"]
    with pytest.raises(ValueError, match="pipeline schedule: got 'zigzag'"):
        S.build("zigzag", 2, 0, 4)
    with pytest.raises(ValueError, match="stage_id 2"):
        S.one_f_one_b(2, 2, 4)


def test_pipe_is_reachable_as_deepspeed_pipe() -> None:
    """``import hf_zero as deepspeed; deepspeed.pipe.PipelineModule`` works without importing hf_zero.pipe first."""
    import subprocess
    import sys

    code = "import hf_zero as deepspeed; print(deepspeed.pipe.PipelineModule.__name__, deepspeed.pipe.LayerSpec.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["PipelineModule", "LayerSpec"], out.stderr[-2000:]


def test_compute_partition_gives_the_lm_head_stage_fewer_blocks() -> None:
    """``"compute"`` (split_causal_lm's default) weighs embedding lookups as free and the LM head
    by its weights: on the 1.1B Llama shape the head (65.5M weights, ~1.5 blocks) costs the last
    stage blocks, where equal blocks per stage made it the slowest and left stage 0 waiting."""
    from transformers import GPT2Config, LlamaConfig

    from hf_zero.pipe.hf import causal_lm_layers
    from hf_zero.pipe.module import _compute_weights, partition_balanced

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4)
    layers, _, _ = causal_lm_layers(cfg)
    w = _compute_weights(layers)
    block = w[1]
    assert w[0] == 0 and w[-1] == 32000 * 2048 and all(x == block for x in w[1:23])
    assert partition_balanced(w, 2) == [0, 13, 25]  # 12 blocks | 10 blocks + norm + head
    assert partition_balanced(w, 4) == [0, 7, 13, 19, 25]  # 6 | 6 | 6 | 4 + head
    # tied GPT-2: the first use of wte is a lookup (free), the second is the head (a matmul); wpe is free
    gcfg = GPT2Config(vocab_size=500, n_embd=64, n_layer=4, n_head=4, tie_word_embeddings=True)
    glayers, _, _ = causal_lm_layers(gcfg)
    gw = _compute_weights(glayers)
    assert gw[0] == 0 and gw[1] == 0 and gw[-1] == 500 * 64 and gw[2] > 0
