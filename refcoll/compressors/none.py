"""No compression: the tensor itself goes on the wire (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import Compressor, Payload, register

__all__ = ["NoCompression"]


@register
@dataclass(frozen=True)
class NoCompression(Compressor):
    """Send ``x`` as it is. Linear: payloads are the tensors, summed by any all-reduce."""

    name: ClassVar[str] = "none"
    linear: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True
    identity: ClassVar[bool] = True

    def compress(self, x, state) -> Payload:
        """Return a payload that views ``x`` (no copy)."""
        return self._payload(x, {"values": x.reshape(-1)})

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return a copy of the values in the original shape."""
        return payload.arrays["values"].reshape(payload.shape).copy()
