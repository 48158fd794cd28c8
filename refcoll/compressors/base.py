"""The compressor contract: settings, payloads, explicit state, error feedback.

Modelled on GRACE's three roles (Xu et al. 2021) and epfml/powersgd's tested
invariants. A compressor is a frozen dataclass of settings with two pure
functions: ``compress(x, state) -> Payload`` and ``decompress(payload) -> ndarray``
(same shape and dtype as ``x``). Everything that changes between calls (an RNG,
PowerSGD's warm-start ``Q``, an error-feedback residual) lives in an explicit
:class:`CompressorState`, never in module globals.

A compressor never communicates. It declares how its payloads may be combined,
through one interface, and ``compressors/patterns/`` does the combining:

* :attr:`Compressor.patterns`: the patterns it allows, its default first;
* :meth:`Compressor.allreduce_rounds`: the all-reduces the ``allreduce``
  pattern runs for it, as :class:`Round` records (one by default: every wire
  array summed; PowerSGD's two with an orthogonalisation between; int8's
  shared-scale maximum before its codes);
* what the cost model and the benchmarks read instead of its name:
  :attr:`Compressor.matrices` (it compresses each tensor as a matrix, so it
  needs the shapes), :meth:`Compressor.shared_factors`,
  :meth:`Compressor.keeps` and :attr:`Compressor.identity`.

Error feedback is :class:`ErrorFeedback`, the one place it is written: its
:meth:`~ErrorFeedback.corrected` and :meth:`~ErrorFeedback.new_residual` are
what the patterns call around the compressor inside it.

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
from typing import Any, ClassVar, Generator, NamedTuple

import numpy as np

from ..core.errors import UsageError
from ..core.ops import is_float

__all__ = [
    "Payload",
    "CompressorState",
    "Round",
    "Rounds",
    "Compressor",
    "ErrorFeedback",
    "split_feedback",
    "COMPRESSORS",
    "register",
    "parse",
    "index_dtype",
    "compute_dtype",
    "check_float",
    "kept_count",
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


class Round(NamedTuple):
    """One all-reduce of the ``allreduce`` pattern: every array reduced over the ranks.

    Attributes:
        arrays: the arrays by role; each goes through the all-reduce as it is,
            roles in sorted order, and the results come back by role.
        op: the reduction (``sum``, ``avg``, ``max``).
    """

    arrays: dict
    op: str


#: What :meth:`Compressor.allreduce_rounds` is: it yields rounds, is sent their
#: results, and returns ``(local, result)``.
Rounds = Generator[Round, dict, tuple[Payload, Any]]


@dataclass(frozen=True)
class Compressor:
    """Base of every compressor: settings as dataclass fields, two pure functions.

    Subclasses set ``name`` and ``linear`` (whether payloads from several ranks
    add up in a shared basis, so an all-reduce can sum them directly) and
    implement :meth:`compress` and :meth:`decompress`. How their payloads are
    combined they declare here (see the module docstring): the class variables
    and the hooks below, overridden where a method differs from the default.
    """

    name: ClassVar[str] = ""
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    #: The patterns a method declares itself, the default first; empty: from ``linear``.
    declared_patterns: ClassVar[tuple[str, ...]] = ()
    #: Whether it compresses each tensor as a matrix ``(m, ...)``: it needs the shapes.
    matrices: ClassVar[bool] = False
    #: Whether the payload is the tensor itself: compressing and decompressing do no work.
    identity: ClassVar[bool] = False
    #: The most ranks its ``allreduce`` pattern sums (None: any number).
    most_ranks: ClassVar[int | None] = None

    @property
    def patterns(self) -> tuple[str, ...]:
        """Return the collective patterns its payloads allow, the default first.

        ``allreduce``: payloads add up in a shared basis, so any all-reduce sums
        them (in the rounds of :meth:`allreduce_rounds`); ``gather``: every
        payload is gathered and the sum taken after decompression; ``twophase``:
        compressed all-to-all, sum and recompress per chunk, compressed
        allgather (see ``compressors/patterns/``). Unless a method declares its
        own, linear ones allow ``allreduce`` (the default) and ``gather``, the
        others ``gather``.
        """
        if self.declared_patterns:
            return self.declared_patterns
        return ("allreduce", "gather") if self.linear else ("gather",)

    def allreduce_rounds(self, x, state: CompressorState, *, size: int, op: str) -> Rounds:
        """Yield the all-reduces the ``allreduce`` pattern runs for ``x``; return the result.

        A generator: each :class:`Round` it yields is all-reduced over the
        ``size`` ranks and the results are sent back into it, by role, so a
        method can compute between rounds; it never communicates itself. It
        returns ``(local, result)``: ``local`` is the payload that stands for
        this rank's own contribution (error feedback keeps ``x`` minus its
        decompression), ``result`` the reduced tensor in ``x``'s shape and dtype.

        By default one round: the payload's wire arrays, reduced with ``op``,
        and the reduced payload decompressed.
        """
        payload = self.compress(x, state)
        summed = yield Round(payload.arrays, op)
        return payload, self.decompress(dataclasses.replace(payload, arrays=summed))

    def shared_factors(self, shape: tuple) -> tuple[int, ...] | None:
        """Return the element counts of the rounds a tensor of ``shape`` puts through.

        For a method that compresses matrices (:attr:`matrices`): the elements
        of each round of :meth:`allreduce_rounds`, in order, in the compute
        dtype (:func:`compute_dtype`); None when the tensor goes whole. What
        the cost model prices without compressing anything.
        """
        return None

    def keeps(self, n: int) -> int | None:
        """Return how many elements of ``n`` each wire array holds, if a fixed rule says.

        Sparsifiers that keep a fixed number of elements (top-k, random-k)
        return it; None when the data or the blocks decide.
        """
        return None

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

    def for_feedback(self) -> "Compressor":
        """Return the compressor error feedback wraps in its place (itself, unless the
        method has a form that keeps less than it is given, as error feedback needs)."""
        return self

    def _payload(self, x: np.ndarray, arrays: dict, **meta) -> Payload:
        return Payload(self.name, tuple(x.shape), np.dtype(x.dtype), arrays, meta)


def too_many_ranks(compressor: "Compressor", ranks: int) -> str:
    """Say that ``compressor``'s ``allreduce`` pattern cannot sum ``ranks`` ranks."""
    return (f"{compressor.name}'s allreduce pattern sums at most {compressor.most_ranks} ranks' "
            f"codes in their own type; {ranks} ranks are too many: use the gather pattern")


