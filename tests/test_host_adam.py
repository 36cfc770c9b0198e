"""``hf_zero/optim/host_adam.py``: the one-pass host Adam kernel equals torch's fused kernel bit for bit.

The oracle is the installed torch's own ``torch._fused_adamw_`` / ``torch._fused_adam_`` (what
``torch.optim.AdamW(fused=True)`` runs on CPU tensors), fed the same tensors (a bf16 gradient: fed
``grad.float()``), over five consecutive steps on random data, at sizes with and without a tail past the
last 16-element block. Then what the offload engine relies on: ``out16`` is exactly ``param.to(dtype)``
(NaN, inf, ties and subnormals included), ``backup`` is exactly the state before the step, one and two
threads agree, and an unavailable kernel (disabled, not x86, a failed build) is a False from
``available()`` and the same update through torch, never an exception.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_zero.optim import host_adam

pytestmark = pytest.mark.unit

SIZES = [1, 15, 16, 17, 1000, 65537, 1_000_003]
STEPS = 5
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kernel() -> None:
    """Skip the kernel's own tests, saying why, where the extension cannot be built here."""
    if not host_adam.available():
        pytest.skip(f"host_adam kernel unavailable on this machine: {host_adam.unavailable_reason()}")


def _state(n: int, seed: int) -> list[torch.Tensor]:
    """Random master and moments (never zeros: a zero state hides rounding differences)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4 + 1e-9]


def _grad(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 1e-2).to(dtype)


def _reference(state: list[torch.Tensor], grad: torch.Tensor, step: int, adamw: bool, **hyper: float) -> None:
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    kernel([state[0]], [grad.float()], [state[1]], [state[2]], [], [torch.tensor(float(step))], amsgrad=False, **hyper)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (_bits(got) != _bits(want)).nonzero().flatten()
    assert diff.numel() == 0, (f"{what}: {diff.numel()} of {got.numel()} elements differ, first at {diff[:5].tolist()}: "
                               f"{got[diff[:3]].tolist()} vs {want[diff[:3]].tolist()}")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32_grad", "bf16_grad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01], ids=["wd0", "wd0.01"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("n", SIZES)
def test_bit_identical_to_torch_fused(kernel: None, n: int, adamw: bool, weight_decay: float, maximize: bool,
                                      grad_dtype: torch.dtype) -> None:
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, maximize=maximize)
    ours = _state(n, seed=n)
    ref = [t.clone() for t in ours]
    for step in range(1, STEPS + 1):
        grad = _grad(n, seed=1000 * n + step, dtype=grad_dtype)
        host_adam.adam_step(*ours[:1], grad, *ours[1:], step, adamw=adamw, **hyper)
        _reference(ref, grad, step, adamw, **hyper)
        for got, want, what in zip(ours, ref, ("param", "exp_avg", "exp_avg_sq")):
            _assert_same_bits(got, want, f"{what} after step {step}")


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("n", [16, 1000, 65537])
def test_bit_identical_with_large_lerp_weight(kernel: None, n: int, adamw: bool) -> None:
    """beta1 = 0.3: exp_avg's lerp weight 0.7 takes torch's other branch (from the gradient, weight - 1)."""
    hyper = dict(lr=3e-3, beta1=0.3, beta2=0.95, eps=1e-6, weight_decay=0.1, maximize=False)
    ours = _state(n, seed=7)
    ref = [t.clone() for t in ours]
    for step in range(1, STEPS + 1):
        grad = _grad(n, seed=step, dtype=torch.float32)
        host_adam.adam_step(ours[0], grad, ours[1], ours[2], step, adamw=adamw, **hyper)
        _reference(ref, grad, step, adamw, **hyper)
    for got, want, what in zip(ours, ref, ("param", "exp_avg", "exp_avg_sq")):
        _assert_same_bits(got, want, what)


def _special_floats(n: int) -> torch.Tensor:
    """Random bit patterns (every class of float, NaNs with payloads included) plus exact rounding ties."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    specials = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 1e-45, 3.4e38,
                65504.0, 65520.0, 65519.0, 6e-8, 2.9e-8, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11]
    x[: len(specials)] = torch.tensor(specials)
    ties = torch.arange(len(specials), min(n, len(specials) + 64))
    x[ties] = (bits[ties] & ~0xFFFF | 0x8000).view(torch.float32)  # halfway between two bf16 values
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [32, 1000, 4099, 65537])
def test_out16_is_the_cast_of_the_updated_param(kernel: None, n: int, dtype: torch.dtype) -> None:
    """Random steps, then lr = 0 steps over arbitrary bit patterns (the param stays as it is: NaN, inf, ties)."""
    state = _state(n, seed=11)
    out = torch.empty(n, dtype=dtype)
    for step in range(1, 3):
        host_adam.adam_step(state[0], _grad(n, step, torch.bfloat16), state[1], state[2], step, lr=1e-2, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True, out16=out)
        _assert_same_bits(out, state[0].to(dtype), f"out16 after step {step}")
    state[0].copy_(_special_floats(n))
    host_adam.adam_step(state[0], _grad(n, 9, torch.float32), state[1], state[2], 3, lr=0.0, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0, adamw=True, out16=out)
    assert state[0].isnan().any() and state[0].isinf().any()
    _assert_same_bits(out, state[0].to(dtype), "out16 of special values")


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("n", [17, 1000, 65537, 1_000_003])
def test_backup_holds_the_state_before_the_step(kernel: None, n: int, offset: int) -> None:
    """Aligned buffers take the streaming stores, buffers one element off the plain ones: both exact."""
    state = _state(n, seed=5)
    ref = [t.clone() for t in state]
    store = [torch.empty(n + offset) for _ in range(3)]
    backup = tuple(s[offset:] for s in store)
    out = torch.empty(n + offset, dtype=torch.bfloat16)[offset:]
    for step in range(1, 4):
        before = [t.clone() for t in state]
        grad = _grad(n, step, torch.bfloat16)
        host_adam.adam_step(state[0], grad, state[1], state[2], step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.01, adamw=True, out16=out, backup=backup)  # type: ignore[arg-type]
        _reference(ref, grad, step, True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False)
        for got, want, what in zip(backup, before, ("param", "exp_avg", "exp_avg_sq")):
            _assert_same_bits(got, want, f"backup of {what} at step {step}")
        for got, want, what in zip(state, ref, ("param", "exp_avg", "exp_avg_sq")):
            _assert_same_bits(got, want, f"{what} after step {step}")
        _assert_same_bits(out, state[0].to(torch.bfloat16), f"out16 at step {step}")


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("n", [17, 1000, 65537, 1_000_003])
def test_out_of_place_leaves_the_inputs_and_writes_the_step(kernel: None, n: int, offset: int) -> None:
    """``out``: the step's results in three other buffers, bit for bit the in-place step's, the inputs untouched; the
    buffers then swapped (what a kept speculative step does) and stepped again, so each buffer is input and output."""
    state = _state(n, seed=6)
    ref = [t.clone() for t in state]
    other = [torch.empty(n + offset)[offset:] for _ in range(3)]
    out16 = torch.empty(n + offset, dtype=torch.bfloat16)[offset:]
    for step in range(1, 4):
        before = [t.clone() for t in state]
        grad = _grad(n, step, torch.bfloat16 if step % 2 else torch.float32)
        host_adam.adam_step(state[0], grad, state[1], state[2], step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.01, adamw=step != 2, out16=out16, out=tuple(other))  # type: ignore[arg-type]
        _reference(ref, grad, step, step != 2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                   maximize=False)
        for got, want, what in zip(state, before, ("param", "exp_avg", "exp_avg_sq")):
            _assert_same_bits(got, want, f"{what} left as it was at step {step}")
        for got, want, what in zip(other, ref, ("param", "exp_avg", "exp_avg_sq")):
            _assert_same_bits(got, want, f"{what} written out at step {step}")
        _assert_same_bits(out16, ref[0].to(torch.bfloat16), f"out16 at step {step}")
        state, other = other, state


