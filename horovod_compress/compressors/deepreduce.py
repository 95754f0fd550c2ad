"""``deepreduce`` -- DeepReduce: sparse tensors as compressed (index, value) containers.

Kostopoulou, Xu, Dutta, Li, Ntoulas, Kalnis, "DeepReduce: A Sparse-tensor
Communication Framework for Distributed Deep Learning" (NeurIPS 2021,
Sections 3-5). Per step and tensor, rank i

1. sparsifies its input x_i with any registered method (``sparsifier="topk"``
   by default, or ``"none"`` for inherently sparse gradients): support S_i,
   sparse tensor g~_i;
2. encodes (S_i, values) with an index codec and a value codec into one
   self-describing container (:mod:`horovod_compress.codecs.container`);
3. exchanges the containers with ``allgatherv`` of uint8 (sizes differ);
4. decodes all P containers and sums:  avg = (1/P) sum_j D(c_j).

``local`` (what error feedback subtracts) is D(c_i), what this rank's own
container decodes to -- exactly what the other ranks add -- so residual
feedback keeps everything a lossy codec dropped (false positives left out by
Bloom P1/P2, curve-fit and quantization errors) for the next step.

Index codecs: ``raw``, ``bitmap``, ``rle``, ``huffman`` (the default),
``bloom`` (``fpr``, ``policy`` naive/p0/p1/p2; defaults 0.001 and p2, the
paper's). The default index codec is Huffman-coded gaps, chosen by
measurement (docs/methods/deepreduce.md, "Default configuration"): on Top-k
1 % of a 2000 x 2000 gradient it is smaller than Bloom P2 (0.63 vs 0.73 of the
raw pairs), lossless, and decodes in about 1 ms where a Bloom filter needs an
O(n) query (~60 ms per container at n = 4M) plus P2's selection. Value codecs: ``raw``, ``deflate``, ``qsgd``,
``polyfit``, ``dexp``. Values sent for Bloom positives outside S (P0/P1/P2)
come from the sparsifier's input x_i (``fp_values="dense"``, GRACE's choice
in the paper) or are 0 (``fp_values="sparse"``: P0 then reproduces g~_i
exactly).

Volume per rank and step (the communicator's allgatherv model): with
container sizes c_j, rank i sends sum_{j != i+1} c_j and receives
sum_{j != i} c_j, plus 8 (P - 1) bytes each way for the sizes. With Top-k at
density 1 % on real gradients, Bloom P2 (fpr 0.001) makes c_j 0.74 of the 8k
bytes of raw (index, value) pairs, P0 0.81, P2 + polyfit 0.49 (measured,
docs/methods/deepreduce.md); ``expected_bytes`` is None (data-dependent).

CPU hot path, default configuration (Top-k 1 %, Huffman + raw,
EF14), float32 NumPy input, one thread:

* EF14 + Top-k in one read of x and e (:meth:`_reduce_residual`, TopkA's
  ``kernels.selection.add_topk``): ``acc = x + e`` written while the
  candidates above a sampled bound are collected; it reports whether x is
  finite, so the NaN/Inf agreement needs no second read of x
  (:meth:`_defers_finite_check`); the selected values go to the container as
  they are (no gather from ``acc``).
* Encoding: the Huffman index section in two compiled passes over the k
  indices (:mod:`horovod_compress.codecs.index_huffman`), the rank's own
  container neither decoded nor gathered (:meth:`own_part`).
* The sum: a P-way merge of the decoded lists adding each position's
  contributions in float64, in rank order, into fresh zeros
  (:func:`~horovod_compress.kernels.merge_sum.merge_sum`) -- the bits of the
  float64 ``bincount`` this method used before, at O(P k) instead of O(n)
  float64 work and two dense temporaries.
* EF14's ``e = acc - D(c_i)``: with raw values D(c_i) is ``acc`` on the
  sender's slots, so ``acc[s] - acc[s]`` at those slots
  (:func:`~horovod_compress.kernels.scatter.cancel_at`); otherwise ``local``
  in a reused buffer whose slots are cleared next step (O(slots), and EF14
  subtracts at its support only).

Measured per stage for one 2000 x 2000 gradient (docs/methods/deepreduce.md,
"CPU cost per step", the shared 2-core machine, memcpy of the gradient
2.1-2.3 ms in that run): EF14 + Top-k 1.5x a memcpy, encoding 0.3x, the sum
into fresh zeros 0.4x (0.7x with one received container), the residual
update 0.15x, decoding a received container 0.25x; the whole call 2.6x at
P = 1 (3.6-4.8x in quiet moments, when the memcpy is twice as fast), against
14x before. The floor: EF14 must read x and e and write the residual (1.5
memcpys of traffic) and the result is a fresh dense vector (0.5: its pages
zero-filled) -- 2x before any codec work; what is above it is TopkA's
selection work in the fused pass and O(k) codec work (about 0.6x), each a
single pass over the k entries.
Containers, bytes, sums and residuals are bit for bit those of the previous
implementation.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import codecs
from ..codecs import container
from .base import Method, TensorState
from .state import SelectedState
from ..params import check_choice
from ..kernels.merge_sum import merge_sum
from ..kernels.scatter import SparseScratch, scatter_clear
from .registry import create, method_class, register
from .sparse_common import k_from_density
from .topk import TopkA
from ..feedback import Feedback
from ..feedback.residual import ResidualFeedback
from ..kernels.scatter import cancel_at
from ..kernels.selection import add_topk


class _LocalScratch(SparseScratch):
    """A reused dense vector, zero except at the slots last written with given values."""

    def fill_values(self, n: int, dtype: np.dtype, slots: np.ndarray,
                    values: np.ndarray) -> np.ndarray:
        """The n-element buffer holding ``values`` at ``slots`` (the last of a repeated slot wins,
        as ``local[slots] = values`` does) and zeros elsewhere; O(previous + len(slots))."""
        dtype = np.dtype(dtype)
        if self.buf is None or self.buf.size != n or self.buf.dtype != dtype:
            self.buf = np.zeros(n, dtype)
        else:
            scatter_clear(self.buf, self.idx, self.count)
        self.buf[slots] = values
        self.idx = np.array(slots, dtype=np.int64, copy=True)
        self.count = self.idx.size
        return self.buf


INDEX_CODECS = ("raw", "bitmap", "rle", "huffman", "bloom")
VALUE_CODECS = ("raw", "deflate", "qsgd", "polyfit", "dexp")
FP_VALUES = ("dense", "sparse")


@register
class DeepReduce(Method):
    """Sparsifier + index/value codecs in one container, exchanged by allgatherv."""

    name = "deepreduce"
    state_class = SelectedState
    biased = True
    default_feedback = "residual"

    def __init__(self, *, sparsifier: str = "topk", density: float | None = None,
                 sparsifier_params: dict[str, Any] | None = None,
                 index: str = "huffman", value: str = "raw", fpr: float = 0.001,
                 policy: str = "p2", fp_values: str = "dense", poly_degree: int = 5,
                 fit_tol: float = 0.01, qsgd_levels: int = 127, qsgd_bucket: int = 512,
                 deflate_level: int = 6, feedback: str | None = None, warmup_steps: int = 0,
                 seed: int = 0, **feedback_params: Any) -> None:
        self.index = check_choice(self.name, "index", index, INDEX_CODECS)
        self.value = check_choice(self.name, "value", value, VALUE_CODECS)
        self.fp_values = check_choice(self.name, "fp_values", fp_values, FP_VALUES)
        bloom = codecs.make_index_codec("bloom", fpr=fpr, policy=policy)  # validates both
        self.fpr, self.policy = bloom.fpr, bloom.policy
        value_params = {
            "raw": {}, "deflate": {"level": deflate_level},
            "qsgd": {"levels": qsgd_levels, "bucket": qsgd_bucket},
            "polyfit": {"degree": poly_degree, "tol": fit_tol}, "dexp": {"tol": fit_tol}}
        # Build every value codec once so that every argument is validated up front.
        built = {name: codecs.make_value_codec(name, **prm) for name, prm in value_params.items()}
        self.poly_degree, self.fit_tol = built["polyfit"].degree, built["polyfit"].tol
        self.qsgd_levels, self.qsgd_bucket = built["qsgd"].levels, built["qsgd"].bucket
        self.deflate_level = built["deflate"].level
        self._index_codec = bloom if self.index == "bloom" else codecs.make_index_codec(self.index)
        self._value_codec = built[self.value]
        self.sparsifier, self._sparsifier = self._make_sparsifier(
            sparsifier, density, sparsifier_params, seed)
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed,
                         **feedback_params)
        self._self_comm: Any = None

    # ------------------------------------------------------------ sparsifier
    def _make_sparsifier(self, sparsifier: Any, density: float | None,
                         sparsifier_params: dict[str, Any] | None, seed: int) -> tuple[str, Any]:
        if not isinstance(sparsifier, str):
            raise ValueError(f"deepreduce: sparsifier must be a method name or 'none', "
                             f"got {sparsifier!r}")
        if not isinstance(sparsifier_params, (dict, type(None))):
            raise ValueError(f"deepreduce: sparsifier_params must be a dict, got {sparsifier_params!r}")
        params = dict(sparsifier_params or {})
        if density is not None:
            params["density"] = density
        if sparsifier == "none":
            if params:
                raise ValueError(f"deepreduce: sparsifier 'none' takes no parameters, got {params}")
            return "none", None
        if sparsifier == self.name:
            raise ValueError("deepreduce: sparsifier cannot be 'deepreduce' itself")
        try:
            method_class(sparsifier)
        except ValueError as exc:
            raise ValueError(f"deepreduce: sparsifier must be 'none' or a registered method; {exc}") from None
        for key in ("feedback", "warmup_steps", "seed"):
            if key in params:
                raise ValueError(f"deepreduce: give {key!r} to deepreduce, not in sparsifier_params")
        return sparsifier, create(sparsifier, feedback="none", warmup_steps=0, seed=seed, **params)

    def sparsify(self, flat: np.ndarray, name: str, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(S, g~)``: the sorted support and the sparse vector of this rank's input.

        ``"none"``: S = the non-zeros of ``flat``. A method with ``select(x)``
        (Top-k) gives S directly and g~ = x on S. Any other method is run on a
        one-rank communicator (``MPI.COMM_SELF``, no bytes counted here): its
        local contribution C(x) is g~ and S is its non-zeros.
        """
        if self._sparsifier is None:
            return np.flatnonzero(flat).astype(np.int64), flat
        if hasattr(self._sparsifier, "select"):
            return np.sort(np.asarray(self._sparsifier.select(flat), dtype=np.int64)), flat
        st = self._sparsifier.state.get(name)
        if st is None:
            st = self._sparsifier.state[name] = self._sparsifier.new_state()
        st.t += 1
        _avg, local = self._sparsifier._reduce(flat, name, self._comm_self(), st)
        local = np.asarray(local, dtype=flat.dtype).reshape(-1)
        return np.flatnonzero(local).astype(np.int64), local

    def _comm_self(self) -> Any:
        if self._self_comm is None:
            from mpi4py import MPI

            from ..mpi_collectives import Communicator
            self._self_comm = Communicator(MPI.COMM_SELF)
        return self._self_comm

    # ---------------------------------------------------------------- codecs
    def encode(self, flat: np.ndarray, name: str, step: int, rank: int) -> codecs.Encoded:
        """This rank's container for ``flat`` at ``step`` (seeded by name, step, rank)."""
        support, sparse = self.sparsify(flat, name, step)
        return self._encode(flat, support, sparse, name, step, rank)[0]

    def _encode(self, flat: np.ndarray, support: np.ndarray, sparse: np.ndarray, name: str,
                step: int, rank: int, support_values: np.ndarray | None = None
                ) -> tuple[codecs.Encoded, np.ndarray]:
        """``(container, source)`` for the support and sparse vector of :meth:`sparsify`
        (``support_values``: ``sparse[support]`` when known, see :func:`container.encode`)."""
        if self.fp_values == "sparse" and sparse is flat:
            source = np.zeros_like(flat)
            source[support] = flat[support]
        elif self.fp_values == "dense" and sparse is not flat:
            source = flat.copy()
            source[support] = sparse[support]
        else:
            source = sparse
        seed = int(self.local_rng(name, step, rank, "deepreduce").integers(0, 2**63))
        enc = container.encode(support, source, (flat.size,), self._index_codec,
                               self._value_codec, seed, support_values)  # source = sparse on S
        return enc, source

    def own_part(self, enc: codecs.Encoded, support: np.ndarray,
                 source: np.ndarray) -> container.SparseTensor | None:
        """What this rank's own container decodes to, without decoding it, when that is known.

        With raw values the receiver gets ``source`` at the sender's slots
        (``enc.slots``, the index codec's order), bit for bit -- except under
        Bloom's ``naive`` policy, whose values come from S, not from the slots.
        Those values are ``enc.values`` (the index codec's sources are its
        slots), so neither a decode nor a gather from ``source`` is needed.
        Decoding one's own Bloom container would repeat the O(n) query and the
        P2 selection the encoder just ran. Lossy value codecs: None (decode).
        """
        if enc.value_codec != "raw" or (self.index == "bloom" and self.policy == "naive"):
            return None
        slots = np.asarray(enc.slots, dtype=np.int64)
        values = enc.values if enc.values is not None else source[slots]
        return container.SparseTensor(slots, values, (source.size,), int(support.size),
                                      self.index, "raw")

    # ------------------------------------------------------------ allreduce
    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray | None]:
        flat = x.reshape(-1)
        if self._self_comm is None and getattr(comm, "backend", "mpi") != "mpi":
            self._self_comm = comm.self_communicator()   # e.g. torch.distributed: no MPI
        support, sparse = self.sparsify(flat, name, state.t)
        self._pass_finite_gate()    # a deferred NaN/Inf agreement (fused Top-k); else a no-op
        avg, mine, _ = self._exchange(flat, support, sparse, name, comm, state)
        return avg.reshape(x.shape), self._local(name, flat, mine)

    def _fuses(self, x: Any) -> bool:
        """Whether EF14 + Top-k run as one pass (:meth:`_reduce_residual`) for input ``x``."""
        return (self._sparsifier is not None and type(self._sparsifier) is TopkA
                and type(x) is np.ndarray and x.dtype == np.float32)

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """Fused Top-k under no feedback or EF14: every path passes the gate once before the
        allgatherv (:meth:`_reduce` or :meth:`_reduce_residual`), and the fused pass reports
        finiteness from its read of x, so the gradient is not read again for the check."""
        return self._fuses(x) and type(self.feedback) in (Feedback, ResidualFeedback)

    def _reduce_residual(self, x: np.ndarray, e: np.ndarray, acc: np.ndarray, name: str,
                         comm: Any, state: TensorState) -> tuple[np.ndarray, np.ndarray | None] | None:
        """EF14's ``acc = x + e`` fused with Top-k (as TopkA's), then the exchange.

        :class:`~horovod_compress.feedback.residual.ResidualFeedback` calls this
        instead of adding ``x + e`` and calling :meth:`_reduce`; the results are
        the same bit for bit. When ``local`` is ``acc`` on this rank's slots
        (raw values, Bloom naive aside: the default) EF14's ``acc -= local`` is
        applied here in O(k) (:func:`~horovod_compress.kernels.scatter.cancel_at`)
        and ``(avg, None)`` returned; else ``(avg, local)``. ``None`` (nothing
        written) for inputs this does not fuse.
        """
        if not (self._fuses(x) and e.dtype == acc.dtype == np.float32 and x.flags.c_contiguous
                and e.flags.c_contiguous and acc.flags.c_contiguous):
            return None
        flat = acc.reshape(-1)
        k = k_from_density(self._sparsifier.name, self._sparsifier.density, flat.size)
        support, values = np.empty(k, np.int64), np.empty(k, np.float32)
        report: dict = {}
        real = add_topk(x.reshape(-1), e.reshape(-1), flat, k, support, values,
                        scratch=self.scratch.select, report=report)
        self._pass_finite_gate(report.get("finite"))
        if real is None or real < k:     # no usable sampled bound: the sparsifier's selection
            support, values = self.sparsify(flat, name, state.t)[0], None
        avg, mine, values_are_acc = self._exchange(flat, support, flat, name, comm, state, values)
        if values_are_acc:
            cancel_at(flat, mine.slots)
            return avg.reshape(acc.shape), None
        return avg.reshape(acc.shape), self._local(name, flat, mine)

    def _exchange(self, flat: np.ndarray, support: np.ndarray, sparse: np.ndarray, name: str,
                  comm: Any, state: TensorState, support_values: np.ndarray | None = None
                  ) -> tuple[np.ndarray, container.SparseTensor, bool]:
        """Encode, allgatherv, decode, sum: ``(avg, D(own container), its values are flat's)``."""
        n = flat.size
        enc, source = self._encode(flat, support, sparse, name, state.t, comm.rank,
                                   support_values)
        gathered, counts = comm.allgatherv(np.frombuffer(enc.data, dtype=np.uint8))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        own = self.own_part(enc, support, source)
        parts = [own if j == comm.rank and own is not None else
                 container.decode(gathered[bounds[j]:bounds[j + 1]], expected_shape=(n,))
                 for j in range(comm.size)]
        avg = merge_sum(n, [p.slots for p in parts], [p.values for p in parts], flat.dtype,
                        comm.size)
        mine = parts[comm.rank]
        state.container_bytes = len(enc.data)
        state.selected = mine.selected
        return avg, mine, own is not None and source is flat

    def _local(self, name: str, flat: np.ndarray, mine: container.SparseTensor) -> np.ndarray | None:
        """``local`` = D(own container) as a dense vector, in a buffer reused per tensor (O(slots)
        per step); ``None`` when the feedback scheme does not read it."""
        if not self.feedback.uses_local:
            return None
        scratch = self.scratch.local.setdefault(name, _LocalScratch())
        return scratch.fill_values(flat.size, flat.dtype, mine.slots, mine.values)

    # ------------------------------------------------------------- metadata
    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sparsifier": self.sparsifier, "index": self.index,
                               "value": self.value, "fp_values": self.fp_values}
        if self._sparsifier is not None:
            out["sparsifier_params"] = self._sparsifier.params()
        if self.index == "bloom":
            out.update(fpr=self.fpr, policy=self.policy)
        out.update({"polyfit": {"poly_degree": self.poly_degree, "fit_tol": self.fit_tol},
                    "dexp": {"fit_tol": self.fit_tol},
                    "qsgd": {"qsgd_levels": self.qsgd_levels, "qsgd_bucket": self.qsgd_bucket},
                    "deflate": {"deflate_level": self.deflate_level}, "raw": {}}[self.value])
        return {**out, **self.feedback.params()}

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self._sparsifier is not None:
            sd["sparsifier_state"] = self._sparsifier.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        if self._sparsifier is not None and "sparsifier_state" in sd:
            self._sparsifier.load_state_dict(sd["sparsifier_state"])
