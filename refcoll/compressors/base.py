"""The compressor contract: settings, payloads, explicit state, error feedback.

Modelled on GRACE's three roles (Xu et al. 2021) and epfml/powersgd's tested
invariants. A compressor is a frozen dataclass of settings with two pure
functions: ``compress(x, state) -> Payload`` and ``decompress(payload) -> ndarray``
(same shape and dtype as ``x``). Everything that changes between calls (an RNG,
PowerSGD's warm-start ``Q``, an error-feedback residual) lives in an explicit
:class:`CompressorState`, never in module globals. A compressor never
communicates; ``compressors/collective.py`` decides how payloads are combined.

``Payload.nbytes`` is every byte the payload puts on the wire: values, indices
(int32, or int64 when the tensor has more than ``2**31 - 1`` elements), scales,
norms, signs packed eight to a byte. An empty tensor gives an empty payload.
Small metadata (shape, dtype, the shared
seed of random-k) is known to every rank and is not counted.

Spec: spec/compressors.md
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..core.errors import UsageError

__all__ = [
    "Payload",
    "CompressorState",
    "Compressor",
    "ErrorFeedback",
    "COMPRESSORS",
    "register",
    "parse",
    "index_dtype",
    "compute_dtype",
    "check_float",
]

COMPRESSORS: dict[str, type] = {}
"""Every compressor class by its spec name (``topk``, ``qsgd``...)."""


def register(cls):
    """Add a compressor class to :data:`COMPRESSORS` under its ``name``."""
    COMPRESSORS[cls.name] = cls
    return cls


def index_dtype(n: int) -> np.dtype:
    """Return the wire dtype of indices into ``n`` elements: int32, or int64 past 2**31-1."""
    return np.dtype(np.int32 if n <= 2**31 - 1 else np.int64)


def compute_dtype(dtype) -> np.dtype:
    """Return the dtype scales are computed in: float64 for float64, else float32."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def check_float(x: np.ndarray, name: str) -> None:
    """Refuse a non-floating tensor: compressing integers is not defined here."""
    from ..core.ops import is_float

    if not is_float(x.dtype):
        raise UsageError(
            f"compressor {name!r} needs a floating tensor, got dtype {x.dtype}; "
            "cast the gradient to float16/bfloat16/float32/float64 first"
        )


