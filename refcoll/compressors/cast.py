"""Casts to a narrower float: float16 and bfloat16 (through ml_dtypes).

Round to nearest even, once per element. Linear in the shared basis of the
narrow type: payloads can be summed by any all-reduce in that type. A value
representable in the narrow type comes back exactly. An average divides each
rank's cast by ``p`` before the sum, in the narrow type, as PyTorch's
``fp16_compress_hook`` and ``bf16_compress_hook`` do: a sum of ``p`` large
float16 gradients would overflow (65504) where their average does not. On CuPy arrays the same
bits (a cast rounds once on the device too); bfloat16 needs CuPy >= 14 with
ml_dtypes, and an older CuPy is refused with the reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.ops import get_dtype
from ..core.xp import array_namespace, check_device_dtype
from .base import Compressor, Payload, Round, Rounds, check_float, register

__all__ = ["CastFP16", "CastBF16"]


@dataclass(frozen=True)
class _Cast(Compressor):
    """Cast to ``wire`` (refcoll's name of a dtype) on compress and back to the tensor's
    dtype on decompress."""

    linear: ClassVar[bool] = True
    wire: ClassVar[str] = "float16"

    def compress(self, x, state) -> Payload:
        """Return ``x`` rounded to the wire type."""
        check_float(x, self.name)
        wire = get_dtype(self.wire)
        check_device_dtype(wire, array_namespace(x))
        return self._payload(x, {"values": x.reshape(-1).astype(wire)})

    def allreduce_rounds(self, x, state, *, size: int, op: str) -> Rounds:
        """One round; ``avg`` is each cast divided by ``size``, then summed (PyTorch's way).

        This rank's own contribution (what error feedback subtracts) is its cast, undivided.
        """
        if op != "avg":
            return (yield from super().allreduce_rounds(x, state, size=size, op=op))
        payload = self.compress(x, state)
        values = payload.arrays["values"]
        summed = yield Round({"values": values / values.dtype.type(size)}, "sum")
        return payload, self.decompress(dataclasses.replace(payload, arrays=summed))

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return the values widened back to the original dtype."""
        return payload.arrays["values"].astype(payload.dtype).reshape(payload.shape)


@register
@dataclass(frozen=True)
class CastFP16(_Cast):
    """IEEE binary16: 11-bit significand, range up to 65504."""

    name: ClassVar[str] = "fp16"
    wire: ClassVar[str] = "float16"


@register
@dataclass(frozen=True)
class CastBF16(_Cast):
    """bfloat16: float32's range with an 8-bit significand."""

    name: ClassVar[str] = "bf16"
    wire: ClassVar[str] = "bfloat16"
