"""Gradient compressors: one module per method, the contract in base.py.

Spec strings (see :func:`parse`): ``none``, ``fp16``, ``bf16``,
``topk:ratio=0.001``, ``randomk:ratio=0.01``, ``threshold:threshold=1e-3``,
``qsgd:levels=16,bucket=512``, ``terngrad:block=0``, ``sign:block=0``,
``onebit:block=0``, ``powersgd:rank=4,min_rate=2``, ``int8:block=256``, and
``ef(<spec>)`` for error feedback around any of them (once: ``ef(ef(...))`` is
refused). Error feedback keeps its residual in a :class:`CompressorState`, so a
compressed all-reduce with ``ef(...)`` needs ``state=``, one per tensor, kept
across calls.

Importing this package imports every method module, and each registers itself
in :data:`COMPRESSORS`. A compressor declares how its payloads combine
(:attr:`Compressor.patterns`, :meth:`Compressor.allreduce_rounds`);
:mod:`refcoll.compressors.patterns` combines them, and
:func:`~refcoll.compressors.collective.compressed_allreduce` is the call.

Spec: spec/compressors.md
"""

from __future__ import annotations

from .base import (
    COMPRESSORS,
    Compressor,
    CompressorState,
    ErrorFeedback,
    Payload,
    Round,
    parse,
    register,
)
from .cast import CastBF16, CastFP16
from .collective import compressed_allreduce
from .int8 import Int8
from .none import NoCompression
from .onebit import OneBit
from .powersgd import PowerSGD
from .qsgd import QSGD
from .randomk import RandomK
from .sign import Sign
from .terngrad import TernGrad
from .threshold import Threshold
from .topk import TopK

__all__ = [
    "COMPRESSORS",
    "compressed_allreduce",
    "Compressor",
    "CompressorState",
    "ErrorFeedback",
    "Payload",
    "Round",
    "parse",
    "register",
    "NoCompression",
    "CastFP16",
    "CastBF16",
    "TopK",
    "RandomK",
    "Threshold",
    "QSGD",
    "TernGrad",
    "Sign",
    "OneBit",
    "PowerSGD",
    "Int8",
]
