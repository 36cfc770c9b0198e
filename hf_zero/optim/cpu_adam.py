"""Adam and AdamW on host memory, fast: the update ZeRO-Offload runs on the CPU, and ``DeepSpeedCPUAdam``.

With the fp32 master weights and both Adam moments in host memory, each optimizer step reads
16 bytes per parameter (master, gradient, two moments) and writes 12 back: on many cores the
step is bound by memory bandwidth, on few by arithmetic (a square root and divisions per
element). PyTorch (>= 2.4) ships a fused, vectorised CPU kernel for it (``torch._fused_adamw_``
/ ``torch._fused_adam_``: one pass over the four tensors, split over ``torch.get_num_threads()``
threads by ``at::parallel_for``), what ``torch.optim.AdamW(fused=True)`` runs on CPU tensors.
It needs no compiler at run time, unlike DeepSpeed's JIT-built op, and of the kernels that do
not (torch's per-tensor loop, ``foreach``, fused; a Python thread pool over chunks) it is the
fastest measured; per core it is slower than DeepSpeed's AVX kernel (about 0.75x on one AMD
EPYC core; ``benchmarks/bench_cpu_adam.py`` measures both, and a compiled single-pass alternative). :func:`adam_update` is that kernel plus what DeepSpeed's op
does that torch's does not:

- ``bias_correction=False``: torch's kernel always corrects. The uncorrected update equals the
  corrected one with rescaled scalars (``lr * bc1 / s``, ``eps / s``, and for decoupled decay
  ``weight_decay * s / bc1``, where ``bc1 = 1 - beta1**t`` and ``s = sqrt(1 - beta2**t)``), so
  the same single pass serves both; see :func:`_kernel_scalars`.
- 16-bit parameters with fp32 moments (DeepSpeed's ``fp32_optimizer_states``), gradients of
  another dtype, or non-contiguous tensors: torch's kernel needs one dtype and one layout for
  all four tensors (with differing strides it silently pairs the wrong elements), so those are
  stepped through contiguous fp32 copies, a bounded chunk at a time.
- The write-back: after the update, the new values are cast into a 16-bit host buffer
  (``out16``), ready for a host-to-device copy, as DeepSpeed's step once did with its fp16
  copy. Fusing the cast into the chunks of the update was measured and was not faster than a
  cast right after (the step streams far more than cache holds), so it comes right after.

Sub-groups (DeepSpeed's ``sub_group_size``) are slices of the flat tensors: calling
:func:`adam_update` on ``t[lo:hi]`` views steps that range in place, so the offload engine can
overlap the transfers of one range with the update of the next (:func:`sub_group_ranges`; ranges
that start on multiples of ``ALIGN`` elements give bit for bit the result of one whole update).
The step count is not advanced here; callers count one step for all ranges of a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hf_zero.zero.offload import host_buffer as _pinned_host_buffer

__all__ = ["ALIGN", "DeepSpeedCPUAdam", "adam_update", "host_buffer", "sub_group_ranges"]

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CHUNK = 1 << 20  # elements per fp32 scratch chunk on the slow path (4 MiB each)
ALIGN = 64  # elements; range starts on this boundary keep range stepping bit-identical (sub_group_ranges)


def sub_group_ranges(numel: int, sub_group_size: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` covering ``range(numel)`` in slices of about ``sub_group_size`` elements.

    The size is rounded up to a multiple of ``align`` (64 elements: a whole number of SIMD
    vectors on every CPU torch vectorises for), because torch's kernel steps the tail of a tensor
    that does not fill a vector with scalar code whose rounding differs in the last bit; ranges
    that start on vector boundaries make stepping by range bit-identical to stepping the whole.
    """
    if isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size < 1:
        raise ValueError(f"sub_group_size: got {sub_group_size!r}, expected a positive number of elements")
    size = -(-sub_group_size // align) * align
    return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)]


