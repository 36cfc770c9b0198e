"""The flags of ``hf-zero launch``: DeepSpeed's launcher flags, and Accelerate's beside them.

A table, apart from what the flags do (:mod:`hf_zero.launch.local` for this node's torchrun, :mod:`hf_zero.launch.job`
for a hostfile's nodes): what ``hf-zero launch --help`` lists changes here when DeepSpeed's launcher gains a flag, and
the process logic does not move. Accelerate's flags (read with ``--config_file``) are
:func:`hf_zero.integrations.accelerate_launch.add_arguments`'s, added to the same parser.
"""

from __future__ import annotations

import argparse

from hf_zero.integrations import accelerate_launch

#: DeepSpeed flags with no torchrun counterpart: parsed (so a DeepSpeed command line is read whole), then refused
#: by name in :func:`hf_zero.launch.local.plan_launch`.
UNSUPPORTED_FLAGS = (
    "elastic_training",
    "min_elastic_nodes",
    "max_elastic_nodes",
    "autotuning",
    "bind_cores_to_rank",
    "bind_core_list",
    "enable_each_rank_log",
    "save_pid",
    "comment",
    "account",
)


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``launch`` subcommand with every flag it reads; the caller sets its handler."""
    p = subparsers.add_parser(
        "launch",
        help="start a training script on every GPU of this node through torchrun (DeepSpeed's flags)",
        description="Start SCRIPT with torchrun, taking DeepSpeed launcher flags. Everything after "
        "SCRIPT is passed to it untouched. Multi-node: --hostfile H starts every host of H from here (over pdsh, "
        "ssh or srun), or run this on each node with --num_nodes, --node_rank and --master_addr.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=None,
        help="processes on this node (default: the visible GPUs; on a machine without GPUs, 1 CPU process)",
    )
    p.add_argument("--num_nodes", type=int, default=None, help="number of nodes (default 1, or every host of --hostfile)")
    p.add_argument("--node_rank", type=int, default=None, help="this node's index in [0, num_nodes)")
    p.add_argument("--master_addr", default=None, help="address of node 0 (default 127.0.0.1 on one node)")
    p.add_argument("--master_port", type=int, default=None, help="rendezvous port (default 29500)")
    p.add_argument(
        "--max_restarts", type=int, default=0, help="torchrun restarts of the whole group on failure"
    )
    p.add_argument("-i", "--include", default="", help='hosts/GPUs to use, e.g. "localhost:0,1" or "worker-0@worker-1:0,2"')
    p.add_argument("-e", "--exclude", default="", help='hosts/GPUs to leave out, e.g. "localhost:3" or "worker-1:0"')
    p.add_argument("-H", "--hostfile", default=None, help="DeepSpeed's hostfile ('HOST slots=N' lines): start every "
                   "host from here (default /job/hostfile when it exists)")
    p.add_argument("--launcher", default=None, help="how a hostfile's hosts are started: pdsh (default when installed), "
                   "ssh, or slurm (srun)")
    p.add_argument("--launcher_args", default=None, help="extra arguments for pdsh, ssh or srun, as one quoted string")
    p.add_argument("--ssh_port", default=None, help="ssh port of the hosts")
    p.add_argument("--force_multi", action="store_true", default=None, help="start a one-host hostfile over ssh too")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the check that every host answers over ssh")
    p.add_argument("--venv_script", default=None, help="a script every node sources first (a virtualenv's activate)")
    p.add_argument("--module", action="store_true", help="run SCRIPT as a module, like python -m")
    p.add_argument("--no_python", action="store_true", help="run SCRIPT directly, not through python")
    p.add_argument(
        "--no_local_rank",
        action="store_true",
        help="accepted for DeepSpeed compatibility: --local_rank is never appended, LOCAL_RANK is exported",
    )
    p.add_argument("--no_ssh", action="store_true", help="start this node only (--node_rank R), even with a hostfile")
    for name in UNSUPPORTED_FLAGS:
        if name not in ("elastic_training", "bind_cores_to_rank", "save_pid"):
            p.add_argument(f"--{name}", dest=name, default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(f"--{name}", dest=name, action="store_true", default=None, help=argparse.SUPPRESS)
    accelerate_launch.add_arguments(p)
    p.add_argument("script", help="the training script (or module with --module, program with --no_python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script, passed untouched")
    return p
