"""The main demo's workload: an MLP on scikit-learn's digits, data-parallel over P ranks.

Real data that ships inside scikit-learn (1797 8x8 images, 10 classes): no
download. The data set is split 80/20 into train and test with a fixed seed;
rank i trains on every P-th training example, so the ranks' gradients differ
and the global batch is ``P * batch_size``. Every rank starts from rank 0's
parameters and takes the same number of steps.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from ...mpi_collectives.accounting import allreduce_volume


@dataclass
class DigitsData:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """Digits scaled to [0, 1], shuffled with ``seed`` and split into train/test."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    return DigitsData(x[train], y[train], x[test], y[test])


def make_mlp(hidden: int = 128, seed: int = 0) -> Any:
    """64 -> hidden -> hidden -> 10 MLP with ReLU, initialised from ``seed``."""
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10))


def train_epoch(model: Any, opt: Any, xs: Any, ys: Any, *, seed: int, epoch: int, rank: int,
                batch_size: int, steps_per_epoch: int, on_step: Any = None) -> float:
    """One epoch of minibatch SGD on this rank's shard; returns the mean training loss.

    The shard is visited in a permutation seeded by ``(seed, epoch, rank)``, so
    every run with the same seeds sees the same batches. ``on_step()`` runs
    after each optimizer step (a progress bar's update).
    """
    import torch
    loss_fn = torch.nn.CrossEntropyLoss()
    order = torch.from_numpy(np.random.default_rng([seed, epoch, rank]).permutation(len(ys)))
    model.train()
    loss_sum = 0.0
    for step in range(steps_per_epoch):
        idx = order[step * batch_size:(step + 1) * batch_size]
        opt.zero_grad()
        loss = loss_fn(model(xs[idx]), ys[idx])
        loss.backward()
        opt.step()
        loss_sum += float(loss.detach())
        if on_step is not None:
            on_step()
    return loss_sum / steps_per_epoch


def params_digest(params: Any) -> str:
    """An 8-byte BLAKE2b digest of the parameters' bytes (equal digests: bit-identical models)."""
    return hashlib.blake2b(b"".join(p.detach().numpy().tobytes() for p in params),
                           digest_size=8).hexdigest()


def dense_bytes_per_step(num_params: int, world_size: int, itemsize: int = 4) -> float:
    """Bytes per rank of a ring allreduce of all gradients: 2N(P-1)/P."""
    return allreduce_volume(num_params * itemsize, world_size)


def sgd_settings(method: Any, lr: float, momentum: float | None) -> tuple[float, float]:
    """(lr, momentum) for plain SGD with ``method``.

    ``momentum=None`` means: heavy-ball momentum 0.9, except for methods whose
    feedback is EF21M, which already carries the momentum (ARC-Top-K paper,
    eq. 11a, eta = 1 - beta): there SGD runs without momentum at lr / eta, the
    same effective step.
    """
    if momentum is not None:
        return lr, momentum
    fb = getattr(method, "feedback", None)
    if fb is not None and fb.name == "ef21m":
        return lr / fb.params()["eta"], 0.0
    return lr, 0.9


