"""The CPU test suite's arithmetic oracles, run with NCCL on GPUs, at any world size.

    torchrun --nproc_per_node 4 tests/gpu/gpu_check.py
    torchrun --nproc_per_node 1 tests/gpu/gpu_check.py --only overlap_param_gather   # one suite (comma-separated names)
    torchrun --nproc_per_node 3 tests/gpu/gpu_check.py --cpu                         # the same code on gloo CPU ranks

Each rank trains on its GPU (NCCL collectives, side streams); the single-process oracle runs on
the CPU. Every suite sizes its data, batches and parallel layouts from the world size. Prints one
line per case with the largest relative loss and weight errors, and exits non-zero if any exceeds
the tolerance. ``--cpu`` (or a machine without CUDA) runs the same suites on gloo CPU ranks, so a
change to it can be tried where there is no GPU; it hides the GPUs before torch is imported.

A suite is a function ``(rank, world) -> rows`` in :data:`suites`; a row is a dict with ``case``,
``loss_err`` and ``w_err`` (and optionally ``tol``, ``w_tol``). Another suite is one line there.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

if "--cpu" in sys.argv:  # before torch is imported: no rank may see a GPU, so every engine and helper picks the CPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# the repository root (two folders up), so that ``tests`` imports as a package under torchrun
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import (  # noqa: E402
    test_async_checkpoint,
    test_checkpoint,
    test_compile,
    test_ds_api,
    test_eval_memory,
    test_nvme,
    test_offload,
    test_offload_overlap,
    test_overlap_param_gather,
    test_parity,
    test_released_params,
    test_stage3,
    test_tensor_parallel,
    test_unit_steps,
)

TOL = 1e-5
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _resume(rank: int, world: int) -> list[dict]:
    """Checkpoint resume on GPUs: train K steps, save, build a new engine, load, train K more.

    The errors are against the uninterrupted run (0 means bit for bit); the on-disk format,
    RNG (CUDA generator included) and data position are what the CPU tests check in fresh
    processes.
    """
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)  # one directory for every rank
        for i, c in enumerate(test_checkpoint.CASES):
            # the loader's data for 2K steps at this world size (the CPU test's 120 samples hold 2 ranks' worth)
            c = dict(c, samples=max(test_checkpoint.N_SAMPLES, c["micro"] * c["gas"] * 2 * test_checkpoint.K * world))
            d = os.path.join(path[0], f"c{i}")
            ref = test_checkpoint._train(rank, world, dict(c, until=2 * test_checkpoint.K))
            test_checkpoint._train(rank, world, dict(c, until=test_checkpoint.K, save_at=test_checkpoint.K, dir=d))
            got = test_checkpoint._train(rank, world, dict(c, until=2 * test_checkpoint.K, load=True, dir=d))
            loss_err = max(abs(got["losses"][s] - v) / abs(v) for s, v in ref["losses"].items() if s > test_checkpoint.K)
            w_err = max(
                float((torch.tensor(got["weights"][n]) - torch.tensor(w)).norm() / torch.tensor(w).norm())
                for n, w in ref["weights"].items()
            )
            rows.append({"case": {k: v for k, v in c.items() if k != "samples"}, "loss_err": loss_err, "w_err": w_err})
        dist.barrier()
    return rows


def _async_save(rank: int, world: int) -> list[dict]:
    """``checkpoint.async_save`` from GPU shards: the background save writes the bytes a synchronous one writes.

    On the CPU the shards are host tensors already; here the snapshot copies device shards into pinned host
    buffers on a side stream before training goes on. Reported as the count of files that differ (0 passes).
    """
    import tempfile
    import time

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)
        for stage in (2, 3):
            engine = test_async_checkpoint._engine(stage)
            for t in range(2):
                test_async_checkpoint._step(engine, t)
            engine.config.checkpoint_async_save = False
            engine.save_checkpoint(os.path.join(path[0], f"sync{stage}"))
            engine.config.checkpoint_async_save = True
            t0 = time.perf_counter()
            engine.save_checkpoint(os.path.join(path[0], f"async{stage}"))
            returned = time.perf_counter() - t0
            test_async_checkpoint._step(engine, 2)  # training goes on while the write is in flight
            engine.wait_for_checkpoint()
            dist.barrier()
            from pathlib import Path

            differ = test_async_checkpoint._same_files(Path(path[0], f"sync{stage}", "global_step2"),
                                                       Path(path[0], f"async{stage}", "global_step2"))
            rows.append({"case": f"stage {stage}: files unlike the synchronous save's (save returned in {returned:.3f} s)",
                         "loss_err": float(len(differ)), "w_err": 0.0, "tol": 0.5})
            engine.destroy()
        # The random streams every time: a fresh engine (its first background save builds the writers' group and
        # pins its host buffers), then RNG_PAIRS sync/async pairs, each after draws from every stream (CUDA's too).
        # Counted: pairs whose stored streams differ, and pairs after which the run's streams are not those stored.
        for stage in (2, 3):
            r = test_async_checkpoint._rng_pairs(rank, world, os.path.join(path[0], f"rng{stage}"), stage, False)
            rows.append({"case": f"stage {stage}: of {test_async_checkpoint.RNG_PAIRS} pairs, RNG streams unlike the "
                                 f"synchronous save's ({', '.join(r['streams'])}); after which the run's streams moved",
                         "loss_err": float(len(r["differ"])), "w_err": float(len(r["moved"])), "tol": 0.5})
            if r["differ"] or r["moved"]:
                print(f"rank {rank} async checkpoint stage {stage}: streams differ {r['differ'][:4]}, moved {r['moved'][:4]}",
                      flush=True)
        from hf_zero.checkpoint import save as save_module

        if save_module._moved_warned:  # put back, and warned about, by save(): which stream a call in the save drew from
            print(f"rank {rank} async checkpoint: a save moved {sorted(save_module._moved_warned)}", flush=True)
        dist.barrier()
    return rows


def _compiled(rank: int, world: int) -> list[dict]:
    """``engine.compile()`` with inductor (Triton kernels) against the eager engine, stages 0-3."""
    eager, compiled = test_compile._train(rank, world, "eager"), test_compile._train(rank, world, "inductor")
    rows = []
    for case, e in eager.items():
        c = compiled[case]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(c["losses"], e["losses"]))
        w_err = max(float((torch.tensor(c["weights"][n]) - torch.tensor(w)).norm() / torch.tensor(w).norm())
                    for n, w in e["weights"].items())
        # Inductor fuses and reorders fp32 reductions: equal to rounding, not bit for bit. The weights get a wider
        # bound than the losses: Adam (lr 1e-2) turns a last-bit difference in a gradient element near zero into a
        # step of up to 2 lr for that element, which measured 1.0e-4 to 1.2e-4 of a weight's norm on one H200
        # (sessions 8 and 10) while the losses stayed within 2e-7.
        rows.append({"case": f"stage-ckpt {case}, {c['graphs']} graph(s)", "loss_err": loss_err, "w_err": w_err,
                     "tol": 1e-4, "w_tol": 1e-3})
    return rows


def _ds_api(rank: int, world: int) -> list[dict]:
    """tests/test_ds_api.py's DeepSpeed-shaped script on the GPUs: get_accelerator() says cuda, FusedAdam runs
    torch's fused kernel on the shards, checkpointing recomputes (with cpu_checkpointing: pinned host copies)."""
    import tempfile

    root = os.path.join(tempfile.gettempdir(), f"hf_zero_gpu_check_ds_api_{world}")
    os.makedirs(root, exist_ok=True)
    ref_losses, ref_w = test_ds_api._oracle(world)
    rows = []
    for cpu_ckpt in (False, True):
        r = test_ds_api._script(rank, world, root, cpu_ckpt)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses))
        w_err = max(float((torch.tensor(w) - ref_w[n].reshape(-1)).norm() / ref_w[n].norm()) for n, w in r["weights"].items())
        # on GPUs torch's fused Adam kernel runs on the shards; the CPU run checks the rest
        ok = (r["device"], r["backend"]) == ((DEVICE, "nccl") if ON_GPU else (DEVICE, "gloo")) and r["state_equal"]
        ok = ok and (r["fused_kernel"] or not ON_GPU)
        rows.append({"case": f"FusedAdam+checkpointing.checkpoint, cpu_checkpointing={cpu_ckpt}, fused={r['fused_kernel']}",
                     "loss_err": loss_err, "w_err": w_err if ok else float("inf")})
    return rows