def host_buffer(numel: int, dtype: torch.dtype = torch.bfloat16, pin: bool | None = None) -> Tensor:
    """A flat host tensor for 16-bit write-back, pinned when CUDA is present (so its copy to the GPU is async).

    ``pin=None`` pins exactly when ``torch.cuda.is_available()``; a CPU-only build cannot pin.
    """
    if pin is None:
        pin = torch.cuda.is_available()
    return _pinned_host_buffer(numel, dtype, bool(pin))  # exactly its own pages pinned (see there)


def _kernel_scalars(step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    adamw_mode: bool, bias_correction: bool) -> tuple[float, float, float]:
    """``(lr, eps, weight_decay)`` to hand torch's always-bias-corrected kernel at step ``step``.

    The kernel computes ``p -= lr/bc1 * m / (sqrt(v)/s + eps)`` (and ``p *= 1 - lr*wd`` when
    decoupled). Without bias correction DeepSpeed computes ``p -= lr * m / (sqrt(v) + eps)``;
    ``lr*bc1/s`` and ``eps/s`` turn the first into the second, and the decay, which also reads
    ``lr``, keeps its product ``lr*wd`` with ``wd*s/bc1``. L2 decay (``adamw_mode=False``) is added to
    the gradient and does not involve ``lr``, so it stays.
    """
    if bias_correction:
        return lr, eps, weight_decay
    bc1 = 1.0 - beta1 ** step
    s = math.sqrt(1.0 - beta2 ** step)
    wd = weight_decay * s / bc1 if adamw_mode else weight_decay
    return lr * bc1 / s, eps / s, wd


def _fast(p: Tensor, others: Sequence[Tensor]) -> bool:
    """Whether torch's kernel can take these tensors as they are: one dtype it knows, all contiguous on the CPU."""
    return (p.device.type == "cpu" and p.dtype in _KERNEL_DTYPES and p.is_contiguous()
            and all(t.dtype == p.dtype and t.is_contiguous() and t.device.type == "cpu" for t in others))


def _run_kernel(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                max_sqs: list[Tensor], steps: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adamw_mode: bool, amsgrad: bool, maximize: bool, grad_scale: Tensor | None) -> None:
    kernel = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale)


def _fp32(t: Tensor) -> Tensor:
    """``t`` itself if it is already contiguous fp32 on the CPU, else a contiguous fp32 copy."""
    if t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu":
        return t
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)


def _update_via_fp32(tensors: list[Tensor], step: Tensor, **kw: object) -> None:
    """Step one parameter whose tensors the kernel cannot take directly, through fp32 copies.

    ``tensors`` is ``[param, grad, exp_avg, exp_avg_sq(, max_exp_avg_sq)]``. When all are
    contiguous they are walked in chunks, so the scratch stays a few MiB; otherwise whole.
    Everything is written back to its own dtype and layout; the gradient only when the kernel
    unscaled it (``grad_scale``), as it does in place on the fast path.
    """
    if all(t.is_contiguous() for t in tensors):
        flat = [t.view(-1) for t in tensors]
        pieces = [[t[lo:hi] for t in flat] for lo, hi in sub_group_ranges(flat[0].numel(), _CHUNK)]
    else:
        pieces = [tensors]
    for piece in pieces:
        up = [_fp32(t) for t in piece]
        _run_kernel([up[0]], [up[1]], [up[2]], [up[3]], up[4:], [step], **kw)  # type: ignore[arg-type]
        for i, (orig, new) in enumerate(zip(piece, up)):
            if (i != 1 or kw.get("grad_scale") is not None) and new is not orig:
                orig.copy_(new)


