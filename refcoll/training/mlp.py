"""The one model refcoll trains: a multilayer perceptron in NumPy, its backward pass layer by layer.

Parameters are a list ``[W1, b1, W2, b2, ...]`` of He-initialised weights and zero
biases, drawn from a seed alone, so every rank builds the same model. ReLU between the
layers, softmax cross-entropy at the end. :func:`backward` runs last layer first and hands
each gradient over as soon as it exists, as autograd does, which is what lets a
:class:`~refcoll.training.reducer.Reducer` start a bucket's all-reduce while earlier
layers still compute. ``refcoll train`` trains a 64-H-10 one on the digits
(:mod:`~refcoll.training.train`); ``refcoll train --overlap`` a deeper one through the
Reducer (:mod:`~refcoll.training.overlap`).
"""

from __future__ import annotations

import math
import time

import numpy as np

__all__ = ["init_layers", "forward", "loss_gradient", "backward", "loss_and_grads", "accuracy"]


def init_layers(widths, seed: int, dtype=np.float32) -> list[np.ndarray]:
    """Return He-initialised weights and zero biases ``[W1, b1, ...]``, from ``seed`` alone."""
    rng = np.random.default_rng([seed, 0])
    params = []
    for n_in, n_out in zip(widths, widths[1:]):
        params.append((rng.standard_normal((n_in, n_out)) * math.sqrt(2 / n_in)).astype(dtype))
        params.append(np.zeros(n_out, dtype))
    return params


def forward(params, x: np.ndarray) -> list[np.ndarray]:
    """Return the activations: the input, each hidden layer's ReLU output, the logits."""
    acts = [x]
    for layer in range(len(params) // 2):
        z = acts[-1] @ params[2 * layer] + params[2 * layer + 1]
        acts.append(z if 2 * layer + 2 == len(params) else np.maximum(z, 0, out=z))
    return acts


def loss_gradient(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Return the mean softmax cross-entropy and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows, d_logits = np.arange(len(y)), np.exp(log_probs)
    d_logits[rows, y] -= 1
    d_logits /= len(y)
    return float(-log_probs[rows, y].mean()), d_logits


def backward(params, acts, d_out: np.ndarray, on_grad, *, spans: list | None = None,
             sleep=None, grads=None, out=None) -> None:
    """Run the backward pass last layer first, calling ``on_grad(i, grad)`` as each exists.

    ``spans`` collects each layer's ``(start, end)`` perf_counter stamps, last
    layer first. With ``sleep`` (seconds per layer), a layer's work is a sleep
    that long and its gradients are the given ``grads``: the free-cores stand-in.
    ``out(i)``: the array gradient ``i`` is written into (a Reducer's
    :meth:`~refcoll.training.reducer.Reducer.gradient` view); new arrays without it.
    """
    d = d_out
    into = out or (lambda i: None)
    for layer in reversed(range(len(params) // 2)):
        start = time.perf_counter()
        if sleep is not None:
            time.sleep(sleep[layer])
            for i in (2 * layer + 1, 2 * layer):
                on_grad(i, grads[i] if out is None else np.copyto(out(i), grads[i]) or out(i))
        else:
            a = acts[layer]
            on_grad(2 * layer + 1, np.sum(d, axis=0, out=into(2 * layer + 1)))
            on_grad(2 * layer, np.matmul(a.T, d, out=into(2 * layer)))
            if layer:  # the input's gradient, through the previous layer's ReLU
                d = (d @ params[2 * layer].T) * (a > 0)
        if spans is not None:
            spans.append((start, time.perf_counter()))


def loss_and_grads(params, x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Return the mean loss on ``(x, y)`` and every parameter's gradient, in index order."""
    acts, grads = forward(params, x), [None] * len(params)
    loss, d_out = loss_gradient(acts[-1], y)
    backward(params, acts, d_out, grads.__setitem__)
    return loss, grads


def accuracy(params, x: np.ndarray, y: np.ndarray) -> float:
    """Return the fraction of rows of ``x`` whose predicted class is ``y``."""
    return float((forward(params, x)[-1].argmax(axis=1) == y).mean())
