"""The checkpoint's file layer (hf_zero/checkpoint/fileio.py): files it writes are safetensors files that
safetensors' own reader reads back equal, its hash is the file's sha256, its ranged reads return the bytes asked
for, damaged files are refused in a sentence, and a rank's share is cut into balanced files for its threads."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_zero.checkpoint import fileio
from hf_zero.checkpoint.fileio import Piece, io_threads, read_file_pieces, read_header, write_file
from hf_zero.checkpoint.format import MAX_FILE_BYTES, MIN_FILE_BYTES
from hf_zero.checkpoint.save import split_files
from hf_zero.errors import CheckpointError


def _items() -> list[tuple[str, torch.Tensor, torch.dtype]]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1000, 37, generator=g)
    return [
        ("master|a.weight", big, torch.float32),
        ("frozen|b", torch.randn(333, generator=g).to(torch.bfloat16), torch.bfloat16),
        ("master|c", big[:, 3], torch.float32),  # a strided view: written through the staging buffer
        ("frozen|half", torch.randn(257, generator=g), torch.float16),  # stored in another dtype than it has
        ("buffer|ids", torch.arange(-5, 12, dtype=torch.int64).reshape(1, 17), torch.int64),
        ("buffer|mask", torch.rand(9, generator=g) > 0.5, torch.bool),
        ("optim.step|s", torch.tensor(3.5), torch.float32),  # 0-d
        ("rng.torch_cpu", torch.get_rng_state(), torch.uint8),
        ("empty", torch.zeros(0, 4), torch.float32),
    ]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 96 bytes, so that every tensor above crosses chunk boundaries (and pieces end mid-chunk)."""
    monkeypatch.setattr(fileio, "CHUNK_BYTES", 96)


@pytest.mark.parametrize("chunks", ["default", "small"])
def test_written_file_is_safetensors_and_hash_is_the_files(tmp_path: Path, chunks: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if chunks == "small":
        monkeypatch.setattr(fileio, "CHUNK_BYTES", 96)
    path = str(tmp_path / "f.safetensors")
    items = _items()
    digest = write_file(path, items, {"format": "hf_zero.resume/1"})
    assert digest == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "hf_zero.resume/1"}
        assert sorted(f.keys()) == sorted(k for k, _, _ in items)
        for key, t, dtype in items:
            got = f.get_tensor(key)
            assert got.dtype == dtype and got.shape == t.shape, key
            assert torch.equal(got, t.to(dtype)), key
    raw = Path(path).read_bytes()
    (size,) = __import__("struct").unpack("<Q", raw[:8])
    assert size % 8 == 0 and json.loads(raw[8 : 8 + size])["__metadata__"] == {"format": "hf_zero.resume/1"}


def test_ranged_reads_into_any_destination(tmp_path: Path, small_chunks: None) -> None:
    path = str(tmp_path / "f.safetensors")
    items = _items()
    write_file(path, items)
    big, bf = items[0][1].reshape(-1), items[1][1]
    out_a = torch.full((600,), -1.0)
    out_b = torch.empty(100, dtype=torch.float32)  # read as bf16, cast into fp32
    out_ids = torch.empty(17, dtype=torch.int64)
    read_file_pieces(path, [Piece("master|a.weight", 17, 617, out_a), Piece("frozen|b", 200, 300, out_b),
                            Piece("buffer|ids", 0, 17, out_ids), Piece("empty", 0, 0, torch.empty(0))])
    assert torch.equal(out_a, big[17:617])
    assert torch.equal(out_b, bf[200:300].float())
    assert torch.equal(out_ids, torch.arange(-5, 12))


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    write_file(str(path), _items())
    out = torch.empty(10)
    with pytest.raises(CheckpointError, match=r"elements \[0, 40000\) of 'master\|a.weight' are outside the tensor"):
        read_file_pieces(str(path), [Piece("master|a.weight", 0, 40000, torch.empty(40000))])
    with pytest.raises(CheckpointError, match="has no tensor 'master|nope'"):
        read_file_pieces(str(path), [Piece("master|nope", 0, 10, out)])
    start, head = read_header(str(path))
    cut = start + head["master|a.weight"]["data_offsets"][1] // 2
    path.write_bytes(path.read_bytes()[:cut])  # a file cut inside its first tensor
    with pytest.raises(CheckpointError, match="ends inside tensor 'master|a.weight'"):
        read_file_pieces(str(path), [Piece("master|a.weight", 0, 37000, torch.empty(37000))])
    path.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_header(str(path))
    path.write_bytes((40).to_bytes(8, "little") + b"{not json" + b" " * 31)
    with pytest.raises(CheckpointError, match="header that is not JSON"):
        read_header(str(path))


def test_dtype_safetensors_cannot_store_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'buffer|z' has dtype torch.complex128"):
        write_file(str(tmp_path / "z.safetensors"), [("buffer|z", torch.zeros(2, dtype=torch.complex128), torch.complex128)])


def test_share_is_cut_into_balanced_files() -> None:
    mib = 2**20
    assert split_files([10 * mib, 20 * mib], 8) == [[0, 1]]  # a small share: one file
    sizes = [100 * mib] * 64  # 6.4 GiB over 16 threads: 16 files of 4 tensors
    parts = split_files(sizes, 16)
    assert len(parts) == 16 and all(len(p) == 4 for p in parts)
    assert [i for p in parts for i in p] == list(range(64))  # every tensor once, in order
    assert len(split_files(sizes, 2)) == 4  # no file over MAX_FILE_BYTES (2 GiB) with 2 threads
    assert all(sum(sizes[i] for i in p) <= MAX_FILE_BYTES for p in split_files(sizes, 2))
    assert split_files([3 * MAX_FILE_BYTES, mib], 4) == [[0], [1]]  # one tensor over the limit keeps a file to itself
    assert len(split_files([MIN_FILE_BYTES] * 3, 16)) == 3  # none below MIN_FILE_BYTES
    assert split_files([], 4) == [[]]


def test_io_threads_is_the_ranks_share_of_its_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fileio.IO_THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert io_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert io_threads() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert io_threads() == 2  # never fewer than 2: a write overlaps a hash
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert io_threads() == 16  # one disk gains nothing past that
    monkeypatch.setenv(fileio.IO_THREADS_ENV, "3")
    assert io_threads() == 3
    monkeypatch.setenv(fileio.IO_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="HF_ZERO_CHECKPOINT_THREADS='many' is not a thread count"):
        io_threads()