def _grid_matches() -> None:
    """A compact version of the tests above, for a build of another ISA in its own process."""
    hyper = dict(lr=1e-3, beta2=0.999, eps=1e-8)
    for n, adamw, wd, maximize, beta1, grad_dtype, dtype in [
            (1000, True, 0.01, False, 0.9, torch.float32, torch.bfloat16), (65537, False, 0.01, True, 0.9, torch.bfloat16, torch.float16),
            (17, False, 0.0, False, 0.3, torch.float32, torch.bfloat16), (4099, True, 0.0, True, 0.3, torch.bfloat16, torch.float16)]:
        ours = _state(n, seed=n)
        ref = [t.clone() for t in ours]
        out, backup = torch.empty(n, dtype=dtype), tuple(torch.empty(n) for _ in range(3))
        for step in range(1, STEPS + 1):
            grad = _grad(n, seed=step, dtype=grad_dtype)
            before = [t.clone() for t in ours]
            host_adam.adam_step(ours[0], grad, ours[1], ours[2], step, adamw=adamw, weight_decay=wd, maximize=maximize,
                                beta1=beta1, out16=out, backup=backup, **hyper)
            _reference(ref, grad, step, adamw, weight_decay=wd, maximize=maximize, beta1=beta1, **hyper)
            for got, want in zip([*ours, out, *backup], [*ref, ref[0].to(dtype), *before]):
                _assert_same_bits(got, want, f"n={n} adamw={adamw} wd={wd} maximize={maximize} step {step}")
            after = tuple(torch.empty(n) for _ in range(3))  # the same step again out of place, from the backup
            host_adam.adam_step(backup[0], grad, backup[1], backup[2], step, adamw=adamw, weight_decay=wd,
                                maximize=maximize, beta1=beta1, out=after, **hyper)
            for got, want in zip([*after, *backup], [*ref, *before]):
                _assert_same_bits(got, want, f"out of place: n={n} adamw={adamw} wd={wd} step {step}")


