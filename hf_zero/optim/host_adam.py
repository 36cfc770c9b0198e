"""One-pass host Adam/AdamW: torch's fused CPU update with the 16-bit cast and the undo copy in the same pass.

Why: the offloaded optimizer step (ZeRO-Offload) runs on fp32 masters and Adam moments in host memory and is bound
by the host's memory bandwidth. torch's fused kernel (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)``
runs on CPU tensors) reads and writes the master and both moments once, but two more passes sit around it: the cast
of the updated master into the 16-bit host buffer that is copied to the GPU (a second read of the master), and, for a
speculative step, the undo copy of the master and both moments taken right before it (a second read of all three).
:func:`adam_step` does all of it in one pass, in a small C++ kernel (``csrc/host_adam.cpp``) that this module builds
with ``torch.utils.cpp_extension.load`` the first time it is needed, once per process; a bf16 gradient is widened to
fp32 in-register (exactly), so the engine need not convert it first either.

Why it can replace torch's kernel: for fp32 gradients the updated master and moments equal ``torch._fused_adamw_``
(``adamw=True``) or ``torch._fused_adam_`` bit for bit, at any size, weight decay, ``maximize`` and step (for a bf16
gradient: equal to that kernel fed ``grad.float()``); ``out16`` equals ``param.to(out16.dtype)`` bit for bit, NaN and
inf included; so switching kernels changes no run. The kernel does every float operation of the vectorised body of
torch's kernel in the same order (``tests/test_host_adam.py`` checks it against the installed torch); the last
``numel % 16`` elements, which torch steps with scalar code that rounds differently, are handed to torch's own kernel.
torch's build lets its compiler contract a multiply and an add into a fused multiply-add in places its source does
not say (torch 2.13.0's x86 wheel does in two: exp_avg_sq's square term and Adam's L2 decay term), and another build
may differ, so those two spots are a run-time choice: on first use :func:`_probe` runs each choice against the
installed torch's kernel on random data and keeps the one that equals it; if none does, the kernel is not used.

Streaming (non-temporal) stores: ``out16`` and ``backup`` are written with them when 64-byte aligned (torch's host
allocations are), because nothing reads them before they leave the cache and a streaming store skips reading each
line in first. Measured on a 2-vCPU AMD EPYC VM, 33.5M parameters, AdamW, the two settings interleaved six times
(median Mparams/s, plain stores -> streaming): with out16, 1507 -> 1679 on one thread and 3071 -> 3376 on two; with
out16 and backup, 892 -> 1120 and 1764 -> 2272. So they are on (``_STREAM``).

The build: the ISA (AVX-512 or AVX2) is read from ``/proc/cpuinfo``; the library is cached under
``$XDG_CACHE_HOME/hf_zero/host_adam`` (default ``~/.cache``) in a directory per torch, Python, ISA and hash of the
source and flags, so later processes only load it (``torch.utils.cpp_extension`` holds a file lock while building, so
ranks that start together build it once; an old source's directory is left behind, a few hundred KB); a lock makes
the threads of one process build it once. When the kernel is unavailable (not x86-64 with AVX2, FMA and F16C,
no compiler, a failed build, no variant equal to torch's kernel, or ``HF_ZERO_HOST_ADAM=0`` in the environment)
:func:`available` says False, the reason is logged once in one line, and :func:`adam_step` still does the same update
through torch's kernel and separate copies: never an exception for that.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["adam_step", "available", "unavailable_reason"]

logger = logging.getLogger("hf_zero")

_SOURCE = Path(__file__).resolve().parent / "csrc" / "host_adam.cpp"
_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay", "adamw", "maximize")  # host_adam.cpp's order
_BLOCK = 16  # elements the kernel takes per unit of work (host_adam.cpp's kBlock); the rest goes to torch's kernel
_STREAM = True  # streaming stores for aligned out16 and backup (host_adam.cpp's stream_ok): faster, see above

_lock = threading.Lock()
_ops: object | None = None
_variant = 0  # host_adam.cpp's kFuse* bits: which spots torch's build fuses (_probe finds them)
_reason: str | None = None
_tried = False
build_seconds: float | None = None  # how long this process's load (build or cached) took; None before the first


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _isa() -> tuple[str, list[str]] | None:
    """The vector ISA to build for, from the CPU's flags, and its compiler flags; None without AVX2+FMA+F16C."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= flags:
        return "AVX512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
    if {"avx2", "fma", "f16c"} <= flags:
        return "AVX2", ["-mavx2", "-mfma", "-mf16c"]
    return None


