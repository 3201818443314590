"""Hugging Face model directories on disk: lazy safetensors reading, sharded writing, the files that travel along.

A directory holds ``config.json``, the weights as ``model.safetensors`` or as shards listed in
``model.safetensors.index.json``, and optionally ``generation_config.json`` and tokenizer files.
Tensors are read one at a time when the converter takes them (:class:`LazyTensors`), so only the
tensors of the model being built are in memory, never a second copy of the input.
"""

from __future__ import annotations

import json
import os

import torch

from safetensors import safe_open
from safetensors.torch import save_file

from megalite.checkpoint.tokenizer_export import hf_tokenizer_files as tokenizer_files

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class LazyTensors:
    """The tensors of safetensors files by name, each read from its file when taken.

    ``pop(name)`` reads one tensor; ``keys()`` lists what is left, so a converter can report the
    tensors it did not use.  :meth:`shapes_only` gives a copy whose ``pop`` reads only a tensor's shape
    and dtype (a meta tensor), for a dry run of a conversion that names what it will write.
    """

    def __init__(self, files: list[str], source: str):
        self._where: dict[str, str] = {}
        self._meta = False
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f"{path}, listed in {source}, does not exist")
            try:
                with safe_open(path, framework="pt") as f:
                    names = list(f.keys())
            except Exception as err:  # safetensors raises its own error types for malformed files
                raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
            self._where.update({name: path for name in names if not name.endswith(_IGNORED_SUFFIXES)})

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def keys(self) -> list[str]:
        return list(self._where)

    def shapes_only(self) -> LazyTensors:
        copy = LazyTensors([], "")
        copy._where, copy._meta = dict(self._where), True
        return copy

    def pop(self, name: str) -> torch.Tensor:
        path = self._where.pop(name)
        with safe_open(path, framework="pt") as f:
            if not self._meta:
                return f.get_tensor(name)
            part = f.get_slice(name)
            shape = part.get_shape()
            # the dtype of one element (a 0-d or empty tensor is read whole: it is tiny)
            probe = part[tuple(slice(0, 1) for _ in shape)] if shape and 0 not in shape else f.get_tensor(name)
            return torch.empty(shape, dtype=probe.dtype, device="meta")

    def items(self):
        """Read every tensor left (for callers that want them all)."""
        for name in list(self._where):
            yield name, self.pop(name)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a Hugging Face model directory; ValueError when the directory or file is missing."""
    if not os.path.isdir(hf_dir):
        raise ValueError(f"Hugging Face directory {hf_dir} does not exist")
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{hf_dir} has no config.json")
    return _read_json(config_path)


def open_hf_tensors(hf_dir: str) -> LazyTensors:
    """The (lazily read) tensors of ``model.safetensors`` or of the shards its index lists."""
    single, index = os.path.join(hf_dir, SAFETENSORS), os.path.join(hf_dir, SAFETENSORS_INDEX)
    if os.path.isfile(single):
        return LazyTensors([single], hf_dir)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        return LazyTensors([os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))], index)
    raise ValueError(f"{hf_dir} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}")


def read_hf_checkpoint(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json contents, every tensor)`` of a Hugging Face model directory."""
    hf_config = read_hf_config(hf_dir)
    return hf_config, dict(open_hf_tensors(hf_dir).items())


def read_generation_config(hf_dir: str) -> dict | None:
    """generation_config.json of a model directory, or None."""
    path = os.path.join(hf_dir, GENERATION_CONFIG)
    return _read_json(path) if os.path.isfile(path) else None


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``5GB``, ``500MB``, ``10KiB`` or ``1234``."""
    if isinstance(text, int):
        return text
    value = text.strip().upper()
    units = (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
             ("B", 1))
    for unit, factor in units:
        if value.endswith(unit):
            number = value[:-len(unit)]
            break
    else:
        number, factor = value, 1
    try:
        size = int(float(number) * factor)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit (e.g. 5GB, 500MB)") from None
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def write_hf_tensors(output: str, tensors, max_shard_size: int) -> list[str]:
    """Write ``tensors`` (a dict, or ``(name, tensor)`` pairs consumed one by one) to ``output`` with the
    safetensors library; returns the file names written.

    Up to ``max_shard_size`` bytes go to ``model.safetensors``; more are split, in order, into
    ``model-0000k-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.  A shard is written
    as soon as it is full, so at most one shard's tensors are held.
    """
    pairs = sorted(tensors.items()) if isinstance(tensors, dict) else tensors
    written, weight_map, shard, size, total = [], {}, {}, 0, 0

    def flush():
        path = os.path.join(output, f"shard-{len(written):05d}.tmp")
        save_file(shard, path, metadata={"format": "pt"})
        written.append(path)
        weight_map.update({n: len(written) - 1 for n in shard})

    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_size:
            flush()
            shard, size = {}, 0
        shard[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        os.rename(written[0], os.path.join(output, SAFETENSORS))
        return [SAFETENSORS]
    names = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    for path, name in zip(written, names):
        os.rename(path, os.path.join(output, name))
    write_json(os.path.join(output, SAFETENSORS_INDEX),
               {"metadata": {"total_size": total}, "weight_map": {n: names[i] for n, i in weight_map.items()}})
    return names + [SAFETENSORS_INDEX]


def write_json(path: str, contents: dict) -> None:
    with open(path, "w") as f:
        json.dump(contents, f, indent=2, sort_keys=True)