def _offload(rank: int, world: int) -> list[dict]:
    """Optimizer offload (stages 1-3) and stage 3's parameter offload on GPUs, where host and device differ: pinned
    copies on the side streams, the H2D copy before each all-gather. Errors against the same run without offload."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)
        opt_cases = [c for c in test_offload.CASES if not c[3]]  # fp16 is the CPU suite's (kernels round differently)
        grid = test_offload._grid(rank, world, opt_cases, os.path.join(path[0], "opt"))
        for case, row in zip(opt_cases, grid):
            w = max(test_offload._rel(row["off"]["weights"][n], row["on"]["weights"][n]) for n in row["on"]["weights"])
            rows.append({"case": f"offload_optimizer stage {case[0]}, gas {case[1]}, clip {case[2]}",
                         "loss_err": test_offload._rel(row["off"]["losses"], row["on"]["losses"]), "w_err": w})
        for case, row in zip(test_offload.PARAM_CASES, test_offload._param_grid(rank, world, test_offload.PARAM_CASES,
                                                                                   os.path.join(path[0], "param"))):
            ok = all(row["check"][k] for k in ("frozen_offloaded", "all_on_host", "host_tensors"))
            w = max(test_offload._rel(row["off"]["weights"][n], row["on"]["weights"][n]) for n in row["on"]["weights"])
            rows.append({"case": f"stage 3 {case[0]}, gas {case[1]}, frozen {case[3]}",
                         "loss_err": test_offload._rel(row["off"]["losses"], row["on"]["losses"]) if ok else 1.0, "w_err": w})
        # Host memory made short of a gradient copy: the gradients stream from the GPU through two pinned buffers on the
        # side stream (events, asynchronous copies); errors against the same offload with a copy per group.
        streamed = test_offload._streamed_gradients(rank, world)
        for stage in ("2", "3"):
            copy, got = streamed[stage]["copy"], streamed[stage]["streamed"]
            ok = got["streamed"] and got["host_grads"] == 0 and got["buffers"] == 2 and not copy["streamed"]
            w = max(test_offload._rel(got["weights"][n], copy["weights"][n]) for n in copy["weights"])
            rows.append({"case": f"offload_optimizer stage {stage}, gradients streamed, gas 2, clip 0.5",
                         "loss_err": test_offload._rel(got["losses"], copy["losses"]) if ok else 1.0, "w_err": w})
        dist.barrier()
    return rows


def _tensor_parallel(rank: int, world: int) -> list[dict]:
    """Tensor and sequence parallelism in every layout the world size allows, ZeRO over what is left as data parallel.

    tp d x dp world/d for every degree d from 2 to 8 that divides the world, each on a model sized so that d splits it
    evenly (``test_tensor_parallel.heads_for``: the suite's 4 heads at 2, else 2 d heads, d key/value heads): at d 2 the
    forward and backward all-reduces inside the blocks at ZeRO 0-3 (on 2 ranks also the resume, save_pretrained and
    consolidate rows, on 4 the ZeRO-3 resume and tp 2 x sp 2); then Ulysses sp = world alone (8 heads, 4 key/value,
    where sp divides them; else 2 sp heads: ``test_tensor_parallel.sp_heads_for``). One rank has no such layout: the
    suite says so and has no rows."""
    import tempfile

    if world < 2:
        if rank == 0:
            print("tensor parallel: no layout at world size 1 (tp and sp need 2 ranks or more)")
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)
        for tp in (t for t in range(2, 9) if world % t == 0):
            cases = (test_tensor_parallel.CASES_2 if world == 2 else test_tensor_parallel.CASES_4) if tp == 2 else \
                [[1, 1, 0.5], [3, 2, 0.0]]
            grid = test_tensor_parallel._grid(rank, world, cases, os.path.join(path[0], f"tp{tp}"), tp)
            for case, row in zip(cases, grid):
                ok = row["dp"] == world // tp
                rows.append({"case": f"tp {tp} x dp {world // tp}, stage {case[0]}, gas {case[1]}, clip {case[2]}",
                             "loss_err": row["loss_err"] if ok else float("inf"), "w_err": row["w_err"]})
            extra = grid[len(cases):]
            if tp == 2 and world == 2:
                res = extra[0]
                rows.append({"case": "tp 2: resume at stage 1, save_pretrained", "loss_err": res["resume_loss_err"],
                             "w_err": max(res["resume_w_err"], res["saved_err"], res["offline_err"])})
            if tp == 2 and world == 4:
                z3, tp_sp = extra
                rows.append({"case": "tp 2 x ZeRO-3 dp 2: resume at stages 3 and 1, save_pretrained, consolidate",
                             "loss_err": max(z3["resume3_loss_err"], z3["resume1_loss_err"]),
                             "w_err": max(z3["resume3_w_err"], z3["resume1_w_err"], z3["saved_err"], z3["offline_err"])})
                rows += _tp_sp_rows(tp_sp, 2, 2)
        dist.barrier()
    rows += _tp_sp_rows(test_tensor_parallel._tp_times_sp(rank, world, tp=1, sp=world,
                                                          cases=[[1, 1, 0.5], [3, 2, 0.5]]), 1, world)
    return rows


def _tp_sp_rows(result: dict, tp: int, sp: int) -> list[dict]:
    """Rows of ``test_tensor_parallel._tp_times_sp``'s result; a layout other than the one asked for fails its row."""
    rows = []
    for case, r in result.items():
        ok = (r["tp"], r["sp"]) == (tp, sp)
        stage, gas, clip = json.loads(case)  # the helper's str() of a list of numbers
        layout = f"tp {tp} x sp {sp}" if tp > 1 else f"sp {sp}"
        rows.append({"case": f"{layout} (ragged, prompt-masked), stage {stage}, gas {gas}, clip {clip}",
                     "loss_err": r["loss_err"] if ok else float("inf"), "w_err": r["w_err"]})
    return rows


def _overlap(rank: int, world: int) -> list[dict]:
    """``overlap_param_gather`` with CUDA events on the communication stream: every reader right after a step (the
    next forward, state_dict, GatheredParameters, save_16bit_model, load_checkpoint) against the eager publish, and
    the forward's pre-hooks taking every group that step() left in flight (else the row fails)."""
    import tempfile

    def rel(a: list[float], b: list[float]) -> float:
        x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        return float((x - y).norm() / y.norm().clamp_min(1e-12))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)
        # "+offload": the optimizer in pinned host memory, each group's CPU step deferred to the next forward as well;
        # "+streamed": the same with the gradients streamed from the GPU at the step
        for variant in ("", "+offload", "+streamed"):
            eager = test_overlap_param_gather._run(rank, world, "eager" + variant, path[0])
            overlap = test_overlap_param_gather._run(rank, world, "overlap" + variant, path[0])
            for key, e in eager.items():
                o = overlap[key]
                n = o["groups"]
                # One CPU rank has no all-gather to defer: the publish is eager, and offloaded, the groups whose CPU
                # step the next forward runs (all but the forward's first, which step() runs) are what is left in flight.
                # On GPUs every deferred publish leaves an event to wait for, one rank too.
                left = n if world > 1 or ON_GPU else (n - 1 if variant else 0)
                hooks_waited = (o["in_flight_after_step"] == [left] * test_overlap_param_gather.STEPS
                                and o["forward_waits"] == [{"forward": left, "other": 0}]
                                and not o["pending_seen_by_modules"])
                w_err = max(rel(o[what][k], e[what][k])
                            for what in ("block_state_dict", "state_dict", "gathered", "saved") for k in e[what])
                rows.append({"case": f"{key}{variant}, {n} groups", "loss_err": rel(o["losses"] + [o["next_forward"]],
                                                                                    e["losses"] + [e["next_forward"]]),
                             "w_err": w_err if hooks_waited else float("inf")})
            dist.barrier()
    return rows


