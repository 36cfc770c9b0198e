"""The floor of an optimizer-offloaded step on this machine, and each engine's measured step beside it (issue 44).

An exact fp32 AdamW step on the host moves about 30 bytes per parameter through host memory (read the master, the
gradient and both moments, write the master and both moments back, write the 16-bit copy), and each rank's 16-bit
gradients go down and its parameters come back up over PCIe. Overlapped with the GPU's forward and backward, no
offloaded step can be shorter than the longest of these::

    floor = max(GPU step without offload, host bytes / host bandwidth, 16-bit bytes / PCIe bandwidth, each way)

A floor is the least time the work can take, so each term comes from the fastest way this machine was measured to do
it, never from one way that happens to be slow. The host memory bandwidth is measured four ways on the rank's share
of the cores (:func:`hf_zero.zero.host_step.host_step_threads`), each counted with the bytes the memory really moves:
a read-only sum (4 B/element), an in-place scale (read and write the same lines: 8 B), a copy (read the source,
write the destination, and the write-allocate read of the destination's lines a regular store makes: 12 B) and a
STREAM triad ``a = b + s * c`` (16 B with its write-allocate); and torch's fused CPU AdamW, the host step's own
kernel, steps a shard (elements per second; in place, 28 B per element). The kernel is a measured way of moving
its bytes too, so the host floor is the step's bytes over the best of all five, and can never be above the time the
kernel was measured to take for its 28 of the 30 bytes (printed beside it). PCIe is measured both ways with pinned
buffers when CUDA is present (otherwise the script says so and leaves those terms out). The GPU step without offload
and the engines' step times come from ``benchmarks/bench.py`` runs (``--gpu-step``, ``--step name=seconds``), which
need the GPUs; without them the script prints the host side of the floor only.

    python benchmarks/offload_floor.py --params 2.81e9 --ranks 2 --gpu-step 0.30 --step hf3op=1.02 --step fsdp2=0.87
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_zero.zero.host_step import host_step_threads, intra_op_threads

# Bytes an exact fp32 AdamW step moves per parameter on the host: read master, grad, exp_avg, exp_avg_sq (16), write
# master, exp_avg, exp_avg_sq back in place (12), write the 16-bit copy the GPU reads back (2).
HOST_BYTES_PER_PARAM = 30
# What torch's fused AdamW kernel itself moves per parameter: the first 28 of the above (it writes no 16-bit copy).
ADAMW_BYTES_PER_PARAM = 28
WIRE_BYTES_PER_PARAM = 2  # a 16-bit gradient down, a 16-bit parameter up

# Bytes each host kernel moves per fp32 element, counting the write-allocate read of a destination that is not also
# read: a regular store first reads the line it writes. The in-place scale's writes go to lines it has just read.
KERNEL_BYTES_PER_ELEMENT = {"read (sum)": 4, "update (in-place scale)": 8, "copy": 12, "triad": 16}
ADAMW = "fused AdamW"


def default_numel() -> int:
    """fp32 elements per measurement buffer: four times the largest CPU cache this machine reports, at least 2^26.

    A buffer the last-level cache holds measures the cache: on the H200 machine (300 MiB of L3) the in-place scale of
    one 2^26-element (256 MiB) buffer ran at 291 GB/s against 123-137 GB/s for the kernels reading two or three, and the
    floor came out below the AdamW kernel's own time by 2x."""
    import glob

    largest = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            largest = max(largest, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(2**26, largest)  # that many fp32 elements: each buffer four times the cache


def _best(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls (after one warm-up): what the hardware allows, not the noise."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def host_bandwidths(numel: int, threads: int, repeat: int) -> dict[str, float]:
    """Bytes per second each of :data:`KERNEL_BYTES_PER_ELEMENT`'s kernels moves over ``numel`` fp32 elements on
    ``threads`` intra-op threads (the rank's share), each its fastest of ``repeat``.

    Why several: one kernel is one access pattern, and a copy is rarely the best the memory does (the write-allocate
    read it cannot avoid with regular stores, the read and write streams competing); a floor needs the best."""
    a, b, c = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    kernels: dict[str, Callable[[], object]] = {
        "read (sum)": lambda: a.sum(),
        "update (in-place scale)": lambda: a.mul_(1.0),
        "copy": lambda: c.copy_(a),
        "triad": lambda: torch.add(a, b, alpha=0.5, out=c),
    }
    out = {}
    with intra_op_threads(threads):
        for name, fn in kernels.items():
            out[name] = KERNEL_BYTES_PER_ELEMENT[name] * numel / _best(fn, repeat)
    return out


def host_adamw_rate(numel: int, threads: int, repeat: int) -> float:
    """Parameters per second torch's fused CPU AdamW steps on ``threads`` threads (the host step's own kernel)."""
    master = torch.nn.Parameter(torch.randn(numel))
    master.grad = torch.randn(numel)
    opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
    with intra_op_threads(threads):
        seconds = _best(opt.step, repeat)
    return numel / seconds


def pcie_bandwidth(numel: int, repeat: int) -> tuple[float, float] | None:
    """(host to device, device to host) bytes per second of pinned bf16 copies, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty(numel, dtype=torch.bfloat16, device="cuda")

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        def once() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        return 2 * numel / _best(once, repeat)

    return timed(dev, host), timed(host, dev)


@dataclass(frozen=True)
class Floor:
    """The floor's terms, each named, in seconds per step, and the figures they came from.

    ``host`` is the step's :data:`HOST_BYTES_PER_PARAM` over ``best_bandwidth``, the fastest of ``bandwidths`` (the
    fused AdamW kernel's own traffic among them); ``adamw`` is the kernel's measured time for this rank's share, an
    achievable time for its :data:`ADAMW_BYTES_PER_PARAM`, which ``host_adamw_share`` (the floor's time for those
    bytes) can therefore never exceed."""

    terms: dict[str, float]
    bandwidths: dict[str, float]
    best: str
    host: float
    host_adamw_share: float
    adamw: float

    @property
    def seconds(self) -> float:
        return max(self.terms.values())

    @property
    def bound_by(self) -> str:
        return max(self.terms, key=self.terms.__getitem__)

    @property
    def best_bandwidth(self) -> float:
        return self.bandwidths[self.best]


def floor_of(per_rank: float, bandwidths: dict[str, float], adamw_rate: float, pcie: tuple[float, float] | None,
             gpu_step: float | None) -> Floor:
    """The floor for ``per_rank`` parameters a rank from measured figures (bytes/s; parameters/s for the kernel).

    Each rank on its own threads at the bandwidth one rank's threads reached: optimistic where the ranks together
    saturate the memory bus, so still a lower bound."""
    measured = {**bandwidths, ADAMW: adamw_rate * ADAMW_BYTES_PER_PARAM}
    best = max(measured, key=measured.__getitem__)
    host = per_rank * HOST_BYTES_PER_PARAM / measured[best]
    terms = {"host memory": host}
    if gpu_step is not None:
        terms["GPU step"] = gpu_step
    if pcie is not None:
        up, down = pcie
        terms["PCIe host->device"] = per_rank * WIRE_BYTES_PER_PARAM / up
        terms["PCIe device->host"] = per_rank * WIRE_BYTES_PER_PARAM / down
    return Floor(terms=terms, bandwidths=measured, best=best, host=host,
                 host_adamw_share=per_rank * ADAMW_BYTES_PER_PARAM / measured[best], adamw=per_rank / adamw_rate)


def report(floor: Floor, threads: int, per_rank: float, steps: dict[str, float]) -> list[str]:
    """The lines the script prints: each bandwidth, the host floor beside the kernel's time, each term, the floor."""
    lines = [f"host: {threads} threads per rank; memory bandwidth, each kernel counted with the bytes it moves:"]
    for name, bw in floor.bandwidths.items():
        per = ADAMW_BYTES_PER_PARAM if name == ADAMW else KERNEL_BYTES_PER_ELEMENT[name]
        mark = "  <- best" if name == floor.best else ""
        lines.append(f"  {name:>24}: {bw / 1e9:7.1f} GB/s ({per} B/element){mark}")
    lines.append(f"host floor per step: {floor.host:.3f} s ({HOST_BYTES_PER_PARAM} B/param x {per_rank / 1e9:.2f} G params "
                 f"per rank at {floor.best_bandwidth / 1e9:.1f} GB/s, {floor.best}); fused AdamW kernel measured "
                 f"{floor.adamw:.3f} s for its {ADAMW_BYTES_PER_PARAM} B/param, the floor's share of those "
                 f"{floor.host_adamw_share:.3f} s")
    if "PCIe host->device" not in floor.terms:
        lines.append("PCIe: no CUDA device here; the host-to-device and device-to-host terms are not measured")
    if "GPU step" not in floor.terms:
        lines.append("GPU step without offload: not given (--gpu-step, from benchmarks/bench.py); the floor below is "
                     "the host's and the wire's only")
    lines.append("terms: " + ", ".join(f"{name} {s:.3f} s" for name, s in floor.terms.items()))
    lines.append(f"floor: {floor.seconds:.3f} s per step ({floor.bound_by})")
    for name, seconds in steps.items():
        lines.append(f"{name:>12}: {seconds:.3f} s, {seconds / floor.seconds:.2f}x the floor")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2.81e9, help="the model's trainable parameters")
    ap.add_argument("--ranks", type=int, default=1, help="data-parallel ranks on this machine (each steps params/ranks)")
    ap.add_argument("--threads", type=int, default=0, help="host threads per rank (0: host_step_threads' share, "
                                                            "this machine's cores over --ranks)")
    ap.add_argument("--numel", type=float, default=0, help="elements per measurement buffer (0: four times the "
                                                           "largest CPU cache, at least 2^26: default_numel)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gpu-step", type=float, default=None, help="seconds of the step without offload (bench.py)")
    ap.add_argument("--step", action="append", default=[], metavar="NAME=SECONDS",
                    help="an engine's measured offloaded step (bench.py), repeatable")
    args = ap.parse_args(argv)
    if not args.numel:
        args.numel = default_numel()
    if args.ranks < 1 or args.params <= 0 or args.numel < 1 or args.repeat < 1:
        raise SystemExit("offload_floor: --ranks, --params, --numel and --repeat must be positive; give the model's "
                         "size and the ranks per machine")
    steps = {}
    for item in args.step:
        name, _, value = item.partition("=")
        try:
            steps[name] = float(value)
        except ValueError:
            raise SystemExit(f"offload_floor: --step {item!r} is not NAME=SECONDS; write e.g. --step hf3op=1.02") from None
    threads = args.threads or max(1, host_step_threads()[0] // args.ranks)
    numel = int(args.numel)
    per_rank = args.params / args.ranks
    floor = floor_of(per_rank, host_bandwidths(numel, threads, args.repeat), host_adamw_rate(numel, threads, args.repeat),
                     pcie_bandwidth(numel, args.repeat), args.gpu_step)
    print("\n".join(report(floor, threads, per_rank, steps)))


if __name__ == "__main__":
    main()