def _build_source(isa: str, cflags: list[str]) -> Path:
    """The C++ source, copied into a cache directory named by torch, Python, ISA and a hash of the source and flags.

    Why a copy: the compile command names the source's path, and ninja rebuilds when the command changes, so two
    checkouts of the same code (or a checkout and an installed wheel) building from their own paths would rebuild
    in turn on every first use and could trample each other's build; named by content, they share one build, and a
    changed source gets a directory of its own instead of rebuilding over one another process may be loading.
    """
    code = _SOURCE.read_bytes()
    digest = hashlib.sha256(code + "\0".join(cflags).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-{isa.lower()}-{digest}"
    directory = root / "hf_zero" / "host_adam" / tag
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / _SOURCE.name
    if not source.is_file() or source.read_bytes() != code:
        scratch = directory / f".{_SOURCE.name}.{os.getpid()}.{threading.get_ident()}"
        scratch.write_bytes(code)
        os.replace(scratch, source)  # atomic: a concurrent builder sees the whole file or none
    return source


def _load() -> tuple[object | None, str | None]:
    """Build (or reuse), load and check the extension: ``(torch.ops namespace, None)`` or ``(None, why not)``."""
    global _variant
    if os.environ.get("HF_ZERO_HOST_ADAM", "1").strip() == "0":
        return None, "disabled by HF_ZERO_HOST_ADAM=0"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return None, f"the kernel is written for x86-64 and this CPU is {machine or 'unknown'}"
    isa = _isa()
    if isa is None:
        return None, "the CPU lacks AVX2, FMA or F16C"
    name, march = isa
    try:
        from torch.utils import cpp_extension

        # CPU_CAPABILITY names the inline namespace of at::vec: our own, so that none of our inline functions can be
        # interposed by libtorch's same-named ones compiled for another ISA.
        cflags = ["-O3", "-ffp-contract=off", "-fopenmp", f"-DCPU_CAPABILITY_{name}", f"-DCPU_CAPABILITY=hf_zero_{name}",
                  *march]
        source = _build_source(name, cflags)
        directory = source.parent
        cpp_extension.load(name=f"hf_zero_host_adam_{name.lower()}", sources=[str(source)], extra_cflags=cflags,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                           verbose=False)
        ops = torch.ops.hf_zero_host_adam
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "unavailable", never the caller's error
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")
        return None, f"build failed ({type(exc).__name__}: {first[:200]})"
    try:
        variant = _probe(ops)
    except Exception as exc:  # noqa: BLE001 - same: a kernel that cannot be checked is not used
        return None, f"probe failed ({type(exc).__name__}: {str(exc).strip()[:200]})"
    if variant is None:
        return None, f"no variant of the kernel equals torch {torch.__version__}'s fused Adam bit for bit on this CPU"
    _variant = variant
    logger.debug("hf_zero host Adam kernel: %s, fused spots %d, loaded in the build directory %s", name, variant, directory)
    return ops, None


def _probe(ops: object) -> int | None:
    """Which of torch's compiler-fused spots to fuse (host_adam.cpp's ``variant`` bits), found by trying each.

    torch's fused kernel is built with the compiler allowed to contract a multiply and an add into one fused
    multiply-add, and where it did so depends on the build (torch 2.13's x86 wheel fuses exp_avg_sq's square term and
    Adam's L2 term). Each of the eight combinations is run against the installed torch's kernel on random data
    (two steps, AdamW and Adam, with and without decay and maximize, both branches of the moment's lerp); the first
    that equals it bit for bit everywhere is used; None if none does (then the kernel is not used at all).
    """
    gen = torch.Generator().manual_seed(20250721)
    n = 1 << 14
    start = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(2)]
    configs = [dict(lr=1e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=wd, adamw=adamw, maximize=maximize)
               for adamw in (True, False) for wd in (0.0, 0.01) for maximize in (False, True) for beta1 in (0.9, 0.3)]
    refs = []
    for hyper in configs:
        state = [t.clone() for t in start]
        for t, g in enumerate(grads, 1):
            _torch_step(state[0], g, state[1], state[2], t, **hyper)
        refs.append(state)
    for variant in range(8):
        for hyper, ref in zip(configs, refs):
            state = [t.clone() for t in start]
            for t, g in enumerate(grads, 1):
                ops.step(state[0], g, state[1], state[2], None, None, None, None, n, float(t),  # type: ignore[attr-defined]
                         *(hyper[k] for k in _HYPER), variant, False, False)
            if not all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(state, ref)):
                break
        else:
            return variant
    return None


