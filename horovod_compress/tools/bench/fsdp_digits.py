"""The digits MLP trained under FSDP2 (``fully_shard``) with our compressed reduce-scatter.

The workload of :mod:`.digits` and :mod:`.ddp_digits` (same data split,
model, per-rank shards, batches and SGD settings), with each ``Linear`` and
the root sharded by ``torch.distributed.fsdp.fully_shard``; gradients leave
each layer through :func:`horovod_compress.torch.fsdp.register`'s
reduce-scatter (or FSDP2's own, ``method=None``). Needs an initialised
``torch.distributed`` process group (``torchrun``).
"""
from __future__ import annotations

from typing import Any

from .digits import load_digits_split, make_mlp, sgd_settings, train_epochs


def sharded_mlp(hidden: int = 128, seed: int = 0, *, reshard_after_forward: bool = True,
                mp_policy: Any = None) -> Any:
    """:func:`~.digits.make_mlp` with ``fully_shard`` on every ``Linear`` and on the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"reshard_after_forward": reshard_after_forward,
              "mp_policy": mp_policy or MixedPrecisionPolicy()}
    net = make_mlp(hidden, seed)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)
    return net


def train_fsdp_digits(method: Any = None, *, epochs: int = 10, batch_size: int = 32,
                      hidden: int = 128, lr: float = 0.05, momentum: float | None = None,
                      seed: int = 0, comm: Any = None, progress: bool = False,
                      label: str = "") -> dict[str, Any]:
    """Train on every rank of the default process group; return metrics (as ``train_ddp_digits``).

    ``method``: an ``hvdc.Compression`` method run as every module's
    reduce-scatter; ``None``: FSDP2's own reduce-scatter (dense). Bytes are
    this rank's, per step, against FSDP2's dense reduce-scatter
    (:func:`~horovod_compress.torch.fsdp.dense_reduce_scatter_bytes`).
    """
    import torch
    import torch.distributed as dist

    from ...torch import fsdp as hvdc_fsdp

    rank, size = dist.get_rank(), dist.get_world_size()
    data = load_digits_split(seed)
    xs = torch.from_numpy(data.x_train[rank::size])
    ys = torch.from_numpy(data.y_train[rank::size])
    steps_per_epoch = max(1, (len(data.y_train) // size) // batch_size)
    model = sharded_mlp(hidden, seed)
    state = hvdc_fsdp.register(model, method, comm=comm) if method is not None else None
    if state is not None:
        state.reset_statistics()
    sgd_lr, sgd_momentum = sgd_settings(method, lr, momentum)
    opt = torch.optim.SGD(model.parameters(), lr=sgd_lr, momentum=sgd_momentum)
    dense = hvdc_fsdp.dense_reduce_scatter_bytes(model, size)
    history, elapsed = train_epochs(
        model, opt, xs, ys, data, model, epochs=epochs, seed=seed, rank=rank,
        batch_size=batch_size, steps_per_epoch=steps_per_epoch,
        label=(label or (method.name if method is not None else "fsdp_dense")) if progress
        else None,
        bytes_sent=lambda done: state.statistics()["bytes_sent"] if state is not None
        else dense * done)
    steps = epochs * steps_per_epoch
    sent = state.statistics()["bytes_sent"] / steps if state is not None else dense
    return {"method": method.name if method is not None else "fsdp_dense",
            "config": method.config() if method is not None else {}, "world_size": size,
            "launcher": "torchrun", "test_accuracy": history[-1]["test_accuracy"],
            "train_loss": history[-1]["train_loss"], "history": history, "steps": steps,
            "bytes_sent_per_step": sent, "dense_bytes_per_step": dense,
            "compression_ratio": dense / sent if sent else float("inf"),
            "seconds_per_step": elapsed / steps}


__all__ = ["sharded_mlp", "train_fsdp_digits"]
