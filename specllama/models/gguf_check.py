"""Fast structural reading and validation of GGUF headers, before llama.cpp sees a file.

gguf.GGUFReader builds a numpy view for every token string (about 7 s for a 150k vocabulary),
so this walks the same layout with struct, using the gguf package's own type tables. It
works on any prefix of a file (a local mmap or bytes fetched with an HTTP range request) and
says how many more bytes it needs.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC

from ..errors import InvalidModelFileError, ModelNotFoundError

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_MAX_DIMS = 4


class NeedMoreBytes(Exception):
    """The buffer ends inside the header; `n_bytes` is the size that would hold the next read.

    `partial` holds the metadata parsed so far, and `array_lengths` the declared lengths of
    arrays already started, so a caller can often decide (reject a draft) without reading on.
    """

    def __init__(self, n_bytes: int, partial: dict[str, Any] | None = None,
                 array_lengths: dict[str, int] | None = None):
        super().__init__(n_bytes)
        self.n_bytes = n_bytes
        self.partial = partial or {}
        self.array_lengths = array_lengths or {}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0
    metadata_end: int = 0

    @property
    def data_end(self) -> int:
        return self.data_offset + max((t.offset + t.n_bytes for t in self.tensors), default=0)


class _Cursor:
    def __init__(self, buf: Any, limit: int):
        self.buf, self.pos, self.limit = buf, 0, limit

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.limit:
            raise _OutOfFile(start + n)
        if start + n > len(self.buf):
            raise NeedMoreBytes(start + n)
        self.pos = start + n
        return start

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")


class _OutOfFile(Exception):
    def __init__(self, pos: int):
        super().__init__(pos)
        self.pos = pos


def _value(cur: _Cursor, vtype: int, on_array: Any = None) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[GGUFValueType(vtype)])
    if vtype == GGUFValueType.ARRAY:
        item_type, n = cur.unpack("<I"), cur.unpack("<Q")
        if on_array is not None:
            on_array(n)
        if item_type in _SCALARS:
            size = struct.calcsize(_SCALARS[item_type])
            start = cur.take(n * size)
            if n >= 4096:
                return item_type, n
            return list(struct.unpack_from(f"<{n}{_SCALARS[item_type][1]}", cur.buf, start))
        if item_type == GGUFValueType.STRING:
            return [cur.string() for _ in range(n)]
        raise ValueError(f"array of unsupported type {item_type}")
    raise ValueError(f"unknown value type {vtype}")


def parse(buf: Any, file_size: int, *, metadata_only: bool = False) -> GGUFHeader:
    """Parse the header held in buf (a prefix of a file of file_size bytes).

    Args:
        metadata_only: stop after the key-value metadata (skip the tensor table).
    Raises:
        NeedMoreBytes: buf ends before the header does.
        ValueError: the header is malformed; the message says where.
    """
    cur = _Cursor(buf, file_size)
    fields: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    try:
        return _parse(cur, file_size, fields, array_lengths, metadata_only)
    except NeedMoreBytes as e:
        raise NeedMoreBytes(e.n_bytes, fields, array_lengths) from None


def _parse(cur: _Cursor, file_size: int, fields: dict[str, Any], array_lengths: dict[str, int],
           metadata_only: bool) -> GGUFHeader:
    try:
        magic = cur.unpack("<I")
        if magic != GGUF_MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes (not a GGUF file)")
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3 expected)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        # every tensor info and key-value pair takes at least 8 bytes
        if (n_tensors + n_kv) * 8 > file_size:
            raise ValueError(f"it claims {n_tensors} tensors and {n_kv} metadata entries, more than the file can hold")
        for i in range(n_kv):
            key = cur.string()
            try:
                fields[key] = _value(cur, cur.unpack("<I"), lambda n, key=key: array_lengths.__setitem__(key, n))
            except ValueError as e:
                raise ValueError(f"metadata entry {i} ({key!r}): {e}") from None
        header = GGUFHeader(version, fields)
        header.metadata_end = cur.pos
        if metadata_only:
            return header
        for i in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if not 0 < n_dims <= _MAX_DIMS:
                raise ValueError(f"tensor {i} ({name!r}) has {n_dims} dimensions")
            shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
            ggml_type, offset = cur.unpack("<I"), cur.unpack("<Q")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except ValueError:
                raise ValueError(f"tensor {i} ({name!r}) has unknown type {ggml_type}") from None
            n_elements = 1
            for dim in shape:
                n_elements *= dim
            header.tensors.append(TensorInfo(name, shape, ggml_type, offset, n_elements * type_size // block))
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment!r} is not a power of two")
        header.data_offset = -(-cur.pos // alignment) * alignment
    except _OutOfFile as e:
        raise ValueError(f"the header runs past the end of the file (needs byte {e.pos}, file has {file_size})") \
            from None
    return header


def validate(path: Union[str, os.PathLike]) -> Path:
    """Check that path is a complete, well-formed GGUF file; return it as a Path.

    Raises ModelNotFoundError or InvalidModelFileError with the reason.
    """
    read_header(path)
    return Path(path).expanduser()


def read_header(path: Union[str, os.PathLike]) -> GGUFHeader:
    """Parse and validate the header of a local GGUF file (cached while the file is unchanged)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model file not found: {path}")
    if not path.is_file():
        raise InvalidModelFileError(f"{path} is not a file (give the path of a .gguf file)")
    st = path.stat()
    return _read_header(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_header(path_str: str, size: int, mtime_ns: int) -> GGUFHeader:
    path = Path(path_str)
    if size < 24:
        raise InvalidModelFileError(f"{path} is not a GGUF model: only {size} bytes")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            header = parse(buf, size)
        except ValueError as e:
            raise InvalidModelFileError(f"{path} is not a valid GGUF model: {e}") from None
    alignment = header.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    for t in header.tensors:
        if t.offset % alignment:
            raise InvalidModelFileError(f"{path} is not a valid GGUF model: tensor {t.name!r} is misaligned")
    if header.data_end > size:
        raise InvalidModelFileError(
            f"{path} is truncated: its tensors need {header.data_end} bytes, the file has {size} "
            "(download it again)"
        )
    return header