def _kernel() -> object | None:
    """The loaded ops, building them on the first call of the process (one thread builds, the others wait)."""
    global _ops, _reason, _tried, build_seconds
    if _tried:
        return _ops
    with _lock:
        if not _tried:
            start = time.perf_counter()
            _ops, _reason = _load()
            build_seconds = time.perf_counter() - start
            if _reason is not None:
                log = logger.info if _reason.startswith("disabled") else logger.warning
                log("hf_zero host Adam kernel unavailable, using torch's kernel and separate copies: %s", _reason)
            _tried = True
    return _ops


def available() -> bool:
    """Whether :func:`adam_step` runs the one-pass kernel (builds it on the first call; never raises)."""
    return _kernel() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or has not been asked yet)."""
    return _reason


def _check(what: str, t: Tensor | None, numel: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t is None:
        return
    if t.device.type != "cpu" or t.dtype not in dtypes or not t.is_contiguous() or t.numel() != numel:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"host_adam.adam_step: {what} must be a contiguous {names} CPU tensor of {numel} elements; "
                         f"got {t.dtype} on {t.device}, {t.numel()} elements, contiguous={t.is_contiguous()}")


def _torch_step(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: float, *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, adamw: bool, maximize: bool) -> None:
    """torch's own fused kernel on flat fp32 views (the reference the one-pass kernel equals)."""
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    kernel([p], [g.float()], [m], [v], [], [torch.tensor(float(step), dtype=torch.float32)], lr=lr, beta1=beta1,
           beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=maximize)


def adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: float, *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool, maximize: bool = False,
              out16: Tensor | None = None, backup: tuple[Tensor, Tensor, Tensor] | None = None,
              out: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
    """One Adam (``adamw=False``: L2 decay added to the gradient) or AdamW update of ``param``, in place, one pass.

    ``param``, ``exp_avg``, ``exp_avg_sq``: contiguous fp32 CPU tensors (any shape, the same number of elements),
    updated in place. ``grad``: contiguous fp32 or bf16, not modified. ``step``: the step count after this step's
    increment (what torch's kernel reads from ``state["step"]``). ``out16``: a bf16 or fp16 tensor that receives the
    updated ``param`` cast to its dtype. ``backup``: three fp32 tensors that receive ``param``, ``exp_avg`` and
    ``exp_avg_sq`` as they were before this update (a speculative step's undo copy). ``out``: instead of in place, the
    updated ``param``, ``exp_avg`` and ``exp_avg_sq`` go into these three fp32 tensors and the inputs are left as they
    were (a speculative step kept by swapping buffers: it writes 12 bytes an element fewer than ``backup``, which writes
    both the old state and the new); not with ``backup``. ``out16``, ``backup`` and ``out`` must not overlap the other
    tensors. No amsgrad, no gradient scale: the offloaded step needs neither here.
    """
    n = param.numel()
    _check("param", param, n, (torch.float32,))
    _check("exp_avg", exp_avg, n, (torch.float32,))
    _check("exp_avg_sq", exp_avg_sq, n, (torch.float32,))
    _check("grad", grad, n, (torch.float32, torch.bfloat16))
    _check("out16", out16, n, (torch.bfloat16, torch.float16))
    if backup is not None and out is not None:
        raise ValueError("host_adam.adam_step: give backup (the state before the step) or out (the state after it), "
                         "not both")
    for name, three in (("backup", backup), ("out", out)):
        if three is None:
            continue
        if len(three) != 3:
            raise ValueError(f"host_adam.adam_step: {name} is (param, exp_avg, exp_avg_sq): got {len(three)} tensors")
        for i, b in enumerate(three):
            _check(f"{name}[{i}]", b, n, (torch.float32,))
    hyper = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                 weight_decay=float(weight_decay), adamw=bool(adamw), maximize=bool(maximize))
    flat = [t.detach().view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    o16 = None if out16 is None else out16.detach().view(-1)
    other = backup if backup is not None else out
    saved = None if other is None else [b.detach().view(-1) for b in other]
    ops = _kernel()
    main = n - n % _BLOCK if ops is not None else 0
    with torch.no_grad():
        if main:
            b = saved or [None, None, None]
            ops.step(*flat, o16, b[0], b[1], b[2], main, float(step),  # type: ignore[attr-defined]
                     *(hyper[k] for k in _HYPER), _variant, _STREAM, out is not None)
        if main < n:  # the tail (or everything, without the kernel): torch's kernel, and the copies around it
            rest = [t[main:] for t in flat]
            if saved is not None:
                for dst, src in zip(saved, (rest[0], rest[2], rest[3])):
                    dst[main:].copy_(src)
            if out is not None:  # the copies are the inputs: step them, the inputs stay as they were
                assert saved is not None
                rest = [saved[0][main:], rest[1], saved[1][main:], saved[2][main:]]
            _torch_step(*rest, float(step), **hyper)
            if o16 is not None:
                o16[main:].copy_(rest[0])

