"""A matrix method on a group of gradients, each in its own shape, the group's collectives fused.

Matrix methods (PowerSGD, GreedyLore, ARC-Top-K, ...) reduce each gradient in
its own shape, and each call issues a few small collectives: the 1-byte
agreement of ``mpi_collectives.consistency``, then one or two allreduces. Run one
after the other over a model's ~50 tensors they cost a latency -- and, where
ranks share cores, a wait for the slowest peer -- per collective per tensor.
PyTorch's ``powerSGD_hook`` instead allreduces all of a bucket's ``P``
matrices in one call, and all its ``Q``\\ s in another ("PowerSGD: Practical
Low-Rank Gradient Compression for Distributed Optimization", Vogels et al.,
NeurIPS 2019, Section 4: "we pack all the P matrices of the layers into one
buffer").

:class:`PerTensorReducer` does that for every front-end: the DDP comm hook
(on DDP's buckets) and the optimizers' exchange engine (on the groups of
``runtime.buckets``). A method with a group-level path (``allreduce_many``:
PowerSGD) runs the whole group on the calling thread, one fused collective
per round; the others run in lockstep
(:class:`~horovod_compress.mpi_collectives.lockstep.Lockstep`: one greenlet
per tensor on the calling thread, the same fusion); where the communicator cannot account fused calls,
or fusion is switched off (``lockstep = False``), the tensors run one by one.
All three give the same averages and the same byte counts per original call.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..mpi_collectives.lockstep import Lockstep


class PerTensorReducer:
    """Reduces a group of gradients with a matrix method, fusing the group's collectives."""

    def __init__(self, lockstep: bool = True) -> None:
        self.lockstep = lockstep

    def fuses(self, comm: Any) -> bool:
        """Whether a group on ``comm`` is reduced with its collectives fused."""
        return bool(self.lockstep) and getattr(comm, "size", 1) > 1 and Lockstep.supports(comm)

    def reduce(self, method: Any, comm: Any, xs: Sequence[Any], names: Sequence[str],
               out: Sequence[Any] | None = None) -> list[Any]:
        """``[method.allreduce(x, name, comm) for x, name in zip(xs, names)]``, collectives fused.

        ``out``: arrays a group-level path (``allreduce_many``) may write the
        averages into (the caller must still use the returned arrays).
        """
        if len(xs) != len(names):
            raise ValueError(f"PerTensorReducer.reduce: {len(xs)} arrays but {len(names)} names")
        if not xs:
            return []
        if len(xs) == 1 or not self.fuses(comm):
            return [method.allreduce(x, name, comm) for x, name in zip(xs, names)]
        many = getattr(method, "allreduce_many", None)
        if many is not None and method.can_reduce_many(xs, comm):
            return list(many(xs, names, comm, out=out))
        return Lockstep(comm).run([(lambda c, x=x, name=name: method.allreduce(x, name, c))
                                   for x, name in zip(xs, names)])


__all__ = ["PerTensorReducer"]