@dataclass(frozen=True)
class Payload:
    """What one compress call puts on the wire, plus what every rank already knows.

    Attributes:
        method: the compressor's spec name.
        shape: the original tensor's shape.
        dtype: the original tensor's dtype.
        arrays: the wire arrays by role (``values``, ``indices``, ``scales``...).
        meta: small metadata not sent (the shared seed of random-k, ``k``...).
    """

    method: str
    shape: tuple
    dtype: np.dtype
    arrays: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Return the exact bytes on the wire: the sum of every wire array's bytes."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def dense_nbytes(self) -> int:
        """Return the bytes the uncompressed tensor would take."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass
class CompressorState:
    """Everything a compressor carries between calls on one tensor stream.

    Use one state per tensor (per parameter) and per rank.

    Attributes:
        seed: the seed shared by all ranks.
        rank: this rank, mixed into :attr:`rng` so per-rank draws differ.
        rng: this rank's generator (stochastic rounding in QSGD, TernGrad).
        step: how many compress calls this state has seen; shared-seed draws
            (random-k) are keyed by ``(seed, step)`` so every rank draws the same.
        memory: per-method memory (PowerSGD's warm-start ``Q`` keyed by shape).
        residual: the error-feedback residual, or None before the first step.
        traffic: what the last compressed all-reduce on this state moved
            (:class:`refcoll.compressors.collective.CompressedTraffic`).
    """

    seed: int = 0
    rank: int = 0
    rng: np.random.Generator = None
    step: int = 0
    memory: dict = field(default_factory=dict)
    residual: np.ndarray | None = None
    traffic: Any = None

    def __post_init__(self):
        if self.rng is None:
            self.rng = np.random.default_rng([self.seed, self.rank])

    def shared_rng(self, *key: int) -> np.random.Generator:
        """Return a generator every rank builds identically from the seed and ``key``."""
        return np.random.default_rng([self.seed, *key])


@dataclass(frozen=True)
class Compressor:
    """Base of every compressor: settings as dataclass fields, two pure functions.

    Subclasses set ``name`` and ``linear`` (whether payloads from several ranks
    add up in a shared basis, so an all-reduce can sum them directly) and
    implement :meth:`compress` and :meth:`decompress`.
    """

    name: ClassVar[str] = ""
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    #: The patterns a method declares itself, the default first; empty: from ``linear``.
    declared_patterns: ClassVar[tuple[str, ...]] = ()

    @property
    def patterns(self) -> tuple[str, ...]:
        """Return the collective patterns its payloads allow, the default first.

        ``allreduce``: payloads add up in a shared basis, so any all-reduce sums
        them; ``gather``: every payload is gathered and the sum taken after
        decompression; ``twophase``: compressed all-to-all, sum and recompress
        per chunk, compressed allgather (see ``compressors/collective.py``).
        Unless a method declares its own, linear ones allow ``allreduce`` (the
        default) and ``gather``, the others ``gather``.
        """
        if self.declared_patterns:
            return self.declared_patterns
        return ("allreduce", "gather") if self.linear else ("gather",)

    def new_state(self, seed: int = 0, rank: int = 0) -> CompressorState:
        """Return a fresh state for one tensor stream on ``rank``."""
        return CompressorState(seed=seed, rank=rank)

    def compress(self, x: np.ndarray, state: CompressorState) -> Payload:
        """Return the payload that stands for ``x``."""
        raise NotImplementedError

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return the tensor the payload stands for: ``x``'s shape and dtype."""
        raise NotImplementedError

    def spec(self) -> str:
        """Return the spec string that :func:`parse` turns back into this compressor."""
        opts = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}:{opts}" if opts else self.name

    def _payload(self, x: np.ndarray, arrays: dict, **meta) -> Payload:
        return Payload(self.name, tuple(x.shape), np.dtype(x.dtype), arrays, meta)


