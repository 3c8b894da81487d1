"""Per-block CRC-32s of a shard file, computed as it is written, so that a byte-range read of
a remote object can be checked against what was committed (``remote.py``).

A file is cut into blocks of ``block_size`` bytes (the last one shorter); the commit record
keeps each block's CRC-32. The file's own CRC-32 is derived from the blocks' (the CRC of a
concatenation is a linear function of the parts' CRCs: :func:`crc32_combine`), so the data
is checksummed once however many checksums are kept.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache

#: Bytes per block: a ranged read is widened to whole blocks (a window of 2048 int32 tokens,
#: 8 KiB, becomes a read of 64 or 128 KiB). Chosen by measurement: docs/remote.md.
BLOCK_SIZE = 1 << 16
#: Most blocks a file's record keeps (4 bytes each): past ``BLOCK_SIZE * MAX_BLOCKS`` bytes
#: (256 MiB) the block size doubles until the file fits, so a record stays under ~22 KB of
#: JSON per file and a reader holds at most 16 KiB of checksums per file.
MAX_BLOCKS = 4096


@dataclass(frozen=True)
class BlockChecksums:
    """The CRC-32 of each ``block_size`` block of a file (the last block may be shorter),
    packed as little-endian uint32 in ``crcs``."""

    block_size: int
    crcs: bytes

    def __len__(self) -> int:
        return len(self.crcs) // 4

    def crc(self, block: int) -> int:
        """The committed CRC-32 of block number ``block``."""
        return int(struct.unpack_from("<I", self.crcs, 4 * block)[0])

    def fits(self, size: int) -> bool:
        """Whether these are the blocks of a file of ``size`` bytes."""
        return self.block_size >= 1 and len(self) == -(-size // self.block_size)

    def span(self, start: int, end: int, size: int) -> tuple[int, int]:
        """The whole blocks around bytes ``start..end`` of a file of ``size`` bytes."""
        block = self.block_size
        return start - start % block, min(size, -(-end // block) * block)

    def mismatch(self, data: bytes | memoryview, start: int) -> tuple[int, int] | None:
        """``(block, crc)`` of the first block of ``data`` (whole blocks read from byte
        ``start``, itself at a block boundary) whose CRC-32 is not the committed one; None
        when all match."""
        block = self.block_size
        first = start // block
        with memoryview(data) as view:
            for k, offset in enumerate(range(0, len(view), block)):
                crc = zlib.crc32(view[offset : offset + block])
                if crc != self.crc(first + k):
                    return first + k, crc
        return None


class BlockCrc32:
    """The CRC-32 of a byte stream and of each of its ``block_size`` blocks, fed in pieces
    of any size (:meth:`update`); :meth:`blocks` and :attr:`crc32` once it is all in."""

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = BLOCK_SIZE if block_size is None else block_size
        self.size = 0
        self._crcs: list[int] = []
        self._partial = 0  # CRC-32 of the block being filled
        self._filled = 0  # its bytes so far

    def update(self, data: bytes | memoryview) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        n = len(view)
        if not n:
            return
        self.size += n
        block = self.block_size
        at = 0
        if self._filled:
            at = min(n, block - self._filled)
            self._partial = zlib.crc32(view[:at], self._partial)
            self._filled += at
            if self._filled < block:
                return
            self._crcs.append(self._partial)
            self._filled = 0
        while n - at >= block:
            self._crcs.append(zlib.crc32(view[at : at + block]))
            at += block
        if at < n:
            self._partial = zlib.crc32(view[at:])
            self._filled = n - at

    def _all(self) -> list[int]:
        return [*self._crcs, self._partial] if self._filled else list(self._crcs)

    @property
    def crc32(self) -> int:
        """The CRC-32 of everything fed so far (``zlib.crc32`` of the whole stream)."""
        crcs = self._all()
        if not crcs:
            return 0
        shift = _shift(self.block_size)
        crc = crcs[0]
        for part in crcs[1:-1]:
            crc = shift(crc) ^ part
        if len(crcs) > 1:
            last = self._filled or self.block_size
            crc = crc32_combine(crc, crcs[-1], last)
        return crc

    def blocks(self, max_blocks: int = MAX_BLOCKS) -> BlockChecksums:
        """The blocks' CRC-32s; where there are more than ``max_blocks``, those of blocks
        twice (four times, ...) as large, combined from them."""
        crcs, block = self._all(), self.block_size
        tail = self._filled or block  # bytes of the last block
        while len(crcs) > max_blocks:
            shift = _shift(block)
            merged = [shift(crcs[k]) ^ crcs[k + 1] for k in range(0, len(crcs) - 2, 2)]
            if len(crcs) % 2:  # the last block stands alone: a shorter one of the next size
                merged.append(crcs[-1])
            else:
                merged.append(crc32_combine(crcs[-2], crcs[-1], tail))
                tail += block
            crcs, block = merged, block * 2
        return BlockChecksums(block, struct.pack(f"<{len(crcs)}I", *crcs))


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of ``a + b`` from ``first = crc32(a)``, ``second = crc32(b)`` and
    ``len(b)`` (zlib's ``crc32_combine``, which Python's ``zlib`` does not offer)."""
    zeros = bytes(second_length)
    return zlib.crc32(zeros, first) ^ zlib.crc32(zeros) ^ second


class _Shift:
    """The linear map on CRC-32 values of appending ``length`` zero bytes to the data (what
    a CRC of data ``a`` contributes to the CRC of ``a`` followed by ``length`` more bytes),
    applied a byte of the value at a time through four tables."""

    def __init__(self, length: int) -> None:
        zeros = bytes(length)
        offset = zlib.crc32(zeros)
        images = [zlib.crc32(zeros, 1 << bit) ^ offset for bit in range(32)]
        self.tables = []
        for byte in range(4):
            table = [0] * 256
            for value in range(1, 256):
                low = value & -value
                table[value] = table[value ^ low] ^ images[8 * byte + low.bit_length() - 1]
            self.tables.append(table)

    def __call__(self, crc: int) -> int:
        t0, t1, t2, t3 = self.tables
        return t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]


@lru_cache(maxsize=16)
def _shift(length: int) -> _Shift:
    return _Shift(length)