def _released(rank: int, world: int) -> list[dict]:
    """A stage-3 parameter read between gathers raises one sentence on the GPU too (no illegal memory access), and
    training after the refused reads equals an engine nobody probed."""
    r = test_released_params._reads(rank, world, f"/tmp/hf_zero_released_{rank}.pt")
    wrong = test_released_params.problems(r)
    if wrong:
        print(f"rank {rank} released parameters: {wrong}", flush=True)
    return [{"case": f"{len(r['errors'])} reads refused, training unchanged", "loss_err": 0.0 if not wrong else float("inf"),
             "w_err": 0.0 if not wrong else float("inf")}]


def _inference(rank: int, world: int) -> list[dict]:
    """A ZeRO-3 engine without an optimizer (DeepSpeed's ZeRO-Inference) on GPUs, its model left trainable: sharded
    between forwards, frozen, the whole model's logits; and save_16bit_model under DeepSpeed's file name writes the
    whole weights (a pickle, as DeepSpeed does). Errors against a whole copy of the model on this GPU."""
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zero

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=320, n_positions=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    whole = GPT2LMHeadModel(cfg).eval()
    whole.load_state_dict(model.state_dict())
    whole.to(DEVICE)
    engine, optimizer, _, _ = hf_zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.eval()
    ids = torch.arange(16, device=DEVICE).reshape(1, 16) % cfg.vocab_size
    with torch.no_grad():
        got, want = engine(input_ids=ids).logits, whole(input_ids=ids).logits
    logits_err = float((got - want).norm() / want.norm())
    held = sum(p.untyped_storage().nbytes() for p in model.parameters())
    ok = optimizer is None and not any(p.requires_grad for p in model.parameters()) and (held == 0 or world == 1)
    folder = os.path.join(tempfile.gettempdir(), f"hf_zero_gpu_check_inference_{world}")
    engine.save_16bit_model(folder, "pytorch_model.bin")
    bin_err = 0.0
    if rank == 0:
        saved, ref = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True), whole.state_dict()
        bin_err = (max(float((saved[k].float() - ref[k].float().cpu()).norm() / ref[k].float().norm().clamp_min(1e-12))
                       for k in ref) if saved.keys() == ref.keys() else float("inf"))
    if not ok:
        print(f"rank {rank} optimizer-free ZeRO-3: optimizer {optimizer!r}, {held} bytes held between forwards", flush=True)
    return [{"case": "GPT-2 (tied), no optimizer: logits; pytorch_model.bin weights", "loss_err": logits_err if ok else float("inf"),
             "w_err": bin_err}]


