"""``hf-zero launch --hostfile``: DeepSpeed's multi-node launch (pdsh, ssh, Slurm), each node running torchrun.

The "hosts" are this machine: stand-ins named ``ssh``, ``pdsh`` and ``srun`` come first on ``PATH``, log what they
were asked (one JSON line each) and run the remote line locally with ``bash -c`` in a fresh environment (only
``PATH`` and ``HOME``, as a login on another node), so a variable reaches a node only if the launcher forwards it.
The master is 127.0.0.1 (the ssh stand-in answers ``hostname -I`` with it): nothing connects anywhere else.

The oracle for the real runs: a 2-rank ZeRO-2 job through ``import hf_zero as deepspeed`` started on two one-slot
hosts gives the same losses as ``hf-zero launch --num_gpus 2`` of the same script on one node.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_zero.errors import LaunchError
from hf_zero.launch import cli, remote
from hf_zero.launch import hostfile as hf
from hf_zero.launch import job as hz_job

# ------------------------------------------------------------------------------ stand-ins

_SSH = '''
import json, os, sys
args, opts = sys.argv[1:], []
while args and args[0].startswith("-"):
    n = 2 if args[0] in ("-p", "-o", "-l", "-i", "-F", "-J") else 1
    opts += args[:n]
    args = args[n:]
host, command = args[0], " ".join(args[1:])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"prog": "ssh", "opts": opts, "host": host, "command": command}) + "\\n")
if host in os.environ.get("FAKE_DOWN", "").split(","):
    sys.stderr.write(f"ssh: connect to host {host} port 22: Connection refused\\n")
    sys.exit(255)
if command == "hostname -I":
    print("127.0.0.1 10.9.9.9")
    sys.exit(0)
if command == "hostname":
    print(host)
    sys.exit(0)
os.execve("/bin/bash", ["bash", "-c", command], {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]})
'''

_PDSH = '''
import json, os, subprocess, sys, threading
args, opts, hosts = sys.argv[1:], [], []
while args and args[0].startswith("-"):
    if args[0] == "-w":
        hosts = args[1].split(",")
    n = 2 if args[0] in ("-w", "-f", "-l", "-R") else 1
    opts += args[:n]
    args = args[n:]
command = " ".join(args)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"prog": "pdsh", "opts": opts, "hosts": hosts, "command": command,
                        "rcmd": os.environ.get("PDSH_RCMD_TYPE"), "ssh_args": os.environ.get("PDSH_SSH_ARGS_APPEND")}) + "\\n")
env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
procs = [subprocess.Popen(["/bin/bash", "-c", command.replace("%n", str(i)).replace("%h", h)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i, h in enumerate(hosts)]
def pump(stream, out, host):
    for line in stream:
        out.write(f"{host}: {line}")
        out.flush()
threads = [threading.Thread(target=pump, args=(s, o, h)) for p, h in zip(procs, hosts)
           for s, o in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
[t.start() for t in threads]
codes = {}
def wait(p, h):  # as pdsh, a host's failure is said when that host is done, not when all are
    codes[h] = p.wait()
    if codes[h]:
        sys.stderr.write(f"pdsh@head: {h}: ssh exited with exit code {codes[h]}\\n")
        sys.stderr.flush()
waiters = [threading.Thread(target=wait, args=(p, h)) for p, h in zip(procs, hosts)]
[t.start() for t in waiters]
[t.join() for t in waiters + threads]
sys.exit(max(codes.values()))
'''

_SRUN = '''
import json, os, subprocess, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"prog": "srun", "argv": argv}) + "\\n")
want = os.environ["FAKE_SRUN_EXPECT"].split()
if argv[:len(want)] != want or argv[-3:-1] != ["sh", "-c"]:
    sys.stderr.write(f"srun stand-in: expected {want} ... sh -c LINE, got {argv}\\n")
    sys.exit(2)
nodes = int(argv[argv.index("--nodes") + 1])
procs = []
for node in range(nodes):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "SLURM_NODEID": str(node),
           "SLURM_STEP_NODELIST": "node-[a-b]"}
    procs.append(subprocess.Popen(["/bin/sh", "-c", argv[-1]], env=env))
sys.exit(max(p.wait() for p in procs))
'''

TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import hf_zero as deepspeed

    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 8, 7, generator=g), torch.randn(5, 8, 3, generator=g)
    losses = []
    for step in range(5):
        mine = slice(4 * rank, 4 * rank + 4)
        xs, ys = x[step, mine].to(engine.device), y[step, mine].to(engine.device)  # as a DeepSpeed script moves them
        loss = torch.nn.functional.mse_loss(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    names = ("NCCL_HFZ_TEST", "HFZ_VENV", "HFZ_HOME_FILE", "HFZ_CWD_FILE", "HFZ_SPACED", "GROUP_RANK", "LOCAL_WORLD_SIZE",
             "MASTER_ADDR", "WORLD_SIZE")
    device = str(next(engine.module.parameters()).device)
    record = {"rank": rank, "losses": losses, "cwd": os.getcwd(), "device": device, "backend":
              torch.distributed.get_backend(), **{n: os.environ.get(n) for n in names}}
    sys.stdout.write("RESULT " + json.dumps(record) + "\\n")
    sys.stdout.flush()
    """
)

