"""A small reader and writer for the safetensors format (no dependency on the safetensors package).

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows
the header) plus an optional ``"__metadata__"`` string map, then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import os
import struct

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (sorted by name, packed back to back) to ``path`` through a temporary file."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    payloads, position = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        if tensor.dtype not in _NAMES:
            raise ValueError(f"safetensors cannot store {name!r} of dtype {tensor.dtype}")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [position, position + len(data)]}
        payloads.append(data)
        position += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in payloads:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of one safetensors file; ValueError on a truncated or malformed file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            raise ValueError(f"{path}: {size} bytes is too short for a safetensors header")
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(size - 8, _MAX_HEADER):
            raise ValueError(f"{path}: header length {length} does not fit in a file of {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({err})") from None
        data = f.read()
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        begin, end = entry["data_offsets"]
        shape = list(entry["shape"])
        expected = dtype.itemsize * _numel(shape)
        if end - begin != expected or end > len(data):
            raise ValueError(f"{path}: tensor {name!r} needs bytes [{begin}, {end}) ({expected} expected) but the "
                             f"data section has {len(data)} bytes; the file is truncated or corrupt")
        raw = bytearray(data[begin:end])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors, metadata


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
