"""Classification extension: an output requested with `classification: k` returns its top-k as strings."""

from __future__ import annotations

import numpy as np


def classify(data: np.ndarray, k: int, labels: list[str], batched: bool) -> np.ndarray:
    """Top-k entries as BYTES "value:index[:label]", per batch item when the model batches (as Triton)."""
    rows = data.reshape(data.shape[0], -1) if batched and data.ndim > 0 else data.reshape(1, -1)
    k = min(k, rows.shape[1])
    out = np.empty((rows.shape[0], k), dtype=np.object_)
    for r, row in enumerate(rows):
        order = np.argsort(-row, kind="stable")[:k]
        for j, idx in enumerate(order):
            value = row[idx]
            text = f"{float(value):f}:{idx}" if row.dtype.kind == "f" else f"{value}:{idx}"
            if idx < len(labels):
                text += f":{labels[idx]}"
            out[r, j] = text.encode()
    return out if batched else out.reshape(k)