# rank 1 fails at once, rank 0 would sleep: the launcher must end node 0 instead of waiting for it
FAIL_OR_SLEEP = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(os.environ["HFZ_PIDS"], str(rank)), "w") as f:
        f.write(str(os.getpid()))
    print(f"READY {rank}", flush=True)
    if rank == 1 and os.environ.get("HFZ_FAIL") == "1":
        sys.exit(3)
    time.sleep(300)
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def site(tmp_path: Path) -> Iterator[dict]:
    """A launch folder, a home folder, the stand-ins first on PATH and their log."""
    bin_dir, home, work = tmp_path / "bin", tmp_path / "home", tmp_path / "work"
    for d in (bin_dir, home, work):
        d.mkdir()
    for name, body in (("ssh", _SSH), ("pdsh", _PDSH), ("srun", _SRUN)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "OMP_NUM_THREADS", "HFZ_"))}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "HOME": str(home), "FAKE_LOG": str(tmp_path / "log"),
                "CUDA_VISIBLE_DEVICES": "", "NCCL_HFZ_TEST": "kept"})
    (work / "train.py").write_text(TRAIN)
    (work / "hang.py").write_text(FAIL_OR_SLEEP)
    yield {"bin": bin_dir, "home": home, "work": work, "env": env, "log": tmp_path / "log"}
    for pid_file in (tmp_path / "pids").glob("*"):  # a failed test leaves no rank (nor its torchrun) behind
        try:
            pid = int(pid_file.read_text())
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            os.kill(parent, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def _hostfile(work: Path, text: str) -> str:
    (work / "hostfile").write_text(textwrap.dedent(text))
    return str(work / "hostfile")


def _launch(site: dict, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_zero.launch.cli", "launch", *argv], cwd=site["work"],
                          env={**site["env"], **env}, capture_output=True, text=True, timeout=240)


def _results(stdout: str) -> list[dict]:
    """The RESULT lines, by rank, with the host prefix (``node-a: ``) they came with, if any."""
    out = []
    for line in stdout.splitlines():
        prefix, mark, rest = line.partition("RESULT ")
        if mark:
            out.append({**json.loads(rest), "from": prefix.rstrip(": ")})
    return sorted(out, key=lambda r: r["rank"])


def _log(site: dict) -> list[dict]:
    return [json.loads(line) for line in site["log"].read_text().splitlines()] if site["log"].exists() else []


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The oracle: the same script under ``hf-zero launch --num_gpus 2`` on one node."""
    work = tmp_path_factory.mktemp("one_node")
    (work / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_NUM_THREADS",))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-m", "hf_zero.launch.cli", "launch", "--num_gpus", "2", "--master_port",
                           str(_free_port()), "train.py"], cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = _results(done.stdout)
    assert len(results) == 2 and results[0]["losses"] == results[1]["losses"]
    return results[0]["losses"]


# ----------------------------------------------------------------------- real launches


def test_ssh_two_hosts_train_like_one_node_and_forward_the_environment(site: dict, one_node_losses: list[float]) -> None:
    """The tutorial's ``--num_nodes 2 --num_gpus 1`` over a hostfile, plain ssh (``--launcher ssh``), a custom port."""
    hosts = _hostfile(site["work"], """
        # two workers
        node-a slots=1

        node-b slots=1   # trailing words are ignored, as DeepSpeed's regex does
        """)
    (site["home"] / ".deepspeed_env").write_text("HFZ_HOME_FILE=from-home\nHFZ_CWD_FILE=overridden\n")
    (site["work"] / ".deepspeed_env").write_text("# comment\nHFZ_CWD_FILE=from-cwd\nHFZ_SPACED=two words\n"
                                                 "HFZ_SECRET_TOKEN=s3cr3t\n")
    (site["work"] / "activate").write_text("export HFZ_VENV=sourced\n")
    port = _free_port()
    done = _launch(site, ["--hostfile", hosts, "--launcher", "ssh", "--ssh_port", "2222", "--num_nodes", "2",
                          "--num_gpus", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                          "--venv_script", str(site["work"] / "activate"), "train.py"])
    assert done.returncode == 0, done.stderr[-4000:]
    results = _results(done.stdout)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["from"] for r in results] == ["node-a", "node-b"]  # node rank = hostfile order
    assert [r["GROUP_RANK"] for r in results] == ["0", "1"] and {r["LOCAL_WORLD_SIZE"] for r in results} == {"1"}
    for r in results:
        assert r["losses"] == pytest.approx(one_node_losses, rel=0, abs=1e-7)
        assert r["NCCL_HFZ_TEST"] == "kept" and r["HFZ_HOME_FILE"] == "from-home" and r["HFZ_VENV"] == "sourced"
        assert r["HFZ_CWD_FILE"] == "from-cwd" and r["HFZ_SPACED"] == "two words"  # the cwd file is read last
        assert r["cwd"] == str(site["work"]) and r["WORLD_SIZE"] == "2" and r["MASTER_ADDR"] == "127.0.0.1"
    calls = _log(site)
    checks = [c for c in calls if c["command"] == "hostname"]
    assert sorted(c["host"] for c in checks) == ["node-a", "node-b"]  # every host is checked, not only the first
    assert all("PasswordAuthentication=no" in c["opts"] and c["opts"][:2] == ["-p", "2222"] for c in checks)
    runs = sorted((c for c in calls if "hf_zero.launch.cli launch" in c["command"]), key=lambda c: c["host"])
    assert [c["host"] for c in runs] == ["node-a", "node-b"]  # (the two ssh start at once: the log's order is theirs)
    for rank, c in enumerate(runs):
        assert c["opts"] == ["-p", "2222"]
        assert f"--node_rank={rank} " in c["command"] and "--num_gpus 1" in c["command"]
        assert f"--num_nodes 2 --master_port {port}" in c["command"] and "export NCCL_HFZ_TEST=kept;" in c["command"]
        assert f"cd {shlex.quote(str(site['work']))} &&" in c["command"]
    said = [line for line in done.stderr.splitlines() if line.startswith("hf-zero launch: ")]
    assert said[0] == "hf-zero launch: 2 nodes of hostfile " + hosts + " over ssh: node-a (1 slot), node-b (1 slot)"
    assert said[1].startswith("hf-zero launch: node-a: ssh -p 2222 node-a ")
    assert "HFZ_SECRET_TOKEN=***" in said[1] and "s3cr3t" not in done.stderr + done.stdout  # sent, never printed
    assert "export HFZ_SECRET_TOKEN=s3cr3t;" in runs[0]["command"]


