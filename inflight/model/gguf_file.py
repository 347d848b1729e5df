"""Reading a GGUF file's header: metadata key/values and tensor descriptors.

Format: ggml's ``docs/gguf.md`` (v2/v3, little-endian). ``gguf.GGUFReader`` parses the same
but builds a numpy view per array element (about 2 s for a 49k-token vocabulary); this walk
reads the header with ``struct`` in milliseconds and maps tensor data without copying.
Dequantization stays with the ``gguf`` package (``gguf.quants.dequantize``).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

# Keyed by the IntEnum, looked up by the file's plain int type codes (equal hashes).
_SCALAR_FORMAT: dict[int, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


def read_gguf_metadata(path: str | os.PathLike[str],
                       wanted: Callable[[str], bool] = lambda key: True) -> dict[str, Any]:
    """Return ``{key: value}`` for the metadata keys of a GGUF (v2/v3, little-endian) file.

    Values of keys for which ``wanted(key)`` is false are skipped without being decoded.
    Arrays come back as lists, strings as ``str``. Raises ``ValueError`` for a file that is not
    a GGUF, a big-endian or v1 GGUF, or a truncated header; ``OSError`` if it cannot be opened.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _read_kv(buf, path, wanted)[0]


def _read_kv(buf: mmap.mmap, path: str | os.PathLike[str],
             wanted: Callable[[str], bool]) -> tuple[dict[str, Any], int]:
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (need v2/v3, little-endian)")
    _, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, out = 24, {}
    try:
        for _ in range(n_kv):
            key, pos = _read_str(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            value, pos = _read_value(buf, pos + 4, vtype, wanted(key))
            if wanted(key):
                out[key] = value
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"{path}: corrupt GGUF metadata: {exc!r}") from exc
    return out, pos


def _read_str(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise struct.error("string runs past end of file")
    return buf[pos + 8:end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, vtype: int, keep: bool) -> tuple[Any, int]:
    if vtype == GGUFValueType.STRING:
        return _read_str(buf, pos)
    if vtype != GGUFValueType.ARRAY:
        fmt = "<" + _SCALAR_FORMAT[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    etype, n = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype == GGUFValueType.STRING:
        items = []
        for _ in range(n):
            (size,) = struct.unpack_from("<Q", buf, pos)
            if keep:
                items.append(buf[pos + 8:pos + 8 + size].decode("utf-8"))
            pos += 8 + size
        return items, pos
    if etype == GGUFValueType.ARRAY:  # nested arrays: no tokenizer key uses them
        items = []
        for _ in range(n):
            (inner,) = struct.unpack_from("<I", buf, pos)
            item, pos = _read_value(buf, pos + 4, inner, keep)
            items.append(item)
        return items, pos
    fmt = _SCALAR_FORMAT[etype]
    width = struct.calcsize("<" + fmt)
    values = list(struct.unpack_from(f"<{n}{fmt}", buf, pos)) if keep else None
    return values, pos + n * width


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF name (``blk.0.attn_q.weight``).
        shape: torch order, slowest dimension first (GGUF lists them fastest first).
        qtype: ggml type (F32, Q4_1, ...).
        data: raw bytes, ``uint8`` ``[*shape[:-1], bytes_per_row]``, a view of the file.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    data: np.ndarray


def read_gguf_tensors(
        path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata and tensors of a GGUF file; tensor data stays memory-mapped.

    Raises:
        ValueError: not a GGUF v2/v3 file, or a corrupt header / unknown tensor type.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    metadata, pos = _read_kv(buf, path, lambda key: True)
    (n_tensors,) = struct.unpack_from("<Q", buf, 8)
    infos = []
    try:
        for _ in range(n_tensors):
            name, pos = _read_str(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(qtype), offset))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"{path}: corrupt GGUF tensor info: {exc!r}") from exc
    align = metadata.get("general.alignment", 32)
    data_start = -(-pos // align) * align
    file_bytes = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + offset
        raw = file_bytes[start:start + rows * row_bytes]
        shape = tuple(int(d) for d in reversed(dims))
        tensors.append(GGUFTensor(name, shape, qtype, raw.reshape(*shape[:-1], row_bytes)))
    return metadata, tensors