def kept_count(ratio: float, n: int) -> int:
    """Return ``k = min(n, max(1, round(ratio * n)))`` elements kept of ``n`` (0 of none)."""
    return min(n, max(1, round(ratio * n))) if n else 0


@dataclass(frozen=True)
class ErrorFeedback(Compressor):
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019) around any compressor.

    Algorithm, per call with residual ``e_old`` (zero at first):

    1. ``c = x + e_old`` (in ``x``'s dtype): :meth:`corrected`;
    2. ``payload = inner.compress(c)``;
    3. ``e_new = c - inner.decompress(payload)`` (in ``x``'s dtype), kept in the
       state: :meth:`new_residual`.

    So ``e_new`` is, bit for bit, ``(x + e_old) - decompress(payload)`` evaluated
    in the dtype, and ``decompress(payload) + e_new == x + e_old`` holds exactly
    whenever that subtraction is exact (Sterbenz: always for casts; always for
    top-k, threshold, where each element is either sent whole or not at all). For
    compressors whose output differs greatly in magnitude from the input element
    (sign, 1-bit, QSGD...) the subtraction can round, and the identity holds to
    within half an ulp of ``e_new``: no residual in the same dtype can do better,
    since ``d + e`` lies on ``d``'s grid.

    The patterns that compress otherwise than by one :meth:`compress` call
    (PowerSGD's rounds, where the approximation is ``P_shared Q_localᵀ``; the
    two-phase scheme, whose server keeps a second residual for its chunk) call
    steps 1 and 3 themselves, around what they do in step 2.
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
        object.__setattr__(self, "inner", self.inner.for_feedback())  # (random-k: unscaled)

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.inner.linear

    @property
    def matrices(self) -> bool:  # type: ignore[override]
        return self.inner.matrices

    @property
    def patterns(self) -> tuple[str, ...]:
        """Return the inner compressor's patterns."""
        return self.inner.patterns

    def shared_factors(self, shape: tuple) -> tuple[int, ...] | None:
        """Return the inner compressor's factors: the residual changes no size."""
        return self.inner.shared_factors(shape)

    def keeps(self, n: int) -> int | None:
        """Return what the inner compressor keeps."""
        return self.inner.keeps(n)

    @staticmethod
    def corrected(x, residual):
        """Return ``x + residual``, the tensor to compress (``x`` itself before any residual).

        Raises:
            UsageError: the residual is another tensor's (its shape or dtype differ): a
                state serves one tensor.
        """
        if residual is None:
            return x
        ErrorFeedback.check_residual(residual, x)
        return x + residual

    @staticmethod
    def check_residual(residual, x) -> None:
        """Refuse a residual that is not ``x``'s: another tensor's (its shape or dtype differ)."""
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise UsageError(f"this error-feedback state holds the residual of a "
                             f"{residual.dtype} tensor of shape {residual.shape}, not of this "
                             f"{x.dtype} {x.shape} one: keep one state per tensor "
                             "(compressor.new_state(...) for each)")

    @staticmethod
    def new_residual(corrected, approximation):
        """Return ``corrected - approximation``: the error the next call feeds back."""
        return corrected - approximation

    def compress(self, x: np.ndarray, state: CompressorState) -> Payload:
        """Compress ``x`` plus the residual and keep the new residual in ``state``."""
        corrected = self.corrected(x, state.residual)
        payload = self.inner.compress(corrected, state)
        state.residual = self.new_residual(corrected, self.inner.decompress(payload))
        return payload

    def decompress(self, payload: Payload) -> np.ndarray:
        """Decompress with the inner compressor."""
        return self.inner.decompress(payload)

    def spec(self) -> str:
        """Return ``ef(<inner spec>)``."""
        return f"ef({self.inner.spec()})"


def split_feedback(comp: Compressor) -> tuple[Compressor, ErrorFeedback | None]:
    """Return the compressor inside any error feedback, and the feedback (None without)."""
    if isinstance(comp, ErrorFeedback):
        return comp.inner, comp
    return comp, None


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
