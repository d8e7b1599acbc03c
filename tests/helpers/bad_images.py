"""Images built to break a reader: a header claiming more pixels than memory holds, a format
header PIL has no decoder for."""

from __future__ import annotations

import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A PNG of a header and nothing else: 45 bytes that claim width x height pixels."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IEND", b"")


def damaged_dds() -> bytes:
    """A DDS header naming a pixel format PIL has no decoder for (it raises
    NotImplementedError)."""
    header = struct.pack("<4sIIIIIII", b"DDS ", 124, 0x1007, 4, 4, 0, 0, 0) + b"\0" * 44
    pixel_format = struct.pack("<II4sIIIII", 32, 0x4, b"ZZZZ", 0, 0, 0, 0, 0)
    return header + pixel_format + struct.pack("<IIIII", 0x1000, 0, 0, 0, 0) + b"\0" * 64