def adam_update(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    adamw_mode: bool = True, bias_correction: bool = True, amsgrad: bool = False,
    max_exp_avg_sqs: Sequence[Tensor] = (), maximize: bool = False, out16: Sequence[Tensor | None] | None = None,
    grad_scale: float | None = None,
) -> None:
    """One Adam (``adamw_mode=False``: L2 decay in the gradient) or AdamW update of each ``params[i]``, in place.

    ``steps[i]`` is a 0-d float tensor already holding the count of this step (torch's ``state["step"]``,
    advanced by the caller, once per step however many sub-group slices it is split into).
    ``exp_avgs`` / ``exp_avg_sqs`` (and ``max_exp_avg_sqs`` with ``amsgrad``) are updated too.
    Where ``out16[i]`` is a tensor (same number of elements, any dtype, typically bf16 or fp16 in
    pinned memory), the updated ``params[i]`` is cast into it. ``grad_scale``: the gradients are
    divided by it inside the same pass (and left divided), which saves the engine a separate
    pass to undo fp16 loss scaling and to apply gradient clipping (scale = loss scale / clip coefficient).
    """
    n = len(params)
    lists = [grads, exp_avgs, exp_avg_sqs, steps] + ([max_exp_avg_sqs] if amsgrad else [])
    if any(len(x) != n for x in lists) or (out16 is not None and len(out16) != n):
        raise ValueError("adam_update: params, grads, exp_avgs, exp_avg_sqs, steps (and max_exp_avg_sqs with amsgrad, "
                         "out16 if given) need one entry per parameter")
    if grad_scale is not None and not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"adam_update: grad_scale: got {grad_scale!r}, expected a finite number > 0 to divide the gradients by")
    scale = None if grad_scale is None else torch.tensor(float(grad_scale), dtype=torch.float32)
    # Tensors the kernel takes as they are, grouped so that one call covers each group; the
    # bias-correction rescaling depends on the step, so without it the step joins the key.
    batches: dict[tuple, list[int]] = {}
    for i in range(n):
        others = [grads[i], exp_avgs[i], exp_avg_sqs[i]] + ([max_exp_avg_sqs[i]] if amsgrad else [])
        fast = _fast(params[i], others)
        key = (fast, params[i].dtype if fast else i, None if bias_correction else float(steps[i]))
        batches.setdefault(key, []).append(i)
    for (fast, _, _), idx in batches.items():
        t = float(steps[idx[0]])
        k_lr, k_eps, k_wd = _kernel_scalars(t, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)
        kw = dict(lr=k_lr, beta1=beta1, beta2=beta2, eps=k_eps, weight_decay=k_wd, adamw_mode=adamw_mode,
                  amsgrad=amsgrad, maximize=maximize, grad_scale=scale)
        if fast:
            _run_kernel([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                        [exp_avg_sqs[i] for i in idx], [max_exp_avg_sqs[i] for i in idx] if amsgrad else [],
                        [steps[i] for i in idx], **kw)  # type: ignore[arg-type]
        else:
            (i,) = idx
            extra = [max_exp_avg_sqs[i]] if amsgrad else []
            _update_via_fp32([params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], *extra], steps[i], **kw)
        if out16 is not None:
            for i in idx:
                if out16[i] is not None:
                    out16[i].copy_(params[i].reshape(out16[i].shape))  # type: ignore[union-attr]


# ------------------------------------------------------------------ the optimizer


