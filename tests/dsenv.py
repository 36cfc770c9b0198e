"""DeepSpeed 0.19.8 on the CPU, as an oracle: its config parser, its losses and its checkpoints.

DeepSpeed is never imported into the test process (hf_zero must work without it, and importing it
changes what transformers and Accelerate do). It lives in its own virtual environment made with
``--system-site-packages``, so it shares this interpreter's torch and transformers and installs in
about 15 seconds (``DS_BUILD_OPS=0``: pure Python, no compiled ops). Oracle code runs there as a
subprocess; results come back as JSON or safetensors, never as pickles.

``.ci/run`` builds the environment before the tests; locally :func:`deepspeed_python` builds it on
first use. Where it cannot be built (no network to the package index), tests that need it skip and
say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path
from typing import Any

import pytest

DEEPSPEED_VERSION = "0.19.8"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_ENV = REPO / ".venv-deepspeed"
ENV_VAR = "HF_ZERO_DEEPSPEED_ENV"  # another folder for the environment (e.g. shared between checkouts)


def _env_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_ENV)


def _python(env: Path) -> Path:
    return env / "bin" / "python"


def _works(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import deepspeed, sys; sys.stdout.write(deepspeed.__version__)"],
        env=ds_environ(), capture_output=True, text=True, timeout=120,
    )
    return probe.returncode == 0 and probe.stdout.strip() == DEEPSPEED_VERSION


def build(env: Path | None = None) -> Path:
    """Make (or reuse) the DeepSpeed environment and return its interpreter; raises on failure."""
    env = env or _env_dir()
    python = _python(env)
    if _works(python):
        return python
    venv.EnvBuilder(system_site_packages=True, with_pip=True, clear=True).create(env)
    quiet = ["-q", "--disable-pip-version-check"]
    steps = [
        [str(python), "-m", "pip", "install", *quiet, "wheel", "setuptools"],
        [str(python), "-m", "pip", "install", *quiet, "--no-build-isolation", f"deepspeed=={DEEPSPEED_VERSION}"],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, env={**os.environ, "DS_BUILD_OPS": "0"}, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[2:5])} failed: {done.stderr.strip()[-800:]}")
    if not _works(python):
        raise RuntimeError(f"deepspeed=={DEEPSPEED_VERSION} installed in {env} but does not import")
    return python


_cached: dict[str, Any] = {}


def deepspeed_python() -> Path:
    """The DeepSpeed environment's interpreter, building it once per session; skips the test if impossible."""
    if "python" not in _cached:
        try:
            _cached["python"] = build()
        except Exception as e:  # no index, no compiler, ...: the oracle is unavailable, not the code wrong
            _cached["python"] = None
            _cached["why"] = f"DeepSpeed {DEEPSPEED_VERSION} could not be installed on the CPU here ({e})"
    if _cached["python"] is None:
        pytest.skip(_cached["why"])
    return _cached["python"]


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-built CPU ops (cpu_adam) go: inside its environment, not torch's shared cache.

    torch guards a build with a ``lock`` file and waits, without limit, for it to go; a build killed half-way
    (a timed-out test, a cancelled run) leaves it behind in ``~/.cache/torch_extensions`` for every later run on
    the machine. A folder of the environment's own lives and dies with it; :func:`clear_stale_lock` handles the rest.
    """
    return _env_dir() / "torch_extensions"


def clear_stale_lock(op: str, *, older_than_s: float = 1200) -> None:
    """Remove ``op``'s build lock when no build can hold it: its library exists, or it is older than any build."""
    import time

    for lock in _op_dirs_glob(op, "lock"):
        built = any(lock.parent.glob(f"{op}*.so"))
        if built or time.time() - lock.stat().st_mtime > older_than_s:
            lock.unlink(missing_ok=True)


def op_built(op: str) -> bool:
    """Whether DeepSpeed's CPU op ``op`` is already compiled in :func:`extensions_dir`."""
    return any(_op_dirs_glob(op, f"{op}*.so"))


def _op_dirs_glob(op: str, pattern: str) -> list[Path]:
    """``pattern`` in ``op``'s build folder: ``<dir>/<op>`` where TORCH_EXTENSIONS_DIR names the folder (as
    :func:`ds_environ` does), ``<dir>/py311_cpu/<op>`` where torch picked a folder per Python and device itself."""
    root = extensions_dir()
    return [*root.glob(f"{op}/{pattern}"), *root.glob(f"*/{op}/{pattern}")]


def ds_environ(**extra: str) -> dict[str, str]:
    """Environment for DeepSpeed on the CPU: its CPU accelerator, no CUDA, ops JIT-built into its own folder."""
    # PYTHONFAULTHANDLER: a rank that aborts in C++ (gloo's teardown did, now and then) prints where Python was
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def run_python(code: str, *, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` with DeepSpeed's interpreter (one process); raises with its stderr if it fails."""
    python = deepspeed_python()
    done = subprocess.run([str(python), "-c", textwrap.dedent(code)], env=ds_environ(**env),
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    if done.returncode != 0:
        raise AssertionError(f"the DeepSpeed oracle failed (rc {done.returncode}):\n{done.stderr[-8000:]}")
    return done


def run_torchrun(script: Path, nproc: int, *args: str, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun with DeepSpeed's interpreter on ``nproc`` CPU processes (gloo)."""
    python = deepspeed_python()
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
           str(script), *args]
    done = subprocess.run(cmd, env=ds_environ(**env), capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    if done.returncode != 0:
        raise AssertionError(f"the DeepSpeed oracle failed (rc {done.returncode}):\n{done.stderr[-8000:]}")
    return done


def parse_config(config: dict) -> dict:
    """DeepSpeed's verdict on a config: ``{"ok": True}`` or ``{"ok": False, "error": "..."}``.

    DeepSpeed's own parser refuses the string "auto": fill those values first, as transformers'
    ``HfTrainerDeepSpeedConfig`` does from the training arguments.
    """
    code = f"""
        import json, sys
        from deepspeed.runtime.config import DeepSpeedConfig
        cfg = json.loads({json.dumps(json.dumps(config))})
        try:
            DeepSpeedConfig(cfg)
            print(json.dumps({{"ok": True}}))
        except Exception as e:
            print(json.dumps({{"ok": False, "error": f"{{type(e).__name__}}: {{e}}"}}))
    """
    out = run_python(code, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_op(op: str = "cpu_adam", *, timeout: float = 1800) -> None:
    """JIT-compile DeepSpeed's CPU op ``op`` (a few minutes on two cores: -O3 over torch's headers) into its folder."""
    python = build()
    clear_stale_lock(op)
    builder = {"cpu_adam": "CPUAdamBuilder"}[op]
    done = subprocess.run([str(python), "-c", f"from deepspeed.ops.op_builder import {builder}; {builder}().load()"],
                          env=ds_environ(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not op_built(op):
        raise RuntimeError(f"DeepSpeed's {op} op did not build: {done.stderr.strip()[-800:]}")


if __name__ == "__main__":  # .ci/run: python -m tests.dsenv (prints where it is, or why not); --ops cpu_adam too
    try:
        print(f"DeepSpeed {DEEPSPEED_VERSION} oracle: {build()}")
        if "--ops" in sys.argv:
            build_op("cpu_adam")
            print(f"DeepSpeed's cpu_adam op: built in {extensions_dir()}")
    except Exception as e:
        print(f"DeepSpeed {DEEPSPEED_VERSION} oracle unavailable, its tests will skip: {e}", file=sys.stderr)
