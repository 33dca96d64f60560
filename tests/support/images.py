"""Image files made at test time."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from PIL import Image


def png_claiming(path: Path, width: int, height: int) -> Path:
    """A tiny PNG whose header claims ``width`` x ``height`` (nothing is ever decoded)."""
    Image.new("RGB", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    start = data.index(b"IHDR")
    data[start + 4 : start + 12] = struct.pack(">II", width, height)
    data[start + 17 : start + 21] = struct.pack(">I", zlib.crc32(bytes(data[start : start + 17])))
    path.write_bytes(bytes(data))
    return path