def test_pdsh_finds_the_master_and_numbers_the_hosts_after_exclude(site: dict, one_node_losses: list[float]) -> None:
    """pdsh (installed here: the stand-in) is the default; ``%n`` numbers the hosts left by ``--exclude``."""
    hosts = _hostfile(site["work"], "node-a slots=1\nnode-b slots=1\nnode-c slots=1\n")
    done = _launch(site, ["-H", hosts, "--exclude", "node-b", "--master_port", str(_free_port()), "train.py"])
    assert done.returncode == 0, done.stderr[-4000:]
    results = _results(done.stdout)
    assert [r["from"] for r in results] == ["node-a", "node-c"] and [r["GROUP_RANK"] for r in results] == ["0", "1"]
    assert all(r["losses"] == pytest.approx(one_node_losses, rel=0, abs=1e-7) for r in results)
    assert all(r["MASTER_ADDR"] == "127.0.0.1" and r["NCCL_HFZ_TEST"] == "kept" for r in results)
    calls = _log(site)
    assert [c["host"] for c in calls if c["prog"] == "ssh" and c["command"] == "hostname -I"] == ["node-a"]
    (pdsh,) = [c for c in calls if c["prog"] == "pdsh"]
    assert pdsh["opts"] == ["-S", "-f", "1024", "-w", "node-a,node-c"] and pdsh["rcmd"] == "ssh"
    assert "--node_rank=%n " in pdsh["command"] and "--master_addr=127.0.0.1 " in pdsh["command"]
    assert "master address 127.0.0.1 (`hostname -I` on node-a)" in done.stderr


