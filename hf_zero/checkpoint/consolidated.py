"""Full weights in Hugging Face's layout, written one tensor at a time.

``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` when over ``max_shard_size``), ``config.json`` and the
generation config: what ``from_pretrained`` reads. The shard plan comes from
``huggingface_hub.split_torch_state_dict_into_shards``; the files are written by a small
streaming writer (header first, then each tensor's bytes as it arrives) because safetensors'
own writer needs every tensor of a file in memory at once, which is exactly what consolidating
a model too big for one device must avoid.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from hf_zero.checkpoint.format import CheckpointReader, read_meta, resolve_tag
from hf_zero.errors import CheckpointError
from hf_zero.expert.slices import gather_whole, slice_of
from hf_zero.parallel.tp_split import cut_entry, join_entry, parse_slice_name, split_of
from hf_zero.precision.policies import SAFETENSORS_DTYPES

if TYPE_CHECKING:
    from hf_zero.checkpoint.state import TrainState


class StreamingSafetensorsWriter:
    """Write a safetensors file whose tensors are produced one by one, in the declared order."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> None:
        self.path, self.tmp = path, path + ".tmp"
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self.order: list[tuple[str, int]] = []
        for name, dtype, shape in entries:
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor '{name}' has dtype {dtype}, which safetensors cannot store")
            n = torch.empty((), dtype=dtype).element_size()
            for d in shape:
                n *= d
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.order.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, nbytes = self.order[self.next]
        if name != want:
            raise RuntimeError(f"safetensors stream: expected '{want}' next, got '{name}'")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        if len(data) != nbytes:
            raise RuntimeError(f"safetensors stream: '{name}' has {len(data)} bytes, declared {nbytes}")
        self.f.write(data)
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            self.f.close()
            os.remove(self.tmp)
            raise RuntimeError(f"safetensors stream: {len(self.order) - self.next} tensors were never written to {self.path}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)


def plan_shards(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int | str) -> tuple[dict[str, list[str]], dict | None]:
    """``{filename: [tensor names]}`` and the index (None for a single file), as transformers names them."""
    from huggingface_hub import split_torch_state_dict_into_shards

    metas = {n: torch.empty(shape, dtype=dt, device="meta") for n, dt, shape in entries}
    split = split_torch_state_dict_into_shards(metas, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors")
    files = {f: list(names) for f, names in split.filename_to_tensors.items()}
    index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)} if split.is_sharded else None
    return files, index


def write_weights(
    out_dir: str,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor | None],
    max_shard_size: int | str,
    writer: bool,
    progress: Iterable | None = None,
    filename: str | None = None,
) -> list[str]:
    """Write every entry, asking ``produce(name)`` for its full value in order.

    ``produce`` runs on every rank (it may be a collective); only the ``writer`` rank writes.
    ``filename`` puts everything in that one file (no index) instead of transformers' shards.
    Returns the files written.
    """
    if filename is not None:
        files, index = {filename: [n for n, _, _ in entries]}, None
    else:
        files, index = plan_shards(entries, max_shard_size)
    spec = {n: (n, dt, shape) for n, dt, shape in entries}
    bar = progress
    for fname, names in files.items():
        w = StreamingSafetensorsWriter(os.path.join(out_dir, fname), [spec[n] for n in names]) if writer else None
        for n in names:
            value = produce(n)
            if w is not None:
                assert value is not None
                w.write(n, value.to(spec[n][1]))
            if bar is not None:
                bar.update(1)  # type: ignore[attr-defined]
        if w is not None:
            w.close()
    if writer and filename is None:
        stale = os.path.join(out_dir, "model.safetensors.index.json")
        if index is not None:
            tmp = stale + ".tmp"
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            os.replace(tmp, stale)
        elif os.path.exists(stale):
            os.remove(stale)  # a single file now: an old index would point from_pretrained at old shards
    return list(files)


def save_pickled_shards(state_dict: dict[str, torch.Tensor], out_dir: str, max_shard_size: int | str) -> list[str]:
    """What DeepSpeed's and Accelerate's ``safe_serialization=False`` write: ``pytorch_model.bin``, or its shards and
    ``pytorch_model.bin.index.json`` above ``max_shard_size`` (huggingface_hub's writer, which also removes an older
    save's shards of that name). Returns the files written. Only for a caller that names the pickle format: the
    whole state dict is in host memory, as in those peers."""
    from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards

    os.makedirs(out_dir, exist_ok=True)
    save_torch_state_dict(state_dict, out_dir, max_shard_size=max_shard_size, safe_serialization=False)
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size)
    return list(split.filename_to_tensors)


