"""A collate_fn for process workers that returns every kind of tensor and array (needs torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def many_kinds(samples: list[Any]) -> dict[str, Any]:
    """Tensors and arrays, large (through the result ring) and small (in the pickle)."""
    ids = np.asarray([int(s) for s in samples], dtype=np.int64)
    big = torch.from_numpy(np.repeat(ids, 4096))  # 32 KiB per sample: the ring
    grad = torch.arange(len(ids) * 3000, dtype=torch.float32).reshape(len(ids), 3000)
    return {
        "big": big,
        "bf16": (big[: 40000 if len(big) >= 40000 else len(big)] % 251).to(torch.bfloat16),
        "transposed": grad.t(),  # not contiguous
        "grad": grad.requires_grad_(True),
        "small": torch.tensor(ids),
        "zero_dim": torch.tensor(float(ids.sum())),
        "bools": torch.from_numpy(np.repeat(ids % 2 == 0, 20000)),
        "complex": torch.from_numpy(np.repeat(ids, 3000).astype(np.complex64)) * (1 + 2j),
        "conj": (torch.from_numpy(np.repeat(ids, 3000).astype(np.complex64)) * 1j).conj(),
        "array": np.repeat(ids, 5000).astype(np.float64),
        "view": big[8:40008],  # a view into the middle of a storage
        "ids": ids.tolist(),
    }
