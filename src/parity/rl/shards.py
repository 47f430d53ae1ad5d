"""Sharded checkpoints on disk in a form that is read without pickle.

`torch.distributed.checkpoint` (DCP) plans which process reads which rows of which tensor, whatever
the learner count that saved them; Parity keeps that. Its file storage does not suit a checkpoint that
users share: it pickles its index (`.metadata`) and every non-tensor value, and unpickles them on
load, so a run directory with a rewritten `.metadata` would run its author's code in `parity train
--resume` and `parity eval`. Here the bytes on disk are Parity's own: each process writes its shards
as one safetensors file (`__RANK_0.safetensors`), and the coordinator writes the index as
`metadata.json`, which `read_index` checks field by field before DCP sees it. Nothing else in the
folder is read.

Only tensors are stored (the weights and AdamW's moments and step counts); the optimizer's
hyperparameters are the trainer's own, from the run's config, which a resume checks against the saved one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from parity.files import JSONError, parse_json
from parity.folders import atomic_write_json

INDEX = "metadata.json"
INDEX_FORMAT = 1
MAX_INDEX_BYTES = 64 * 2**20  # an index lists tensors, not their values: far below this
SHARD_FILE = re.compile(r"__\d+_\d+\.safetensors")
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
}


class ShardWriter(FileSystemWriter):
    """DCP's file writer with the shards as safetensors and the index as JSON."""

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.safetensors"  # the prefix DCP gave this process: __RANK_
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(f"{item.index.fqn}: only tensors go into a sharded checkpoint")
            tensor = planner.resolve_data(item).detach().to("cpu").contiguous()
            if tensor.untyped_storage().data_ptr() in seen:  # tied weights: safetensors stores no shared memory
                tensor = tensor.clone()
            seen.add(tensor.untyped_storage().data_ptr())
            tensors[item.index.fqn] = tensor
        data = safetensors_bytes(tensors)
        with open(Path(self.path) / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        results = [
            WriteResult(index=item.index, size_in_bytes=tensors[item.index.fqn].nbytes, storage_data=name)
            for item in plan.items
        ]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = {r.index: r.storage_data for part in results for r in part}
        tensors = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                raise ValueError(f"{fqn}: only tensors go into a sharded checkpoint")
            tensors[fqn] = {
                "dtype": str(entry.properties.dtype).removeprefix("torch."),
                "size": list(entry.size),
                "chunks": [
                    {
                        "offsets": list(c.offsets),
                        "sizes": list(c.sizes),
                        "file": files[MetadataIndex(fqn, c.offsets)],
                    }
                    for c in entry.chunks
                ],
            }
        atomic_write_json(Path(self.path) / INDEX, {"format": INDEX_FORMAT, "tensors": tensors})


class ShardReader(FileSystemReader):
    """DCP's file reader taking the index from `read_index` and the tensors from the safetensors shards."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_index(Path(self.path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan, planner) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise ValueError(f"{item.storage_index.fqn}: a sharded checkpoint holds only tensors")
            by_file.setdefault(self.storage_data[item.storage_index], []).append(item)
        for name, items in by_file.items():
            path = Path(self.path) / name
            try:
                with safe_open(str(path), "pt") as f:
                    for item in items:
                        target = planner.resolve_tensor(item).detach()
                        target.copy_(_read_rows(f, path, item, target))
                        planner.commit_tensor(item, target)
            except SafetensorError as e:
                raise ValueError(f"{path.name}: not a readable safetensors file ({e})") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read_rows(f, path: Path, item, target: torch.Tensor) -> torch.Tensor:
    """The part of a stored chunk that `item` asks for, checked against what the index promised."""
    key = item.storage_index.fqn
    if key not in f.keys():
        raise ValueError(f"{path.name}: no tensor {key}, which {INDEX} places there")
    rows = f.get_slice(key)
    wanted = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
    if len(rows.get_shape()) != len(wanted) or any(s.stop > n for s, n in zip(wanted, rows.get_shape())):
        raise ValueError(f"{path.name}: {key} is {rows.get_shape()}, smaller than {INDEX} says")
    tensor = rows[wanted] if wanted else f.get_tensor(key)
    if tensor.shape != target.shape or tensor.dtype != target.dtype:
        raise ValueError(f"{path.name}: {key} holds {tuple(tensor.shape)} {tensor.dtype}, not {tuple(target.shape)}")
    return tensor


def read_index(folder: Path) -> Metadata:
    """DCP's Metadata from `folder/metadata.json`, every field checked; ValueError naming the problem."""
    path = folder / INDEX
    if not path.is_file():
        pickled = (
            " (a checkpoint of an earlier Parity, whose pickled index is not read)"
            if (folder / ".metadata").exists()
            else ""
        )
        raise ValueError(f"no {INDEX}{pickled}")
    if path.stat().st_size > MAX_INDEX_BYTES:
        raise ValueError(f"{INDEX} is {path.stat().st_size} bytes, more than an index holds")
    try:
        index = parse_json(path.read_text(encoding="utf-8"))
    except (JSONError, UnicodeDecodeError) as e:
        raise ValueError(f"{INDEX}: {e}") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or not isinstance(index.get("tensors"), dict):
        raise ValueError(f'{INDEX}: expected {{"format": {INDEX_FORMAT}, "tensors": {{...}}}}')
    entries: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, str] = {}
    for fqn, entry in index["tensors"].items():
        entries[fqn] = _tensor_entry(folder, fqn, entry, storage)
    return Metadata(state_dict_metadata=entries, storage_data=storage)


def _sizes(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 8 and all(type(v) is int and v >= 0 for v in value)


def _tensor_entry(folder: Path, fqn: str, entry: Any, storage: dict[MetadataIndex, str]) -> TensorStorageMetadata:
    where = f"{INDEX}: {fqn}"
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES or not _sizes(entry.get("size")):
        raise ValueError(f"{where}: expected a dtype ({', '.join(DTYPES)}), a size and chunks")
    size, chunks = entry["size"], entry.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ValueError(f"{where}: chunks must be a non-empty list")
    parsed = []
    for chunk in chunks:
        ok = isinstance(chunk, dict) and _sizes(chunk.get("offsets")) and _sizes(chunk.get("sizes"))
        if not ok or len(chunk["offsets"]) != len(size) or len(chunk["sizes"]) != len(size):
            raise ValueError(f"{where}: a chunk needs offsets and sizes of {len(size)} integers each")
        if any(o + n > d for o, n, d in zip(chunk["offsets"], chunk["sizes"], size)):
            raise ValueError(f"{where}: a chunk reaches beyond the tensor's size {size}")
        name = chunk.get("file")
        if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
            raise ValueError(f"{where}: file must be a shard of this folder (__RANK_0.safetensors), got {name!r}")
        if (folder / name).is_symlink() or not (folder / name).is_file():
            raise ValueError(f"{where}: its shard {name} is missing")
        offsets = torch.Size(chunk["offsets"])
        storage[MetadataIndex(fqn, offsets)] = name
        parsed.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk["sizes"])))
    return TensorStorageMetadata(TensorProperties(dtype=DTYPES[entry["dtype"]]), torch.Size(size), parsed)