def save_model_config(module: torch.nn.Module, out_dir: str, dtype: torch.dtype | None) -> None:
    """``config.json`` (with the saved dtype) and ``generation_config.json`` where the model has them.

    As transformers' ``save_pretrained`` does, ``architectures`` names the class that was trained
    (the config may still name the class it was first saved from, or nothing for ``from_config``),
    so ``from_pretrained``, ``hf-zero estimate`` and the model card pick the right head. A PEFT
    model's base config is written, with its adapter configs beside it (see integrations/peft.py).
    """
    from transformers import PreTrainedModel

    from hf_zero.training import peft_model as hz_peft

    base = hz_peft.base_model_of(module)
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        import copy

        cfg = copy.deepcopy(config)
        if dtype is not None:
            cfg.dtype = dtype
        if isinstance(base, PreTrainedModel):
            cfg.architectures = [type(base).__name__]
        cfg.save_pretrained(out_dir)
    if base is not module:
        hz_peft.write_adapter_configs(module, out_dir)
    gen = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if gen is not None and callable(can_generate) and can_generate():
        gen.save_pretrained(out_dir)


def engine_entries(module: torch.nn.Module, dtype: torch.dtype | None) -> tuple[list, dict[str, torch.Tensor]]:
    """The tensors ``save_pretrained`` writes: the state dict with tied duplicates dropped (first name kept)."""
    seen: set[int] = set()
    entries, tensors = [], {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        split, experts = split_of(t), slice_of(t)
        shape = tuple(t.shape) if split is None else split.full_shape
        if experts is not None:  # expert parallelism: the model's fused tensor of every expert
            shape = experts.full_shape(t)
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        entries.append((name, dt, shape))
        tensors[name] = t
    return entries, tensors


class OneUnitAtATime:
    """Whole values of a train state's tensors, with at most one stage-3 group gathered at a time.

    Asking for a tensor of another group releases the previous one, so walking a state dict in
    module order gathers each unit once and never holds two.
    """

    def __init__(self, state: TrainState) -> None:
        self.optimizer = state.optimizer
        if self.optimizer is not None:
            self.optimizer.release_inference()
        self.current: Any = None
        self.tp = state.tensor_parallel

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, made whole first if its shard group keeps only shards between uses; a tensor-parallel
        slice or an expert-parallel block of experts comes back as a new tensor, the whole weight (an all-gather over
        its group: every rank of it calls)."""
        g = self.optimizer.group_of(t) if self.optimizer is not None else None
        if g is not None and not g.resident and g is not self.current:
            self.release()
            g.gather(None)
            g.wait()
            self.current = g
        experts = slice_of(t)
        if experts is not None:  # this rank's experts: the EP group's slices back into the model's fused tensor
            return gather_whole(t, experts)
        split = split_of(t)
        if split is None or self.tp is None:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(split.size)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.tp.tp_group)
        return torch.cat(parts, dim=split.dim)

    def release(self) -> None:
        if self.current is not None:
            self.current.reshard()
            self.current = None


def save_pretrained(state: TrainState, save_directory: str, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> list[str]:
    """Consolidate the trained weights into ``save_directory`` (collective; rank 0 writes).

    Stage-3 units are gathered one at a time as their tensors come up, and released when the next
    unit starts, so no rank holds more than one unit beyond its shard (plus the root unit, which
    holds the tied embeddings).
    """
    import torch.distributed as dist

    lay = state.layout  # the engine says which ranks take part and which one writes
    files, entries = _write_state(state, save_directory, dtype, max_shard_size=max_shard_size)
    if lay.rank == 0:
        save_model_config(state.module, save_directory, next((dt for _, dt, _ in entries if dt.is_floating_point), None))
    dist.barrier(lay.group)
    return files


def save_single_file(state: TrainState, save_dir: str, filename: str, exclude_frozen: bool = False) -> str:
    """The module's whole state dict, in its own dtypes, as one file (collective; rank 0 writes).

    A name ending in ``.safetensors`` gets a safetensors file, streamed one tensor at a time. Any
    other name (DeepSpeed's default ``pytorch_model.bin``) gets what DeepSpeed's ``save_16bit_model``
    writes there: ``torch.save`` of the state dict, tied weights under each of their names, which
    transformers and ``torch.load(weights_only=True)`` read without running code. That file is built
    whole in rank 0's host memory first, as DeepSpeed builds it.
    """
    import torch.distributed as dist

    if filename.endswith(".safetensors"):
        _write_state(state, save_dir, None, filename=filename, exclude_frozen=exclude_frozen)
    else:
        _write_pickled_state(state, save_dir, filename, exclude_frozen)
    dist.barrier(state.layout.group)
    return os.path.join(save_dir, filename)


def _state_entries(state: TrainState, dtype: torch.dtype | None, exclude_frozen: bool) -> tuple[list, dict[str, torch.Tensor]]:
    """``engine_entries`` of the train state's module, less its frozen parameters when asked."""
    entries, tensors = engine_entries(state.module, dtype)
    if exclude_frozen:
        entries = [e for e in entries if not (isinstance(tensors[e[0]], torch.nn.Parameter) and not tensors[e[0]].requires_grad)]
    return entries, tensors


def _host_copy(units: OneUnitAtATime, rank: int) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A tensor's whole value on rank 0's host (``None`` elsewhere); a collective on stage 3 and tensor parallel."""

    def copy(t: torch.Tensor) -> torch.Tensor | None:
        full = units.full(t)
        # One copy (device to host, or a host clone): a writer may hand the bytes to numpy, which must
        # not pin the unit's storage (it is resized to 0 when the unit is released).
        return full.detach().to("cpu", copy=True) if rank == 0 else None

    return copy


def rank0_state_dict(state: TrainState, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """The module's whole state dict in host memory on rank 0 (``None`` on the others; collective).

    Each tensor is gathered once and copied to rank 0's host only, one stage-3 unit at a time; a tied weight's
    later names share its first name's tensor, as in ``state_dict()``. For the writers of a file built whole
    (the pickles DeepSpeed and Accelerate write); ``from_pretrained`` folders stream instead (:func:`_write_state`).
    """
    rank = state.layout.rank
    units = OneUnitAtATime(state)
    entries, tensors = _state_entries(state, None, exclude_frozen)
    host = _host_copy(units, rank)
    with torch.no_grad():
        values = {name: host(tensors[name]) for name, _, _ in entries}
    units.release()
    if rank != 0:
        return None
    first = {id(t): name for name, t in tensors.items()}
    return {name: values[first[id(t)]] for name, t in state.module.state_dict(keep_vars=True).items()
            if first[id(t)] in values}


def _write_pickled_state(state: TrainState, save_dir: str, filename: str, exclude_frozen: bool) -> None:
    """``torch.save`` of the whole state dict into ``save_dir/filename`` on rank 0, replaced atomically."""
    out = rank0_state_dict(state, exclude_frozen)
    if out is None:
        return
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, filename)
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)


def _write_state(
    state: TrainState, out_dir: str, dtype: torch.dtype | None, max_shard_size: int | str = "5GB",
    filename: str | None = None, exclude_frozen: bool = False,
) -> tuple[list[str], list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Stream the module's tensors into ``out_dir`` (collective; rank 0 writes), one stage-3 unit gathered at a time.

    Returns the files written and the entries (name, dtype, shape) they hold.
    """
    rank = state.layout.rank
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    units = OneUnitAtATime(state)
    entries, tensors = _state_entries(state, dtype, exclude_frozen)
    host = _host_copy(units, rank)

    def produce(name: str) -> torch.Tensor | None:
        return host(tensors[name])

    with torch.no_grad():
        files = write_weights(out_dir, entries, produce, max_shard_size, writer=rank == 0, filename=filename)
    units.release()
    return files, entries


def consolidate(
    checkpoint_dir: str, out_dir: str, tag: str | None = None, max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = torch.float32, progress: bool = True,
) -> list[str]:
    """Offline, on a CPU: a resume checkpoint's weights as a ``from_pretrained`` folder.

    Trainable weights come from the fp32 masters (``dtype=None`` keeps the dtype the model
    trained in); memory is bounded by the largest single tensor, as each one is assembled from
    the rank files' slices, written, and dropped.
    """
    from tqdm.auto import tqdm

    path, entries, produce = checkpoint_weights(checkpoint_dir, tag, dtype)
    if read_meta(path).get("frozen_excluded"):
        raise CheckpointError(
            f"{path} was saved with exclude_frozen_parameters=True and holds no values for the frozen parameters, so "
            "it makes no from_pretrained folder alone; load it into the engine (the frozen values come from the "
            "model) and call engine.save_pretrained")
    os.makedirs(out_dir, exist_ok=True)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path} has no config.json (the model was not a transformers model); nothing to build a from_pretrained folder from")
    bar = tqdm(total=len(entries), desc="consolidating", unit="tensor", disable=not progress)
    files = write_weights(out_dir, entries, produce, max_shard_size, writer=True, progress=bar)
    bar.close()
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    floats = [dt for _, dt, _ in entries if dt.is_floating_point]
    if floats:
        cfg.dtype = floats[0]
    cfg.save_pretrained(out_dir)
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        import shutil

        shutil.copyfile(gen, os.path.join(out_dir, "generation_config.json"))
    return files


def checkpoint_weights(
    checkpoint_dir: str, tag: str | None, dtype: torch.dtype | None, exclude_frozen: bool = False
) -> tuple[str, list[tuple[str, torch.dtype, tuple[int, ...]]], Any]:
    """A resume checkpoint's tensors: its folder, (name, dtype, shape) of each, and a function that reads one whole.

    ``exclude_frozen`` leaves out the parameters that were saved as not trainable; a checkpoint saved with
    ``exclude_frozen_parameters=True`` has no values for them, so they are left out of it anyway.
    """
    path = resolve_tag(checkpoint_dir, tag)
    meta = read_meta(path)
    reader = CheckpointReader(path, int(meta["world_size"]))
    damaged = reader.damaged()
    if damaged:
        raise CheckpointError(damaged[0])
    entries, kinds = [], {}
    slices: dict[str, list[str]] = {}  # a tensor-parallel weight or EP experts: its slices' names, by rank (parallel/tp_split.py)
    for name, info in meta["params"].items():
        if (exclude_frozen or meta.get("frozen_excluded")) and not info.get("trainable", True):
            continue
        saved = getattr(torch, info["dtype"])
        dt = dtype if dtype is not None and saved.is_floating_point else saved
        kinds[name] = ("master" if ("master", name) in reader.index else "frozen", info)
        cut = parse_slice_name(name)
        if cut is None:
            entries.append((name, dt, tuple(info["shape"])))
            continue
        whole, r, size = cut
        if whole not in slices:
            slices[whole] = [""] * size
            entries.append((whole, dt, tuple(cut_entry(info)["full_shape"])))
        slices[whole][r] = name
    for name, (r, key) in reader.buffers.items():  # rank 0's, or in a pipeline each stage's
        if name not in kinds:
            t = reader.tensor(r, key)
            entries.append((name, t.dtype, tuple(t.shape)))
            kinds[name] = ("buffer", None)

    def produce(name: str) -> torch.Tensor:
        if name in slices:
            parts = [produce(key) for key in slices[name]]
            return join_entry(parts, cut_entry(kinds[slices[name][0]][1]))
        kind, info = kinds[name]
        if kind == "buffer":
            return reader.tensor(*reader.buffers[name])
        shape = info["shape"]
        n = 1
        for d in shape:
            n *= d
        buf = torch.empty(n, dtype=torch.float32 if kind == "master" else getattr(torch, info["dtype"]))
        reader.read(kind, name, 0, n, buf)
        out = buf.view(shape)
        want = dtypes.get(name) or dtypes[parse_slice_name(name)[0]]
        return out if out.dtype == want else out.to(want)

    dtypes = {name: dt for name, dt, _ in entries}
    return path, entries, produce


def frozen_left_out(checkpoint_dir: str, tag: str | None = None) -> set[str]:
    """The frozen parameters a checkpoint saved with ``exclude_frozen_parameters=True`` holds no values for."""
    meta = read_meta(resolve_tag(checkpoint_dir, tag))
    if not meta.get("frozen_excluded"):
        return set()
    return {n for n, info in meta["params"].items() if not info.get("trainable", True)}


def read_state_dict(
    checkpoint_dir: str, tag: str | None = None, dtype: torch.dtype | None = torch.float32, exclude_frozen: bool = False,
) -> dict[str, torch.Tensor]:
    """Offline, on a CPU: a resume checkpoint's whole model as a state dict (fp32 masters by default), buffers included."""
    _, entries, produce = checkpoint_weights(checkpoint_dir, tag, dtype, exclude_frozen)
    return {name: produce(name) for name, _, _ in entries}
