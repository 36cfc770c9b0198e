"""DeepSpeed's hostfile and the flags that narrow it (``--include``/``--exclude``, ``--num_nodes``, ``--num_gpus``).

The format and the filter syntax are DeepSpeed's (``deepspeed/launcher/runner.py`` of 0.19.8), so a hostfile and a
filter written for ``deepspeed`` select the same hosts and slots here:

- a line ``NAME slots=N`` (anything after it is ignored), ``#`` comment lines and blank lines;
- a filter ``NAME[:SLOT[,SLOT...]][@NAME...]``: ``--include`` keeps only what it names (a bare name: all its slots),
  ``--exclude`` drops it; hosts left with no slot are dropped; the hostfile's order is kept, because it is the order
  of the node ranks (the first host is node 0 and, by default, the master).

Where DeepSpeed is silent or lets a mistake through (a second entry for a host is its error too, but ``--num_nodes``
larger than the hostfile quietly runs fewer nodes), the error here is one sentence naming the flag or the line.
"""

from __future__ import annotations

import os
import re

from hf_zero.errors import LaunchError

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default (DLTS); used only when it exists

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")

Hosts = dict[str, list[int]]  # host -> the slot (GPU) ids it runs on, in node-rank order


def read_hostfile(path: str) -> dict[str, int]:
    """``{host: slots}`` in the file's order; every mistake is one sentence naming the file and the line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LaunchError(f"--hostfile {path} cannot be read ({e.strerror or e}); pass an existing hostfile.") from e
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.search(line)
        if match is None:
            raise LaunchError(f"hostfile {path} line {number} {line!r} is not 'HOSTNAME slots=N' (DeepSpeed's format).")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise LaunchError(f"hostfile {path} line {number} names {host} a second time; list each host once.")
        if slots < 1:
            raise LaunchError(f"hostfile {path} line {number} gives {host} slots={slots}; a host needs slots >= 1.")
        pool[host] = slots
    if not pool:
        raise LaunchError(f"hostfile {path} lists no host; write one 'HOSTNAME slots=N' line per node.")
    return pool


def find_hostfile(given: str | None) -> str | None:
    """The hostfile to read: the one given (which must exist), else DeepSpeed's default if it exists, else None."""
    if given is not None:
        if not os.path.isfile(given):
            raise LaunchError(f"--hostfile {given} does not exist; pass the path of a file of 'HOSTNAME slots=N' lines.")
        return given
    return DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE) else None


def parse_filter(text: str, flag: str) -> dict[str, list[int]]:
    """``NAME[:SLOT,...]@...`` as ``{name: slots}`` (an empty list: the whole host), names and slots in the order given.

    The one parser of DeepSpeed's filter syntax: the hostfile's hosts (:func:`select`) and, without a hostfile, this
    node's GPUs (``hf_zero.launch.local``) both read it."""
    named: dict[str, list[int]] = {}
    for spec in text.split("@"):
        name, colon, slot_text = spec.strip().partition(":")
        if not name:
            raise LaunchError(f"{flag} {text!r} has an empty host name; write NAME[:SLOT,...] joined by '@'.")
        slots = []
        for s in slot_text.split(",") if colon else []:
            if not s.strip().isdigit():
                raise LaunchError(f"{flag} {text!r} names slot {s.strip()!r} of {name}; slots are GPU ids such as 0,1.")
            slots.append(int(s))
        if colon and not slots:
            raise LaunchError(f"{flag} {text!r} names no slot after '{name}:'; drop the colon to mean the whole host.")
        # in the order given, a repeat dropped (DeepSpeed's _stable_remove_duplicates): the order of a node's slots is
        # its CUDA_VISIBLE_DEVICES, so the first slot named is local rank 0
        named[name] = list(dict.fromkeys(named.get(name, []) + slots))
    return named


def select(pool: dict[str, int], include: str, exclude: str, hostfile: str) -> Hosts:
    """Apply ``--include``/``--exclude`` to the hostfile's slots, as DeepSpeed's ``parse_resource_filter`` does."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive.")
    hosts: Hosts = {h: list(range(n)) for h, n in pool.items()}
    if not include and not exclude:
        return hosts
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    named = parse_filter(text, flag)
    for name, slots in named.items():
        if name not in hosts:
            raise LaunchError(f"{flag} {text!r} names host {name}, which hostfile {hostfile} does not list.")
        missing = [s for s in slots if s not in hosts[name]]
        if missing:
            raise LaunchError(f"{flag} {text!r} names slot {missing[0]} of {name}, which has slots "
                              f"0-{pool[name] - 1} in hostfile {hostfile}.")
    if include:
        kept = {h: (named[h] or hosts[h]) for h in hosts if h in named}
    else:
        kept = {h: ([s for s in hosts[h] if s not in named[h]] if named.get(h) else ([] if h in named else hosts[h]))
                for h in hosts}
    kept = {h: s for h, s in kept.items() if s}
    if not kept:
        raise LaunchError(f"{flag} {text!r} leaves no host of hostfile {hostfile} to run on.")
    return kept


def trim(hosts: Hosts, num_nodes: int | None, num_gpus: int | None, hostfile: str) -> Hosts:
    """The first ``num_nodes`` hosts, each with slots ``[0, num_gpus)``, as DeepSpeed's ``--num_nodes``/``--num_gpus``."""
    if num_nodes is not None:
        if num_nodes < 1:
            raise LaunchError(f"--num_nodes: got {num_nodes}, expected an integer >= 1.")
        if num_nodes > len(hosts):
            raise LaunchError(f"--num_nodes {num_nodes} asks for more nodes than the {len(hosts)} hostfile {hostfile} "
                              "lists; add hosts to it or lower --num_nodes.")
        hosts = dict(list(hosts.items())[:num_nodes])
    if num_gpus is not None:
        if num_gpus < 1:
            raise LaunchError(f"--num_gpus: got {num_gpus}, expected an integer >= 1.")
        hosts = {h: list(range(num_gpus)) for h in hosts}
    return hosts


def resolve(path: str, include: str, exclude: str, num_nodes: int | None, num_gpus: int | None) -> Hosts:
    """The hosts and slots a launch runs on: the hostfile at ``path`` narrowed by the four flags."""
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude "
                          "(they already choose the hosts and GPUs).")
    return trim(select(read_hostfile(path), include, exclude, path), num_nodes, num_gpus, path)