def test_avx2_build_matches_too(kernel: None) -> None:
    """On an AVX-512 machine, the AVX2 build (what AVX2-only hosts get) is checked as well, in its own process."""
    if not {"avx512f", "avx2", "fma", "f16c"} <= host_adam._cpu_flags():
        pytest.skip("this CPU has no AVX-512: the tests above already ran the AVX2 build")
    done = _run("""
        from hf_zero.optim import host_adam
        from tests.test_host_adam import _grid_matches
        host_adam._isa = lambda: ("AVX2", ["-mavx2", "-mfma", "-mf16c"])
        assert host_adam.available(), host_adam.unavailable_reason()
        _grid_matches()
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_one_and_two_threads_agree(kernel: None) -> None:
    n = 1_000_003
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            state = _state(n, seed=21)
            out = torch.empty(n, dtype=torch.bfloat16)
            for step in range(1, 4):
                host_adam.adam_step(state[0], _grad(n, step, torch.float32), state[1], state[2], step, lr=1e-3,
                                    beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True, out16=out)
            results.append([*state, out])
    finally:
        torch.set_num_threads(threads)
    for got, want, what in zip(results[1], results[0], ("param", "exp_avg", "exp_avg_sq", "out16")):
        _assert_same_bits(got, want, f"{what}, 2 threads vs 1")


def test_rejects_what_it_cannot_step() -> None:
    p, g = torch.zeros(32), torch.zeros(32)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    with pytest.raises(ValueError, match="grad"):
        host_adam.adam_step(p, g.half(), torch.zeros(32), torch.zeros(32), 1, **kw)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        host_adam.adam_step(p, g, torch.zeros(32), torch.zeros(64)[::2], 1, **kw)
    with pytest.raises(ValueError, match="out16"):
        host_adam.adam_step(p, g, torch.zeros(32), torch.zeros(32), 1, out16=torch.zeros(31, dtype=torch.bfloat16), **kw)
    with pytest.raises(ValueError, match="backup"):
        host_adam.adam_step(p, g, torch.zeros(32), torch.zeros(32), 1, backup=(torch.zeros(32),) * 2, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out"):
        host_adam.adam_step(p, g, torch.zeros(32), torch.zeros(32), 1, out=(torch.zeros(32),) * 2, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        host_adam.adam_step(p, g, torch.zeros(32), torch.zeros(32), 1, out=(torch.zeros(32),) * 3,  # type: ignore[arg-type]
                            backup=(torch.zeros(32),) * 3, **kw)  # type: ignore[arg-type]


def _fallback_matches_torch() -> None:
    """adam_step through torch's kernel and separate copies: the same results, out16 and backup included."""
    n = 1000
    state = _state(n, seed=2)
    ref = [t.clone() for t in state]
    backup = tuple(torch.empty(n) for _ in range(3))
    out = torch.empty(n, dtype=torch.float16)
    grad = _grad(n, 1, torch.bfloat16)
    before = [t.clone() for t in state]
    host_adam.adam_step(state[0], grad, state[1], state[2], 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.01, adamw=False, out16=out, backup=backup)
    _reference(ref, grad, 1, False, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False)
    for got, want in zip([*state, out, *backup], [*ref, ref[0].half(), *before]):
        _assert_same_bits(got, want, "fallback")
    after = tuple(torch.empty(n) for _ in range(3))
    host_adam.adam_step(backup[0], grad, backup[1], backup[2], 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.01, adamw=False, out=after)
    for got, want in zip([*after, *backup], [*ref, *before]):
        _assert_same_bits(got, want, "fallback out of place")


@pytest.mark.parametrize("why", ["not_x86", "build_fails_in_process"])
def test_unavailable_is_false_not_an_error(why: str, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    for name, value in (("_ops", None), ("_reason", None), ("_tried", False), ("_variant", 0)):
        monkeypatch.setattr(host_adam, name, value)  # a fresh process's state, restored after the test
    if why == "not_x86":
        monkeypatch.setattr(host_adam.platform, "machine", lambda: "aarch64")
    else:
        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("Error building extension 'hf_zero_host_adam': g++: fatal error: no input files")
        monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    with caplog.at_level("WARNING", logger="hf_zero"):
        assert host_adam.available() is False
    reason = host_adam.unavailable_reason()
    assert reason and ("aarch64" in reason if why == "not_x86" else "build failed" in reason), reason
    assert any("unavailable" in r.getMessage() for r in caplog.records)
    _fallback_matches_torch()


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
            **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_env_switch_disables_it_in_a_fresh_process() -> None:
    done = _run("""
        from hf_zero.optim import host_adam
        from tests.test_host_adam import _fallback_matches_torch
        print(host_adam.available(), host_adam.unavailable_reason())
        _fallback_matches_torch()
    """, HF_ZERO_HOST_ADAM="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False disabled by HF_ZERO_HOST_ADAM=0"


def test_a_source_that_does_not_compile_is_unavailable(tmp_path: Path) -> None:
    """A real compiler failure (in its own process and cache directory): a logged reason, no exception."""
    bad = tmp_path / "host_adam.cpp"
    bad.write_text("#error this source does not compile\n")
    done = _run(f"""
        import logging, pathlib
        logging.basicConfig(level=logging.WARNING)
        from hf_zero.optim import host_adam
        host_adam._SOURCE = pathlib.Path({str(bad)!r})
        print(host_adam.available(), host_adam.unavailable_reason())
    """, XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False build failed"), done.stdout + done.stderr
    assert "host Adam kernel unavailable" in done.stderr


def test_the_build_is_shared_and_reused(kernel: None) -> None:
    """A second process loads the cached build (no compile) and takes the same kernel variant."""
    done = _run("""
        from hf_zero.optim import host_adam
        print(host_adam.available(), host_adam._variant, round(host_adam.build_seconds, 3))
    """)
    assert done.returncode == 0, done.stderr
    ok, variant, seconds = done.stdout.split()
    assert ok == "True" and int(variant) == host_adam._variant
    assert float(seconds) < 5, f"a cached load took {seconds} s: rebuilt?"


def test_source_ships_in_the_wheel() -> None:
    """pyproject.toml's package-data lists the C++ source that available() builds from."""
    text = (REPO / "pyproject.toml").read_text()
    assert '"optim/csrc/*.cpp"' in text
    assert host_adam._SOURCE.is_file()

