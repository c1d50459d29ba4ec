"""Write a .safetensors file one tensor at a time, so a deploy never holds a whole rank's weights in memory.

safetensors puts a JSON header (names, dtypes, shapes, byte offsets) before the data, and the header is only known
once every tensor is written. Tensor bytes therefore stream into `<file>.part` behind a reserved, space-filled header
region; `close()` writes the header into that region (the format allows trailing spaces in the header) and renames
the part file, so a deploy never needs twice a rank's size on disk. A header larger than the region (tens of
thousands of tensors) falls back to writing a new file and copying the data behind it.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

_ALIGN = 8  # the header is space-padded so tensor data starts 8-byte aligned
_RESERVED = 1 << 20  # header bytes reserved ahead of the data: ~150 bytes per tensor, a 70B model needs ~150 KB


def _dtype_tag(dtype: torch.dtype) -> str:
    tags = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
            torch.int32: "I32", torch.int64: "I64", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
            torch.float8_e4m3fn: "F8_E4M3"}
    return tags[dtype]


class SafetensorsStreamWriter:
    def __init__(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self._part_path = self.path.with_name(self.path.name + ".part")
        self._part = self._part_path.open("wb")
        self._part.write(b" " * (8 + _RESERVED))
        self._entries: dict[str, dict[str, object]] = {}
        self._offset = 0
        self._metadata = dict(metadata or {})

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"tensor {name} written twice to {self.path}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._part.write(data.data)
        end = self._offset + data.nbytes
        self._entries[name] = {"dtype": _dtype_tag(tensor.dtype), "shape": list(tensor.shape),
                               "data_offsets": [self._offset, end]}
        self._offset = end

    @property
    def nbytes(self) -> int:
        return self._offset

    def close(self) -> Path:
        self._part.close()
        header: dict[str, object] = {}
        if self._metadata:
            header["__metadata__"] = self._metadata
        header.update(self._entries)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % _ALIGN)
        if len(blob) <= _RESERVED:
            with self._part_path.open("r+b") as part:
                part.write(struct.pack("<Q", _RESERVED))
                part.write(blob)  # the rest of the region stays spaces
            self._part_path.replace(self.path)
            return self.path
        with self.path.open("wb") as out, self._part_path.open("rb") as part:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            part.seek(8 + _RESERVED)
            shutil.copyfileobj(part, out, length=16 << 20)
        self._part_path.unlink()
        return self.path

    def abort(self) -> None:
        self._part.close()
        self._part_path.unlink(missing_ok=True)