def test_slurm_runs_one_task_per_node_under_srun(site: dict, one_node_losses: list[float]) -> None:
    hosts = _hostfile(site["work"], "node-a slots=1\nnode-b slots=1\n")
    expect = "--nodes 2 --ntasks-per-node 1 --nodelist node-a,node-b --kill-on-bad-exit=1 --exclusive"
    done = _launch(site, ["--hostfile", hosts, "--launcher", "slurm", "--launcher_args=--exclusive",
                          "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "train.py"],
                   FAKE_SRUN_EXPECT=expect)
    assert done.returncode == 0, done.stderr[-4000:]
    results = _results(done.stdout)
    assert [r["GROUP_RANK"] for r in results] == ["0", "1"]
    assert all(r["losses"] == pytest.approx(one_node_losses, rel=0, abs=1e-7) for r in results)
    assert all(r["NCCL_HFZ_TEST"] == "kept" for r in results)
    (srun,) = [c for c in _log(site) if c["prog"] == "srun"]
    assert '--node_rank="$SLURM_NODEID"' in srun["argv"][-1] and "--num_gpus 1" in srun["argv"][-1]


def test_an_unreachable_host_is_one_sentence_and_nothing_starts(site: dict) -> None:
    hosts = _hostfile(site["work"], "node-a slots=1\nnode-b slots=1\n")
    done = _launch(site, ["--hostfile", hosts, "--master_addr", "127.0.0.1", "train.py"], FAKE_DOWN="node-b")
    assert done.returncode == 2 and done.stdout == ""
    err = done.stderr.strip()
    assert "\n" not in err, err
    assert err.startswith(f"hf-zero launch: error: host node-b of hostfile {hosts} is not reachable over ssh: "
                          "`ssh -o PasswordAuthentication=no -o ConnectTimeout=10 node-b hostname` exited with 255: "
                          "ssh: connect to host node-b port 22: Connection refused;")
    assert "--exclude node-b" in err
    assert not [c for c in _log(site) if c["prog"] == "pdsh" or "hf_zero.launch.cli" in c.get("command", "")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_dead(pids: list[int], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_a_failed_host_fails_the_launch_and_ends_the_others(site: dict, tmp_path: Path, launcher: str) -> None:
    hosts = _hostfile(site["work"], "node-a slots=1\nnode-b slots=1\n")
    (tmp_path / "pids").mkdir()
    (site["work"] / ".deepspeed_env").write_text(f"HFZ_PIDS={tmp_path / 'pids'}\nHFZ_FAIL=1\n")  # the nodes' only way
    start = time.monotonic()
    done = _launch(site, ["--hostfile", hosts, "--launcher", launcher, "--master_addr", "127.0.0.1", "--master_port",
                          str(_free_port()), "hang.py"])
    took = time.monotonic() - start
    assert done.returncode != 0 and took < 200, (done.returncode, took, done.stderr[-3000:])
    assert "node-b exited with code" in done.stderr and "ending the job on node-a" in done.stderr
    pids = [int((tmp_path / "pids" / r).read_text()) for r in ("0", "1")]
    assert _wait_dead(pids, 30), "a rank outlived the launcher"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_every_remote_job(site: dict, tmp_path: Path, signum: int) -> None:
    """SIGTERM (a scheduler) or SIGINT (Ctrl-C: the children are in sessions of their own, so it reaches the head)."""
    hosts = _hostfile(site["work"], "node-a slots=1\nnode-b slots=1\n")
    (tmp_path / "pids").mkdir()
    (site["work"] / ".deepspeed_env").write_text(f"HFZ_PIDS={tmp_path / 'pids'}\n")
    head = subprocess.Popen([sys.executable, "-m", "hf_zero.launch.cli", "launch", "--hostfile", hosts, "--launcher", "ssh",
                             "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "hang.py"],
                            cwd=site["work"], env=site["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = set()
        deadline = time.monotonic() + 180
        while len(ready) < 2 and time.monotonic() < deadline:
            line = head.stdout.readline()
            if "READY" in line:
                ready.add(line.split()[-1])
        assert len(ready) == 2
        pids = [int((tmp_path / "pids" / r).read_text()) for r in ("0", "1")]
        head.send_signal(signum)
        rc = head.wait(timeout=90)
        assert rc == 128 + signum
        assert _wait_dead(pids, 30), "a rank outlived the launcher"
        assert f"got {signal.Signals(signum).name}: ending the job on every node" in head.stderr.read()
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()


# ------------------------------------------------------------------ planning, no processes


def _args(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(["launch", *argv])


def _plan(argv: list[str], cwd: Path, environ: dict | None = None, pdsh: bool = True):
    which = {"pdsh": "/usr/bin/pdsh" if pdsh else None, "ssh": "/usr/bin/ssh"}.get
    return hz_job.plan(_args(argv), environ or {}, cwd=str(cwd), which=which, probe=False)


def test_hostfile_format_and_its_errors(tmp_path: Path) -> None:
    path = _hostfile(tmp_path, "# c\n\nw0 slots=4\n  w1 slots=2 extra\n")
    assert hf.read_hostfile(path) == {"w0": 4, "w1": 2}
    for text, match in (("w0 slots=4\nw0 slots=2\n", "names w0 a second time"), ("w0 4\n", "line 1 'w0 4'"),
                        ("# nothing\n", "lists no host"), ("w0 slots=0\n", "slots >= 1")):
        with pytest.raises(LaunchError, match=match) as info:
            hf.read_hostfile(_hostfile(tmp_path, text))
        assert "\n" not in str(info.value) and str(info.value).endswith(".")
    with pytest.raises(LaunchError, match="does not exist"):
        hf.find_hostfile(str(tmp_path / "missing"))


def test_include_exclude_num_nodes_num_gpus_as_deepspeed(tmp_path: Path) -> None:
    pool = {"w0": 4, "w1": 4, "w2": 2}
    assert hf.select(pool, "w0@w1:0,2", "", "H") == {"w0": [0, 1, 2, 3], "w1": [0, 2]}
    assert hf.select(pool, "w2@w0:3", "", "H") == {"w0": [3], "w2": [0, 1]}  # hostfile order, not the filter's
    assert hf.select(pool, "", "w1:1@w2", "H") == {"w0": [0, 1, 2, 3], "w1": [0, 2, 3]}
    assert hf.trim(hf.select(pool, "", "", "H"), 2, 1, "H") == {"w0": [0], "w1": [0]}
    for inc, exc, match in (("w9", "", "names host w9"), ("w2:5", "", "slot 5 of w2"), ("", "w0@w1@w2", "leaves no host"),
                            ("w0", "w1", "mutually exclusive"), ("w0:x", "", "slot 'x'")):
        with pytest.raises(LaunchError, match=match):
            hf.select(pool, inc, exc, "H")
    path = _hostfile(tmp_path, "w0 slots=4\nw1 slots=4\n")
    with pytest.raises(LaunchError, match="more nodes than the 2"):
        hf.resolve(path, "", "", 3, None)
    with pytest.raises(LaunchError, match="cannot be combined"):
        hf.resolve(path, "w0", "", None, 2)


def test_the_tutorial_command_and_heterogeneous_hosts(tmp_path: Path) -> None:
    path = _hostfile(tmp_path, "worker-0 slots=8\nworker-1 slots=8\nworker-2 slots=8\n")
    job = _plan(["-H", path, "--num_nodes", "2", "--num_gpus", "8", "train.py", "--deepspeed", "--lr", "1e-4"],
                tmp_path, pdsh=False)
    assert job.launcher == "ssh" and job.hosts == ["worker-0", "worker-1"]
    for rank, (host, argv) in enumerate(job.commands):
        assert argv[:2] == ["ssh", host]
        assert f"--node_rank={rank} --master_addr=worker-0 --num_gpus 8 --no_ssh --num_nodes 2" in argv[2]
        assert argv[2].endswith("train.py --deepspeed --lr 1e-4")
    mixed = _plan(["-H", path, "--include", "worker-0@worker-1:1,3", "train.py"], tmp_path)
    (_, argv), = mixed.commands
    assert argv[:5] == ["pdsh", "-S", "-f", "1024", "-w"] and argv[5] == "worker-0,worker-1"
    assert "case %n in 0) set -- --num_gpus 8;; 1) set -- --include localhost:1,3;; esac &&" in argv[-1]
    with pytest.raises(LaunchError, match="cannot select GPU ids"):
        _plan(["-H", path, "--include", "worker-0@worker-1:1,3", "--launcher", "slurm", "train.py"], tmp_path)


def test_one_host_or_no_hostfile_is_todays_single_node_launch(tmp_path: Path) -> None:
    path = _hostfile(tmp_path, "only slots=3\n")
    local = _plan(["-H", path, "train.py"], tmp_path)
    assert isinstance(local, argparse.Namespace) and local.num_gpus == 3 and local.hostfile is None
    assert "--nproc-per-node=3" in cli.plan_launch(local, {}, 0).argv
    narrowed = _plan(["-H", path, "--include", "only:1,2", "train.py"], tmp_path)
    assert cli.plan_launch(narrowed, {}, 4).env_updates == {"CUDA_VISIBLE_DEVICES": "1,2"}
    forced = _plan(["-H", path, "--force_multi", "train.py"], tmp_path)
    assert isinstance(forced, hz_job.MultiNodeJob) and forced.hosts == ["only"]
    plain = _plan(["--num_gpus", "2", "train.py"], tmp_path)
    assert "--nproc-per-node=2" in cli.plan_launch(plain, {}, 0).argv
    by_hand = _plan(["-H", _hostfile(tmp_path, "a slots=2\nb slots=4\n"), "--no_ssh", "--node_rank", "1", "train.py"],
                    tmp_path)
    argv = cli.plan_launch(by_hand, {}, 4).argv
    assert "--nnodes=2" in argv and "--node-rank=1" in argv and "--master-addr=a" in argv and "--nproc-per-node=4" in argv


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--launcher", "openmpi"], "mpirun"),
        (["--launcher", "pbs"], "expected one of pdsh, ssh, slurm"),
        (["--launcher", "pdsh"], "there is none: pass --hostfile"),
        (["--ssh_port", "22"], "there is none"),
        (["--venv_script", "/v/bin/activate"], "--venv_script is for starting the hosts of a hostfile"),
        (["-H", "{hosts}", "--node_rank", "1"], "numbers the hosts"),
        (["-H", "{hosts}", "--ssh_port", "x"], "--ssh_port"),
        (["-H", "{hosts}", "--launcher", "pdsh"], "pdsh is not installed"),
        (["--launcher", "slurm"], "needs the number of nodes"),
        (["--launcher", "slurm", "--include", "a", "--num_nodes", "2"], "filter a hostfile"),
        (["--config_file", "x.yaml", "-H", "{hosts}"], "--config_file"),
    ],
)
def test_plan_errors_are_one_sentence(tmp_path: Path, argv: list[str], match: str) -> None:
    hosts = _hostfile(tmp_path, "a slots=1\nb slots=1\n")
    with pytest.raises(LaunchError, match=match) as info:
        _plan([a.replace("{hosts}", hosts) for a in argv] + ["train.py"], tmp_path, pdsh=False)
    assert "\n" not in str(info.value) and str(info.value).endswith(".")


def test_slurm_without_hostfile_and_the_master_from_the_step(tmp_path: Path) -> None:
    job = _plan(["--launcher", "slurm", "--num_gpus", "8", "train.py"], tmp_path, {"SLURM_NNODES": "4"})
    (_, argv), = job.commands
    assert argv[:8] == ["srun", "--nodes", "4", "--ntasks-per-node", "1", "--gpus-per-node", "8", "--kill-on-bad-exit=1"]
    assert argv[8:10] == ["sh", "-c"]
    assert '--node_rank="$SLURM_NODEID" --master_addr="$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n 1)"' \
        in argv[10]
    assert "--num_gpus 8 --no_ssh --num_nodes 4 --master_port 29500" in argv[10]


def test_forwarded_environment_is_deepspeeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "envfile").write_text("A=1\nPATH=/opt/bin:$PATH\nexport B='x y'\n")
    environ = {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "INFO", "UCX_NET_DEVICES": "eth0", "PYTHONPATH": "/p",
               "MLFLOW_RUN": "r", "MV2_X": "1", "HOME": "/h", "CUDA_VISIBLE_DEVICES": "0", "DS_ENV_FILE":
               str(tmp_path / "envfile")}
    lines = remote.exports(environ, "/launch dir")
    assert lines == ["export NCCL_IB_HCA=mlx5", "export NCCL_DEBUG=INFO", "export UCX_NET_DEVICES=eth0",
                     "export PYTHONPATH='/launch dir:/p'", "export MLFLOW_RUN=r", "export MV2_X=1",
                     "export A=1", 'export PATH="/opt/bin:$PATH"', "export B='x y'"]
    assert remote.redact(["export HF_TOKEN=hf_abc", "export MLFLOW_TRACKING_PASSWORD='p w'", "export A=1"]) == [
        "export HF_TOKEN=***", "export MLFLOW_TRACKING_PASSWORD=***", "export A=1"]
    aisc = remote.exports({**environ, "AISC_JOB_NAME": "j"}, "/w")
    assert not any(line.startswith(("export NCCL_IB_HCA", "export UCX_NET_DEVICES")) for line in aisc)
    (tmp_path / "envfile").write_text("no equals sign\n")
    with pytest.raises(LaunchError, match="line 1 'no equals sign' is not KEY=VALUE"):
        remote.exports(environ, "/w")