#: The suites, in the order they run: name -> (rank, world) -> rows. A suite from elsewhere is one more line here
#: (e.g. ``"eval memory": test_eval_memory.gpu_suite,``); ``--only`` takes these names.
suites: dict[str, Callable[[int, int], list[dict]]] = {
    "stages 0-2": lambda rank, world: test_parity._run_grid(rank, world, test_parity.CASES),
    "stage 3": lambda rank, world: test_stage3._grid(rank, world, test_stage3.CASES),
    "resume": _resume,
    "async checkpoint": _async_save,
    "compile (inductor)": _compiled,
    "DeepSpeed API": _ds_api,
    "offload": _offload,
    "super_offload": test_offload_overlap.gpu_suite,
    "unit steps": test_unit_steps.gpu_suite,
    "tensor parallel": _tensor_parallel,
    "overlap_param_gather": _overlap,
    "released parameters": _released,
    "optimizer-free ZeRO-3": _inference,
    "NVMe offload": test_nvme.gpu_suite,
    "eval memory": test_eval_memory.gpu_suite,
}


def main() -> int:
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv[:-1] else list(suites)
    unknown = [name for name in only if name not in suites]
    if unknown:
        raise SystemExit(f"--only {unknown[0]!r}: not a suite; choose from {', '.join(suites)}")
    if ON_GPU:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if ON_GPU else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        where = f"NCCL parity on {world} x {torch.cuda.get_device_name()}" if ON_GPU else f"gloo parity on {world} CPU ranks"
        print(f"{where}, torch {torch.__version__}, tolerance {TOL:g} "
              "(inductor, which reorders fp32 sums: 1e-4 on losses, 1e-3 on weights)")
        print("| suite | case (stage/model, accumulation, clip[, scheduler]) | max rel. loss err | max rel. weight err | |")
        print("|---|---|---|---|---|", flush=True)
    passed = failed = 0
    for name in only:
        # Each suite's rows are printed as soon as it ends, and a suite that raises is one FAIL row (its error
        # printed by the ranks that raised), so one broken suite neither hides the others' results nor stops them.
        try:
            rows, error = suites[name](rank, world), ""
        except Exception as e:  # noqa: BLE001 - reported as the suite's failure, the run goes on
            rows, error = [], f"{type(e).__name__}: {e}"
            print(f"rank {rank} {name}: raised {error}", flush=True)
        agree = torch.tensor([len(rows), -len(rows), 1 if error else 0], device=DEVICE, dtype=torch.int64)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)
        if agree[2] or int(agree[0]) != -int(agree[1]):  # a rank raised, or the ranks' rows differ in number
            failed += 1
            if rank == 0:
                why = "raised on a rank (above)" if agree[2] else "the ranks returned different numbers of rows"
                print(f"| {name} | {why} | | | FAIL |", flush=True)
            continue
        worst = torch.tensor([[r["loss_err"], r["w_err"]] for r in rows], device=DEVICE, dtype=torch.float64).reshape(-1, 2)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        for r, (lw, ww) in zip(rows, worst.tolist()):
            ok = lw < r.get("tol", TOL) and ww < r.get("w_tol", r.get("tol", TOL))
            passed += ok
            failed += not ok
            if rank == 0:
                print(f"| {name} | {r['case']} | {lw:.2e} | {ww:.2e} | {'ok' if ok else 'FAIL'} |", flush=True)
    if rank == 0:
        print(f"{passed} passed, {failed} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
