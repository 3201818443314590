"""Unpickling Megatron's ``torch.save`` archives (``common.pt``, a sharded object such as a rank's RNG states)
without running pickled code: argparse namespaces, containers, dtypes and small tensors load as themselves, every
other class as an inert :class:`Opaque` record.  Used by the torch_dist reader and its RNG states."""

from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
import zipfile

import torch


class Opaque:
    """An object of a class that :func:`read_common` does not load: its class name and the data it was built from."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


_COMMON_TENSOR_LIMIT = 1 << 16
"""Tensors of ``common.pt`` with more elements than this load as None (it holds scalars such as Adam's step)."""


class _CommonUnpickler(pickle.Unpickler):
    """Unpickles a Megatron ``torch.save`` archive (``common.pt``, a sharded object) running no code: argparse
    namespaces, containers and torch dtypes load as
    themselves, tensors of at most :data:`_COMMON_TENSOR_LIMIT` elements (read from ``archive``) as tensors, larger
    ones as None, and every other class as an :class:`Opaque` record."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        if (module, name) in (("argparse", "Namespace"), ("collections", "OrderedDict")):
            return super().find_class(module, name)
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in _storage_dtypes():
            return _storage_dtypes()[name]  # a typed storage class stands for its dtype
        return type(name, (Opaque,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)
                and isinstance(pid[4], int) and pid[4] <= _COMMON_TENSOR_LIMIT):
            return None
        data = self.archive.read(f"{self.prefix}data/{pid[2]}")
        return torch.frombuffer(bytearray(data), dtype=pid[1]) if data else torch.empty(0, dtype=pid[1])


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{"FloatStorage": torch.float32, ...}``: the typed storage classes torch.save names, by dtype."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading a typed storage class's dtype warns that TypedStorage is deprecated
        return {name: value.dtype for name, value in vars(torch).items()
                if name.endswith("Storage") and isinstance(getattr(value, "dtype", None), torch.dtype)}


def _rebuild_tensor(storage, offset, size, stride, *rest):
    """``torch._utils._rebuild_tensor_v2`` for the flat tensors :meth:`_CommonUnpickler.persistent_load` reads."""
    if storage is None:
        return None
    return torch.as_strided(storage, tuple(size), tuple(stride), offset).clone()


def unpickle_data(archive: zipfile.ZipFile):
    """The object of a ``torch.save`` archive, unpickled by :class:`_CommonUnpickler` (no pickled code runs)."""
    pickled = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
    if len(pickled) != 1:
        raise ValueError("it is not a torch.save archive")
    with archive.open(pickled[0]) as data:
        return _CommonUnpickler(data, archive, pickled[0][:-len("data.pkl")]).load()


def read_sharded_object(directory: str, metadata, key: str):
    """The sharded object ``key`` of a torch_dist directory's DCP ``metadata`` (a ``torch.save`` archive inside a
    data file), unpickled by :func:`unpickle_data`; None when the checkpoint holds no such object."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    if key not in metadata.state_dict_metadata:
        return None
    info = metadata.storage_data[dcp_metadata.MetadataIndex(key)]
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return unpickle_data(archive)