@dataclass(frozen=True)
class ErrorFeedback(Compressor):
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019) around any compressor.

    Algorithm, per call with residual ``e_old`` (zero at first):

    1. ``c = x + e_old`` (in ``x``'s dtype);
    2. ``payload = inner.compress(c)``;
    3. ``e_new = c - inner.decompress(payload)`` (in ``x``'s dtype), kept in the state.

    So ``e_new`` is, bit for bit, ``(x + e_old) - decompress(payload)`` evaluated
    in the dtype, and ``decompress(payload) + e_new == x + e_old`` holds exactly
    whenever that subtraction is exact (Sterbenz: always for casts; always for
    top-k, threshold, where each element is either sent whole or not at all). For
    compressors whose output differs greatly in magnitude from the input element
    (sign, 1-bit, QSGD...) the subtraction can round, and the identity holds to
    within half an ulp of ``e_new``: no residual in the same dtype can do better,
    since ``d + e`` lies on ``d``'s grid.
    """

    name: ClassVar[str] = "ef"
    inner: Compressor = None

    def __post_init__(self):
        # A state holds one residual per tensor: an ef inside an ef would need two,
        # and the outer one would feed back an error the inner has already kept.
        if isinstance(self.inner, ErrorFeedback):
            raise UsageError(
                f"error feedback around error feedback ({self.spec()!r}) is refused: a "
                "tensor keeps one residual, and ef of ef would keep two, which means "
                f"nothing; wrap the compressor once: {ErrorFeedback(self.inner.inner).spec()!r}"
            )
        if not isinstance(self.inner, Compressor):
            raise UsageError(
                f"ErrorFeedback wraps a compressor, got {type(self.inner).__name__}; "
                "pass one: ErrorFeedback(parse('topk:ratio=0.01'))"
            )

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.inner.linear

    @property
    def patterns(self) -> tuple[str, ...]:
        """Return the inner compressor's patterns."""
        return self.inner.patterns

    def compress(self, x: np.ndarray, state: CompressorState) -> Payload:
        """Compress ``x`` plus the residual and keep the new residual in ``state``."""
        corrected = x if state.residual is None else x + state.residual
        payload = self.inner.compress(corrected, state)
        state.residual = corrected - self.inner.decompress(payload)
        return payload

    def decompress(self, payload: Payload) -> np.ndarray:
        """Decompress with the inner compressor."""
        return self.inner.decompress(payload)

    def spec(self) -> str:
        """Return ``ef(<inner spec>)``."""
        return f"ef({self.inner.spec()})"


_SPEC = re.compile(r"^\s*([a-z0-9_]+)\s*(?::(.*))?$")


def _convert(cls, key: str, raw: str, spec: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        takes = (f"its parameters: {', '.join(fields)}" if fields
                 else f"it takes no parameters: write just {cls.name!r}")
        raise UsageError(
            f"compressor {cls.name!r} has no parameter {key!r} (in {spec!r}); {takes}"
        )
    kind = type(fields[key].default)
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        return kind(raw)
    except ValueError:
        raise UsageError(
            f"parameter {key}={raw!r} of compressor {cls.name!r} is not a valid "
            f"{kind.__name__} (in {spec!r})"
        ) from None


def _options(cls, text: str, spec: str) -> dict:
    """Return the ``key=value`` parameters of ``text`` (what follows ``name:``), converted."""
    if not text.strip():
        raise UsageError(f"nothing follows ':' in {spec!r}; write {cls.name!r} or "
                         f"'{cls.name}:key=value'")
    opts = {}
    for item in text.split(","):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            what = "an empty parameter (a stray comma?)" if not item.strip() else (
                f"parameter {item.strip()!r} has no name" if eq else
                f"parameter {item.strip()!r} has no value")
            raise UsageError(f"{what} in {spec!r}; write key=value[,key=value...]")
        if key in opts:
            raise UsageError(f"parameter {key!r} is given twice in {spec!r}; give each "
                             "parameter once")
        opts[key] = _convert(cls, key, raw.strip(), spec)
    return opts


def parse(spec: str) -> Compressor:
    """Build a compressor from a spec string.

    Grammar: ``name`` | ``name:key=value[,key=value...]`` | ``ef(<spec>)``, e.g.
    ``topk:ratio=0.001``, ``qsgd:levels=16``, ``powersgd:rank=4``,
    ``ef(topk:ratio=0.01)``, ``none``, ``fp16``, ``bf16``. Each parameter is given
    at most once, and ``ef`` wraps a compressor that is not itself ``ef(...)``.

    Raises:
        UsageError: an unknown name or parameter, a parameter given twice, a
            malformed ``key=value``, a value of the wrong type, or ``ef(ef(...))``.
    """
    if not isinstance(spec, str):
        raise UsageError(f"a compressor spec is a string such as 'topk:ratio=0.01', got "
                         f"{type(spec).__name__}")
    text = spec.strip()
    if text.startswith("ef(") and text.endswith(")"):
        inner = text[3:-1].strip()
        if inner.startswith("ef(") and inner.endswith(")"):
            raise UsageError(
                f"{spec!r} nests error feedback: a tensor keeps one residual, and ef of ef "
                f"would keep two, which means nothing; write {f'ef({inner[3:-1].strip()})'!r}"
            )
        return ErrorFeedback(inner=parse(inner))
    m = _SPEC.match(text)
    if not m or m.group(1) not in COMPRESSORS or m.group(1) == "ef":
        known = ", ".join(sorted(n for n in COMPRESSORS if n != "ef"))
        raise UsageError(f"unknown compressor {spec!r}; known: {known}, and ef(<spec>)")
    cls = COMPRESSORS[m.group(1)]
    opts = _options(cls, m.group(2), spec) if m.group(2) is not None else {}
    try:
        return cls(**opts)
    except ValueError as exc:
        raise UsageError(f"compressor {spec!r}: {exc}") from None