def _check_number(where: str, value: object, low: float = 0.0, below: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    if not ok or (below is not None and value >= below):  # type: ignore[operator]
        bound = f"in [{low:g}, {below:g})" if below is not None else f">= {low:g}"
        raise ValueError(f"DeepSpeedCPUAdam: {where}: got {value!r}, expected a number {bound}")


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """DeepSpeed's ``DeepSpeedCPUAdam``: Adam or AdamW on host tensors, multi-threaded, with torch's state format.

    Same arguments and defaults as DeepSpeed 0.19: ``adamw_mode=True`` decouples the weight decay
    (AdamW), ``False`` adds it to the gradient (Adam with L2); ``bias_correction=False`` drops
    Adam's bias correction; ``fp32_optimizer_states=False`` keeps the moments in the parameters'
    dtype. Unlike DeepSpeed's, ``amsgrad=True`` works (torch's AMSGrad), and the state is torch's:
    per parameter ``step`` (a 0-d float tensor), ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq``),
    and param groups with torch's keys, so a ``state_dict()`` loads into ``torch.optim.AdamW``
    (``Adam`` for ``adamw_mode=False``) and back. The update itself is :func:`adam_update`.

    Besides ``step()``, the offload engine drives it in pieces: :meth:`bind_16bit_copy` names a
    16-bit host buffer that each update of a parameter is cast into; :meth:`begin_step` counts the
    step once; :meth:`step_range` then updates any slice of a parameter (a sub-group), so the
    transfers of one slice can overlap the update of the next.
    """

    def __init__(self, model_params: object, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=adamw_mode, bias_correction=bias_correction)
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        self._out16: dict[Tensor, Tensor] = {}
        super().__init__(model_params, defaults)  # type: ignore[arg-type]

    @classmethod
    def from_torch(cls, optimizer: torch.optim.Optimizer, fp32_optimizer_states: bool = True) -> DeepSpeedCPUAdam:
        """The same Adam or AdamW, param groups and state, stepping on the host.

        For an engine that offloads the optimizer of a config (``"type": "AdamW"``) or a client's
        ``torch.optim.Adam``/``AdamW`` (``FusedAdam`` included): each group keeps its parameters,
        hyperparameters and extra keys, the state is carried over through ``state_dict()``, and
        the engine then points the groups at its host masters as it does for any optimizer.
        Schedulers built on the old optimizer must be rebuilt on this one.
        """
        if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or isinstance(optimizer, cls):
            raise ValueError(f"DeepSpeedCPUAdam.from_torch: got {type(optimizer).__name__}, expected a torch.optim.Adam or "
                             "AdamW to move to the host; keep other optimizers as they are")
        groups = [dict(g, params=list(g["params"]), fused=None, foreach=None) for g in optimizer.param_groups]
        adamw = [bool(g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))) for g in groups]
        new = cls(groups, adamw_mode=adamw[0], fp32_optimizer_states=fp32_optimizer_states)
        for g, decoupled in zip(new.param_groups, adamw):
            g["decoupled_weight_decay"] = decoupled
        if optimizer.state:
            sd = optimizer.state_dict()
            for g in sd["param_groups"]:
                g.update(fused=None, foreach=None)
            new.load_state_dict(sd)
        return new

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then each hyperparameter checked, so a bad group fails here and not in the first step."""
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        where = f"param group {len(self.param_groups) - 1}"
        lr = g["lr"]
        _check_number(f"{where} lr", float(lr) if isinstance(lr, Tensor) and lr.numel() == 1 else lr)
        _check_number(f"{where} eps", g["eps"])
        _check_number(f"{where} weight_decay", g["weight_decay"])
        betas = g["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"DeepSpeedCPUAdam: {where} betas: got {betas!r}, expected a pair like (0.9, 0.999)")
        for i, b in enumerate(betas):
            _check_number(f"{where} betas[{i}]", b, 0.0, 1.0)

    def __setstate__(self, state: dict) -> None:
        """Fill keys an older or foreign state dict lacks, and turn DeepSpeed's integer steps into torch's tensors."""
        super().__setstate__(state)
        for g in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                               ("differentiable", False), ("fused", None), ("bias_correction", True),
                               ("decoupled_weight_decay", getattr(self, "adam_w_mode", True))):
                g.setdefault(key, value)
        for s in self.state.values():  # the kernel reads float32 counts; torch's may be float64, DeepSpeed's ints
            if "step" in s and not (isinstance(s["step"], Tensor) and s["step"].dtype == torch.float32):
                s["step"] = torch.tensor(float(s["step"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load; then the moments go back to fp32 (torch casts them to the parameter's dtype)."""
        super().load_state_dict(state_dict)  # calls __setstate__ above
        for p, s in self.state.items():
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in s:
                    s[key] = s[key].to(self._state_dtype(p))

    def _state_dtype(self, p: Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states and p.dtype != torch.float64 else p.dtype

    def bind_16bit_copy(self, param: Tensor, buffer: Tensor | None) -> None:
        """After every update of ``param`` (whole or a range), cast its new values into ``buffer``; None unbinds.

        ``buffer`` is a host tensor with as many elements as ``param`` (see :func:`host_buffer`):
        the 16-bit weights that the offload engine copies to the GPU.
        """
        if buffer is None:
            self._out16.pop(param, None)
            return
        if buffer.device.type != "cpu" or buffer.numel() != param.numel() or not buffer.is_contiguous():
            raise ValueError(f"DeepSpeedCPUAdam.bind_16bit_copy: got a buffer of {buffer.numel()} elements on "
                             f"{buffer.device} (contiguous: {buffer.is_contiguous()}), expected a contiguous host "
                             f"tensor of {param.numel()} elements like the parameter")
        self._out16[param] = buffer

    def _checked_state(self, p: Tensor, group: dict, where: str) -> dict:
        if p.device.type != "cpu" or p.grad.device.type != "cpu":  # type: ignore[union-attr]
            raise ValueError(
                f"DeepSpeedCPUAdam: {where} is on {p.device} with its gradient on {p.grad.device}; it steps host "  # type: ignore[union-attr]
                "tensors only: enable zero_optimization.offload_optimizer (device cpu), or use FusedAdam / "
                "torch.optim.AdamW for parameters on the GPU")
        if p.grad.shape != p.shape:  # type: ignore[union-attr]
            raise ValueError(f"DeepSpeedCPUAdam: {where} has shape {tuple(p.shape)} but its gradient "
                             f"{tuple(p.grad.shape)}; set .grad to a tensor shaped like the parameter")  # type: ignore[union-attr]
        state = self.state[p]
        if not state:
            dtype = self._state_dtype(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"], memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def begin_step(self) -> None:
        """Count one step for every parameter with a gradient (creating its state), before :meth:`step_range` calls."""
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._checked_state(p, group, f"parameter {pi} of param group {gi}")["step"].add_(1)

    @torch.no_grad()
    def step(self, closure: object = None, *, grad_scale: float | None = None) -> object:
        """One update of every parameter with a gradient (``closure``, if given, recomputes the loss first).

        ``grad_scale`` (hf_zero's, not DeepSpeed's): divide the gradients by it within the update
        (see :func:`adam_update`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # type: ignore[operator]
        self.begin_step()
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if ps:
                self._update(group, ps, [p.grad for p in ps], [self._out16.get(p) for p in ps], [self.state[p] for p in ps],
                             grad_scale)
        return loss

    @torch.no_grad()
    def step_range(self, param: Tensor, start: int, end: int, *, grad_scale: float | None = None) -> None:
        """Update the elements ``[start, end)`` of the flattened ``param`` at the count :meth:`begin_step` set.

        Every range of a parameter must be stepped exactly once between two ``begin_step`` calls;
        the bound 16-bit copy, if any, receives the same range. Ranges from :func:`sub_group_ranges`
        (starts on multiples of ``ALIGN``) reproduce :meth:`step` bit for bit.
        """
        group = next((g for g in self.param_groups if any(q is param for q in g["params"])), None)
        state = self.state.get(param) if group is not None else None
        if group is None or not state or param.grad is None:
            raise ValueError("DeepSpeedCPUAdam.step_range: the tensor is not a parameter of this optimizer with a "
                             "gradient and a counted step; add it to a param group, set .grad, call begin_step() first")
        n = param.numel()
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise ValueError(f"DeepSpeedCPUAdam.step_range: got [{start}, {end}), expected 0 <= start <= end <= {n}")
        if not (param.is_contiguous() and param.grad.is_contiguous()):
            raise ValueError("DeepSpeedCPUAdam.step_range: the parameter and its gradient must be contiguous to be "
                             "stepped by range; step() handles other layouts")
        sl = slice(start, end)
        part = {k: (v.view(-1)[sl] if isinstance(v, Tensor) and v.dim() > 0 else v) for k, v in state.items()}
        out = self._out16.get(param)
        self._update(group, [param.view(-1)[sl]], [param.grad.view(-1)[sl]], [None if out is None else out.view(-1)[sl]],
                     [part], grad_scale)

    def _update(self, group: dict, ps: list[Tensor], grads: list[Tensor], out16: list[Tensor | None],
                states: list[dict], grad_scale: float | None) -> None:
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        amsgrad = bool(group["amsgrad"])
        adam_update(
            ps, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
            lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["decoupled_weight_decay"]),
            bias_correction=bool(group["bias_correction"]), amsgrad=amsgrad, maximize=bool(group["maximize"]),
            max_exp_avg_sqs=[s["max_exp_avg_sq"] for s in states] if amsgrad else (), out16=out16,
            grad_scale=grad_scale,
        )
