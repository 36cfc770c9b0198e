"""The floor of an optimizer-offloaded step on this machine, and each engine's measured step beside it (issue 44).

An exact fp32 AdamW step on the host moves about 30 bytes per parameter through host memory (read the master, the
gradient and both moments, write the master and both moments back, write the 16-bit copy), and each rank's 16-bit
gradients go down and its parameters come back up over PCIe. Overlapped with the GPU's forward and backward, no
offloaded step can be shorter than the longest of the three::

    floor = max(GPU step without offload, host bytes / host bandwidth, 16-bit bytes / PCIe bandwidth each way)

This script measures on the machine it runs on what it can: the host memory bandwidth (a STREAM-like copy on the
rank's share of the cores, :func:`hf_zero.zero.host_step.host_step_threads`), torch's fused CPU AdamW on a shard
(the real kernel, elements per second), and PCIe both ways with pinned buffers when CUDA is present (otherwise it
says so and leaves those columns out). The GPU step without offload and the engines' step times come from
``benchmarks/bench.py`` runs (``--gpu-step``, ``--step name=seconds``), which need the GPUs; without them the script
prints the host side of the floor only.

    python benchmarks/offload_floor.py --params 2.81e9 --ranks 2 --gpu-step 0.30 --step hf3op=1.02 --step fsdp2=0.87
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_zero.zero.host_step import host_step_threads, intra_op_threads

# Bytes an exact fp32 AdamW step moves per parameter on the host: read master, grad, exp_avg, exp_avg_sq (16), write
# master, exp_avg, exp_avg_sq (12), write the 16-bit copy the GPU reads back (2).
HOST_BYTES_PER_PARAM = 30
WIRE_BYTES_PER_PARAM = 2  # a 16-bit gradient down, a 16-bit parameter up


def _best(fn: object, repeat: int) -> float:
    """The fastest of ``repeat`` timed calls (after one warm-up): what the hardware allows, not the noise."""
    fn()  # type: ignore[operator]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def host_copy_bandwidth(numel: int, threads: int, repeat: int) -> float:
    """Bytes per second a fp32 copy moves (read + write) on ``threads`` intra-op threads."""
    src = torch.ones(numel)
    dst = torch.empty(numel)
    with intra_op_threads(threads):
        seconds = _best(lambda: dst.copy_(src), repeat)
    return 2 * 4 * numel / seconds


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2.81e9, help="the model's trainable parameters")
    ap.add_argument("--ranks", type=int, default=1, help="data-parallel ranks on this machine (each steps params/ranks)")
    ap.add_argument("--threads", type=int, default=0, help="host threads per rank (0: host_step_threads' share, "
                                                            "this machine's cores over --ranks)")
    ap.add_argument("--numel", type=float, default=2**26, help="elements per measurement buffer")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gpu-step", type=float, default=None, help="seconds of the step without offload (bench.py)")
    ap.add_argument("--step", action="append", default=[], metavar="NAME=SECONDS",
                    help="an engine's measured offloaded step (bench.py), repeatable")
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.params <= 0 or args.numel < 1:
        raise SystemExit("offload_floor: --ranks, --params and --numel must be positive; give the model's size and "
                         "the ranks per machine")
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

    copy_bw = host_copy_bandwidth(numel, threads, args.repeat)  # one rank's threads; the ranks share the memory
    adam = host_adamw_rate(numel, threads, args.repeat)
    # each rank on its own threads at the bandwidth one rank's threads reached: optimistic where the ranks together
    # saturate the memory bus, so a lower bound
    host_s = per_rank * HOST_BYTES_PER_PARAM / copy_bw
    adam_s = per_rank / adam
    print(f"host: {threads} threads per rank, copy {copy_bw / 1e9:.1f} GB/s, fused AdamW {adam / 1e9:.3f} G params/s")
    print(f"host floor per step: {host_s:.3f} s at the copy bandwidth ({HOST_BYTES_PER_PARAM} B/param), "
          f"{adam_s:.3f} s at the fused AdamW rate ({per_rank / 1e9:.2f} G params per rank)")
    pcie = pcie_bandwidth(numel, args.repeat)
    if pcie is None:
        print("PCIe: no CUDA device here; the host-to-device and device-to-host columns are not measured")
        wire_s = 0.0
    else:
        up, down = pcie
        wire_s = max(per_rank * WIRE_BYTES_PER_PARAM / up, per_rank * WIRE_BYTES_PER_PARAM / down)
        print(f"PCIe: host->device {up / 1e9:.1f} GB/s, device->host {down / 1e9:.1f} GB/s, {wire_s:.3f} s each step")
    if args.gpu_step is None:
        print("GPU step without offload: not given (--gpu-step, from benchmarks/bench.py); the floor below is the "
              "host's and the wire's only")
    floor = max(args.gpu_step or 0.0, host_s, wire_s)
    print(f"floor: {floor:.3f} s per step")
    for name, seconds in steps.items():
        print(f"{name:>12}: {seconds:.3f} s, {seconds / floor:.2f}x the floor")


if __name__ == "__main__":
    main()
