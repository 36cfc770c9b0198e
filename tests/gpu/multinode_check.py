"""``hf-zero launch --hostfile`` with NCCL on one GPU machine: two "hosts" of one GPU each against ``--num_gpus 2``.

The hosts are this machine through ``tests/test_launch_multinode.py``'s ssh stand-in (a program named ``ssh`` first on
``PATH`` that runs the node's line locally in a fresh environment), so each node's torchrun is a separate agent with
its own node rank and NCCL goes between them as between two nodes (through 127.0.0.1 for the rendezvous). The
hostfile gives each host 2 slots and ``--include node-a:0@node-b:1`` gives node-a GPU 0 and node-b GPU 1 (on a real
cluster each node would use its own GPU 0). The 2-rank ZeRO-2 job must print the same losses as ``hf-zero launch
--num_gpus 2`` of the same script, and every rank must report a CUDA device, the nccl backend and the forwarded
``NCCL_*`` variable. Run from the repository root on a machine with 2 GPUs:

    python tests/gpu/multinode_check.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.test_launch_multinode import _SSH, TRAIN, _free_port, _results  # noqa: E402


def _launch(argv: list[str], work: Path, env: dict[str, str]) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "hf_zero.launch.cli", "launch", *argv, "--master_port", str(_free_port()),
                           "train.py"], cwd=work, env=env, capture_output=True, text=True, timeout=500)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-6000:], sep="\n")
        raise SystemExit(f"hf-zero launch {' '.join(argv)} failed with {done.returncode}")
    return _results(done.stdout)


def main() -> int:
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    tmp = Path(tempfile.mkdtemp(prefix="hfz_multinode_"))
    bin_dir, home, work = tmp / "bin", tmp / "home", tmp / "work"
    for d in (bin_dir, home, work):
        d.mkdir()
    (bin_dir / "ssh").write_text(f"#!{sys.executable}\n{_SSH}")
    (bin_dir / "ssh").chmod(0o755)
    (work / "train.py").write_text(TRAIN)
    (work / "hostfile").write_text("node-a slots=2\nnode-b slots=2\n")
    if os.environ.get("LD_LIBRARY_PATH"):  # where the driver is (/usr/local/nvidia/lib64 on the device machine): a
        # node's login would set it; the stand-in's fresh environment does not, so it goes as users send it, by file
        (work / ".deepspeed_env").write_text(f"LD_LIBRARY_PATH={os.environ['LD_LIBRARY_PATH']}\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "HOME": str(home), "FAKE_LOG": str(tmp / "log"),
                "NCCL_HFZ_TEST": "kept", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))})
    one = _launch(["--num_gpus", "2"], work, env)
    two = _launch(["--hostfile", "hostfile", "--launcher", "ssh", "--include", "node-a:0@node-b:1",
                   "--master_addr", "127.0.0.1"], work, env)
    ok = len(one) == len(two) == 2
    print(f"{'rank':>4} {'from':>7} {'device':>7} {'backend':>7} {'NCCL_HFZ_TEST':>13}  max |loss - one node|")
    for a, b in zip(one, two):
        diff = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"]))
        good = diff <= 1e-6 and b["device"].startswith("cuda") and b["backend"] == "nccl" and b["NCCL_HFZ_TEST"] == "kept"
        ok &= good
        print(f"{b['rank']:>4} {b['from']:>7} {b['device']:>7} {b['backend']:>7} {b['NCCL_HFZ_TEST']!s:>13}  {diff:.2e} "
              f"{'ok' if good else 'FAILED'}")
    print("losses (one node):", [f"{x:.6f}" for x in one[0]["losses"]])
    print("losses (hostfile):", [f"{x:.6f}" for x in two[0]["losses"]])
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