def train_digits(compression: Any = None, comm: Any = None, *, epochs: int = 30,
                 batch_size: int = 32, hidden: int = 128, lr: float = 0.05,
                 momentum: float | None = None, optimizer: str = "sgd", seed: int = 0,
                 bucket_bytes: int | None = None, overlap: bool = True,
                 progress: bool = False, label: str = "") -> dict[str, Any]:
    """Train the digits MLP on all ranks of ``comm`` with ``compression``; return metrics.

    SGD's momentum defaults per method (see :func:`sgd_settings`); pass
    ``momentum`` to force one.

    Returns a dict with ``test_accuracy`` (final, in [0, 1]), ``train_loss``
    (last epoch's mean), ``history`` (per epoch: accuracy, cumulative bytes
    sent per rank), ``bytes_sent_per_step``/``bytes_received_per_step`` (this
    rank, gradient exchange only), ``dense_bytes_per_step``,
    ``compression_ratio`` (dense / sent), ``seconds_per_step``,
    ``comm_seconds_per_step``, ``wait_seconds_per_step``, ``steps`` and
    ``params_digest`` (a hash of the final parameters, equal on all ranks).
    """

    import torch

    from ...compressors.registry import create
    from ...mpi_collectives import Communicator
    from ...runtime.buckets import DEFAULT_BUCKET_BYTES
    from ...torch import DistributedOptimizer, broadcast_parameters

    torch.set_num_threads(1)
    comm = comm if comm is not None else Communicator()
    method = compression if compression is not None else create("none")
    data = load_digits_split(seed)
    xs = torch.from_numpy(data.x_train[comm.rank::comm.size])
    ys = torch.from_numpy(data.y_train[comm.rank::comm.size])
    shard = len(data.y_train) // comm.size
    steps_per_epoch = max(1, shard // batch_size)

    model = make_mlp(hidden, seed)
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    if optimizer == "sgd":
        sgd_lr, sgd_momentum = sgd_settings(method, lr, momentum)
        base = torch.optim.SGD(model.parameters(), lr=sgd_lr, momentum=sgd_momentum)
    elif optimizer == "adam":
        base = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    opt = DistributedOptimizer(base, named_parameters=model.named_parameters(),
                               compression=method, comm=comm, overlap=overlap,
                               bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES)
    num_params = sum(p.numel() for p in model.parameters())
    comm.reset_stats()
    history, elapsed = train_epochs(model, opt, xs, ys, data, model, epochs=epochs, seed=seed,
                                    rank=comm.rank, batch_size=batch_size,
                                    steps_per_epoch=steps_per_epoch,
                                    label=(label or method.name) if progress else None,
                                    bytes_sent=lambda done: comm.bytes_sent)
    steps = epochs * steps_per_epoch
    sent = comm.bytes_sent / steps
    dense = dense_bytes_per_step(num_params, comm.size)
    digest = params_digest(model.parameters())
    return {
        "method": method.name, "config": method.config(), "world_size": comm.size,
        "test_accuracy": history[-1]["test_accuracy"], "train_loss": history[-1]["train_loss"],
        "history": history, "steps": steps, "num_params": num_params,
        "bytes_sent_per_step": sent, "bytes_received_per_step": comm.bytes_received / steps,
        "dense_bytes_per_step": dense, "compression_ratio": dense / sent if sent else float("inf"),
        "seconds_per_step": elapsed / steps,
        "comm_seconds_per_step": opt.exchange.comm_seconds / steps,
        "wait_seconds_per_step": opt.exchange.wait_seconds / steps,
        "params_digest": digest,
        **({"decisions": method.decisions()} if hasattr(method, "decisions") else {}),
    }


def train_epochs(model: Any, opt: Any, xs: Any, ys: Any, data: DigitsData, eval_model: Any, *,
                 epochs: int, seed: int, rank: int, batch_size: int, steps_per_epoch: int,
                 label: str | None, bytes_sent: Callable[[int], float]) -> tuple[list[dict], float]:
    """``epochs`` of :func:`train_epoch`, each followed by the test accuracy of ``eval_model``:
    ``(history, seconds)``.

    ``history[e]``: epoch, test accuracy, ``bytes_sent(steps done)`` and train
    loss. ``label``: show a progress bar under that name on rank 0 (None: no bar).
    """
    history = []
    bar = None
    if label is not None and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=epochs * steps_per_epoch, desc=label, unit="step", leave=False,
                   dynamic_ncols=True)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        train_loss = train_epoch(model, opt, xs, ys, seed=seed, epoch=epoch, rank=rank,
                                 batch_size=batch_size, steps_per_epoch=steps_per_epoch,
                                 on_step=None if bar is None else lambda: bar.update(1))
        acc = evaluate(eval_model, data)
        history.append({"epoch": epoch + 1, "test_accuracy": acc,
                        "bytes_sent": bytes_sent((epoch + 1) * steps_per_epoch),
                        "train_loss": train_loss})
        if bar is not None:
            bar.set_postfix(acc=f"{acc:.3f}")
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return history, elapsed


def evaluate(model: Any, data: DigitsData) -> float:
    """Test-set accuracy of ``model``."""
    import torch
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x_test)).argmax(1).numpy()
    return float((pred == data.y_test).mean())
