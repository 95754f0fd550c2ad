"""Data-parallel training on one fused gradient vector, for the sparse-allreduce benchmarks.

The Ok-Topk paper sparsifies the whole model's gradient at once (one flat
buffer) and compares allreduces by the bytes they move per step on real
gradients. :func:`train_flat` does exactly that on real data without any
framework front-end: an MLP (PyTorch, CPU) on scikit-learn's 8x8 digits,
every rank a shard of the training set, the flat gradient passed to
``method.allreduce(grad, "model", comm)`` and the result applied with plain SGD.
After each step a callback sees the method and the communicator, so a
benchmark can read the bytes of that step or the method's state (Ok-Topk's
selected counts).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


def digits_split(seed: int = 0, test_fraction: float = 0.25
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardised digits features, split into train/test with a fixed seed."""
    from .digits import load_digits_split

    data = load_digits_split(seed, test_fraction)
    mean, std = data.x_train.mean(0), data.x_train.std(0) + 1e-3
    return ((data.x_train - mean) / std, data.y_train, (data.x_test - mean) / std, data.y_test)


def build_mlp(hidden: tuple[int, ...], seed: int) -> Any:
    """MLP 64 -> hidden... -> 10 with ReLU, initialised from ``seed`` (same on every rank)."""
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    width = 64
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def train_flat(method: Any, comm: Any, steps: int, *, hidden: tuple[int, ...] = (256, 256),
               batch_size: int = 32, lr: float = 0.1, seed: int = 0,
               on_step: Callable[[int, Any, Any], None] | None = None) -> dict[str, Any]:
    """Train the digits MLP for ``steps`` steps with ``method`` as the allreduce.

    Every rank draws its mini-batches from its own shard (rank r holds the
    training examples r, r+P, r+2P, ...). Returns the final test accuracy,
    the number of parameters and the per-step mean training loss of this rank.
    """
    import torch

    x_tr, y_tr, x_te, y_te = digits_split(seed)
    shard = np.arange(comm.rank, len(y_tr), comm.size)
    model = build_mlp(hidden, seed)
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    rng = np.random.default_rng(seed * 1000 + comm.rank)
    losses = []
    for step in range(1, steps + 1):
        pick = shard[rng.integers(0, shard.size, size=batch_size)]
        xb, yb = torch.from_numpy(x_tr[pick]), torch.from_numpy(y_tr[pick])
        model.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params]).numpy()
        avg = method.allreduce(flat, "model", comm)
        with torch.no_grad():
            off = 0
            for p in params:
                cnt = p.numel()
                p -= lr * torch.from_numpy(np.ascontiguousarray(avg[off:off + cnt])).view_as(p)
                off += cnt
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, method, comm)
    with torch.no_grad():
        pred = model(torch.from_numpy(x_te)).argmax(1).numpy()
    return {"test_accuracy": float((pred == y_te).mean()), "n_params": int(n), "losses": losses}


__all__ = ["build_mlp", "digits_split", "train_flat"]
