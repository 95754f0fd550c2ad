"""The digits MLP trained with ``torch.nn.parallel.DistributedDataParallel`` and our comm hooks.

The workload of :mod:`.digits` (same data split, model, per-rank shards and
SGD settings) under DDP instead of our ``DistributedOptimizer``: gradients are
averaged by DDP's buckets through :func:`horovod_compress.torch.ddp.comm_hook`
(or by DDP's own allreduce, or by PyTorch's ``powerSGD_hook``, for
comparison). Needs an initialised ``torch.distributed`` process group
(``torchrun``); ``hvdc train --launcher torchrun`` and ``examples/ddp_digits.py``
start one.
"""
from __future__ import annotations

from typing import Any

from .digits import (dense_bytes_per_step, load_digits_split, make_mlp, params_digest,
                     sgd_settings, train_epochs)


def train_ddp_digits(method: Any = None, *, epochs: int = 10, batch_size: int = 32,
                     hidden: int = 128, lr: float = 0.05, momentum: float | None = None,
                     seed: int = 0, bucket_cap_mb: float | None = None,
                     torch_powersgd: dict[str, Any] | None = None, comm: Any = None,
                     progress: bool = False, label: str = "") -> dict[str, Any]:
    """Train on every rank of the default process group; return metrics (as ``train_digits``).

    ``method``: an ``hvdc.Compression`` method run by our hook; ``None``: DDP's
    own allreduce (dense). ``torch_powersgd``: keyword arguments of PyTorch's
    ``PowerSGDState`` -- run its ``powerSGD_hook`` instead (``method`` must be None).
    """
    import torch
    import torch.distributed as dist

    from ...torch import ddp as hvdc_ddp

    rank, size = dist.get_rank(), dist.get_world_size()
    data = load_digits_split(seed)
    xs = torch.from_numpy(data.x_train[rank::size])
    ys = torch.from_numpy(data.y_train[rank::size])
    steps_per_epoch = max(1, (len(data.y_train) // size) // batch_size)
    net = make_mlp(hidden, seed)
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = torch.nn.parallel.DistributedDataParallel(net, **kwargs)
    state = None
    if method is not None:
        if torch_powersgd is not None:
            raise ValueError("give either method or torch_powersgd")
        hook = hvdc_ddp.comm_hook(method, model=model, comm=comm)
        model.register_comm_hook(hook.state, hook)
        state = hook.state
        state.reset_statistics()
        name = method.name
    elif torch_powersgd is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        # one bucket at a time: on gloo, powerSGD_hook can deadlock with several in flight
        model.register_comm_hook(ps.PowerSGDState(process_group=None, **torch_powersgd),
                                 hvdc_ddp.one_bucket_at_a_time(ps.powerSGD_hook))
        name = "torch_powerSGD_hook"
    else:
        name = "ddp_dense"
    sgd_lr, sgd_momentum = sgd_settings(method, lr, momentum)
    opt = torch.optim.SGD(model.parameters(), lr=sgd_lr, momentum=sgd_momentum)
    num_params = sum(p.numel() for p in net.parameters())
    dense = dense_bytes_per_step(num_params, size)
    history, elapsed = train_epochs(
        model, opt, xs, ys, data, model.module, epochs=epochs, seed=seed, rank=rank,
        batch_size=batch_size, steps_per_epoch=steps_per_epoch,
        label=(label or name) if progress else None,
        bytes_sent=lambda done: state.statistics()["bytes_sent"] if state is not None
        else dense * done)
    steps = epochs * steps_per_epoch
    sent = state.statistics()["bytes_sent"] / steps if state is not None else dense
    digest = params_digest(net.parameters())
    return {"method": name, "config": method.config() if method is not None else
            (torch_powersgd or {}), "world_size": size, "launcher": "torchrun",
            "test_accuracy": history[-1]["test_accuracy"], "train_loss": history[-1]["train_loss"],
            "history": history, "steps": steps, "num_params": num_params,
            "bytes_sent_per_step": sent, "dense_bytes_per_step": dense,
            "compression_ratio": dense / sent if sent else float("inf"),
            "seconds_per_step": elapsed / steps, "params_digest": digest}


__all__ = ["train_ddp_digits"]
