"""Random-k sparsification with indices from a seed shared by all ranks (Stich et al. 2018).

Every rank draws the same ``k = max(1, round(ratio * n))`` distinct indices,
uniformly without replacement, from ``(seed, step)``, so only the values go on
the wire and payloads from different ranks add up element for element (linear
in a shared basis). Decompression scales the values by ``n / k``: each element
is kept with probability ``k / n``, so ``E[decompress(compress(x))] = x``
(unbiased). The scale comes after the sum, in float32 (float64 for float64),
rounded once: in float16 ``n / k`` times a value, or ``n / k`` itself, may pass
65504 where the reduced result does not. A tensor with a NaN or an infinity where
no index fell sends them too, added to its first value: an overflowed gradient
stays non-finite through it, as through every compressor.

Inside error feedback (``ef(randomk)``) the values are not scaled: that is the
memory SGD of Stich et al. 2018. Error feedback needs a compressor that keeps, on
average, less than it is given (Karimireddy et al. 2019): scaled by ``n / k``, the
expected square of the residual is ``(n / k - 1)`` times the tensor's, so for
``k <= n / 2`` the residual grows from step to step and training diverges. Unscaled,
the residual keeps ``1 - k / n`` of it on average and stays bounded.

On CuPy arrays the indices are still drawn on the host, from the same seed (k
numbers, cheap next to the tensor), and copied to the device: the payload is
the same bits as on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.xp import array_namespace
from .base import Compressor, Payload, check_float, compute_dtype, kept_count, register

__all__ = ["RandomK"]


@register
@dataclass(frozen=True)
class RandomK(Compressor):
    """Keep k shared random elements (scaled by n/k when decompressed); ``ratio`` is k / n."""

    name: ClassVar[str] = "randomk"
    linear: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True
    ratio: float = 0.01

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")

    def keeps(self, n: int) -> int:
        """Return ``k``, the shared elements a tensor of ``n`` elements sends."""
        return kept_count(self.ratio, n)

    @staticmethod
    def indices(n: int, k: int, seed: int, step: int) -> np.ndarray:
        """Return the ascending indices every rank draws for ``(seed, step)``."""
        rng = np.random.default_rng([seed, step])
        return np.sort(rng.choice(n, size=k, replace=False))

    def compress(self, x, state) -> Payload:
        """Return the values at this step's shared indices (unscaled); advance the step."""
        check_float(x, self.name)
        xp = array_namespace(x)
        flat = x.reshape(-1)
        n = flat.size
        k = self.keeps(n)
        step, state.step = state.step, state.step + 1
        idx = xp.asarray(self.indices(n, k, state.seed, step))
        values = flat[idx]
        finite = xp.isfinite(flat)
        if k and not bool(finite.all()):  # an overflowed gradient stays non-finite (AMP's
            values[:1] += flat[~finite].sum()  # GradScaler looks), wherever the draw fell
        return self._payload(x, {"values": values}, seed=state.seed, step=step, k=k)

    def for_feedback(self) -> "RandomK":
        """Return the same draw unscaled: what error feedback around it sends."""
        return FedBack(self.ratio)

    def scale(self, n: int, k: int) -> float:
        """Return the factor the sum of the values is multiplied by: ``n / k``."""
        return n / k

    def decompress(self, payload: Payload) -> np.ndarray:
        """Return zeros with the values, scaled by :meth:`scale`, at the shared indices
        (redrawn)."""
        n = int(np.prod(payload.shape))
        m = payload.meta
        values = payload.arrays["values"]
        xp = array_namespace(values)
        out = xp.zeros(n, dtype=payload.dtype)
        if m["k"]:
            cd = compute_dtype(payload.dtype)
            scaled = values.astype(cd) * cd.type(self.scale(n, m["k"]))
            out[xp.asarray(self.indices(n, m["k"], m["seed"], m["step"]))] = scaled
        return out.reshape(payload.shape)


@dataclass(frozen=True)
class FedBack(RandomK):
    """Random-k inside error feedback: the values unscaled (Stich et al. 2018), its spec
    the same (``ef(randomk:ratio=...)``)."""

    def for_feedback(self) -> "RandomK":
        return self

    def scale(self, n: int, k: int) -> float:
        return 1.0
