"""Each method's per-tensor state, and the scratch buffers a method reuses across calls.

``method.state[name]`` is a :class:`TensorState` (or the subclass the method
names in ``Method.state_class``): the step counter ``t``, the feedback
scheme's memory in ``feedback`` (:mod:`horovod_compress.feedback.state`) and
the method's own fields, each documented below with what it holds, its shape
and dtype, when it changes and the equation it implements (in the style of
PyTorch's ``PowerSGDState``). ``None`` means "not created yet".

Checkpoints (``Method.state_dict``) save each field that is set under its
key (the names earlier versions used as dict keys, so their checkpoints
load: :data:`STATE_FORMAT_VERSION`). A state also reads like a mapping of
those keys (``state["fb_residual"]``, ``"error_q" in state``, ``dict(state)``)
for inspection; methods use the attributes.

Per-call work buffers that are never checkpointed live in the method's
:class:`MethodScratch` (``method.scratch``), one explicit field per kind.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Iterator

from ..feedback.state import FeedbackState

#: The version of ``Method.state_dict()``'s format. 1: no ``format_version`` key (saved before
#: the state classes); 2: ``format_version`` recorded. Both hold the same per-tensor keys, so a
#: version-1 checkpoint loads as it is.
STATE_FORMAT_VERSION = 2


_FIELDS_OF: dict[type, tuple[tuple[str, str], ...]] = {}
_COUNTERS_OF: dict[type, frozenset[str]] = {}


class TensorState(Mapping):
    """A tensor's state under any method: the step counter and the feedback memory."""

    __slots__ = ("t", "feedback")
    #: (checkpoint key, attribute) of the fields this class adds; subclasses extend
    FIELDS: ClassVar[tuple[tuple[str, str], ...]] = (("t", "t"),)
    #: attributes that count events: 0 when absent from a checkpoint, saved when not 0
    COUNTERS: ClassVar[tuple[str, ...]] = ()

    #: Steps taken on this tensor (dense warm-up steps included), 1 during the first call. Keys
    #: the shared randomness (``Method.rng(name, t)``); a step rejected before any payload
    #: (NaN/Inf, a mismatch) is taken back.
    t: int
    #: The feedback scheme's memory of this tensor (a :class:`FeedbackState` subclass).
    feedback: FeedbackState

    def __init__(self, feedback: FeedbackState | None = None, **fields: Any) -> None:
        counters = self._counters()
        for _key, attr in self._fields():
            setattr(self, attr, 0 if attr in counters or attr == "t" else None)
        self.feedback = feedback if feedback is not None else FeedbackState()
        for attr, value in fields.items():
            setattr(self, attr, value)

    # ------------------------------------------------------------ fields
    @classmethod
    def _fields(cls) -> tuple[tuple[str, str], ...]:
        """(key, attribute) of every field of this class, base classes first."""
        got = _FIELDS_OF.get(cls)
        if got is None:
            out: list[tuple[str, str]] = []
            for klass in reversed(cls.__mro__):
                out.extend(f for f in klass.__dict__.get("FIELDS", ()) if f not in out)
            got = _FIELDS_OF[cls] = tuple(out)
        return got

    @classmethod
    def _counters(cls) -> frozenset[str]:
        """The attributes of every ``COUNTERS`` of this class and its bases."""
        got = _COUNTERS_OF.get(cls)
        if got is None:
            got = _COUNTERS_OF[cls] = frozenset(
                c for klass in cls.__mro__ for c in klass.__dict__.get("COUNTERS", ()))
        return got

    def _saved(self) -> Iterator[tuple[Any, str, str, Any]]:
        """``(owner, key, attribute, value)`` of every set field (a counter: when not 0), the
        feedback's last."""
        counters = self._counters()
        for key, attr in self._fields():
            value = getattr(self, attr)
            if value is not None and not (attr in counters and value == 0):
                yield self, key, attr, value
        for key, attr, value in self.feedback.saved():
            yield self.feedback, key, attr, value

    def to_dict(self) -> dict[str, Any]:
        """``{checkpoint key: value}`` of every set field (the arrays themselves, not copies)."""
        return {key: value for _owner, key, _attr, value in self._saved()}

    def restore(self, saved: Mapping[str, Any], where: str = "") -> "TensorState":
        """Set the fields from a checkpoint's ``{key: value}`` (format 1 or 2); returns self.

        A key this state (with its feedback scheme) does not keep raises ``ValueError``
        naming it and the keys it does keep (a checkpoint of another method or feedback).
        """
        own = dict(self._fields())
        fb = dict(self.feedback.FIELDS)
        for key, value in saved.items():
            if key in own:
                setattr(self, own[key], value)
            elif key in fb:
                setattr(self.feedback, fb[key], value)
            else:
                raise ValueError(
                    f"{where}checkpoint field {key!r} is not kept by {type(self).__name__} with "
                    f"{type(self.feedback).__name__} (fields: {sorted(own) + sorted(fb)}); the "
                    f"checkpoint is of another method or feedback scheme")
        return self

    def present_fields(self) -> Iterator[tuple[Any, str, Any]]:
        """``(owner, attribute, value)`` of every set field, feedback's included (``owner`` is
        this state or its ``feedback``: ``setattr(owner, attribute, new)`` replaces it)."""
        for owner, _key, attr, value in self._saved():
            yield owner, attr, value

    # ------------------------------------------- read-only mapping view
    def __getitem__(self, key: str) -> Any:
        for _owner, k, _attr, value in self._saved():
            if k == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (key for _owner, key, _attr, _value in self._saved())

    def __len__(self) -> int:
        return sum(1 for _ in self._saved())

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={getattr(v, 'shape', v)!r}" for _o, k, _a, v in self._saved())
        return f"{type(self).__name__}({body})"


class ThresholdState(TensorState):
    """Gaussiank (Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning",
    2019; the Ok-Topk paper's Figure 4): the threshold a Gaussian fit predicts for density k/n."""

    __slots__ = ("threshold", "selected")
    FIELDS = (("threshold", "threshold"), ("selected", "selected"))

    #: The last step's threshold |x| > th (float), after the adjustment toward k selected.
    threshold: float | None
    #: How many entries the last step selected on this rank (int).
    selected: int | None


class FillInState(TensorState):
    """TopkDSA (Renggli et al., SparCML, SC 2019; the Ok-Topk paper's Table 1)."""

    __slots__ = ("fill_in",)
    FIELDS = (("fill_in", "fill_in"),)

    #: Non-zeros of the last step's sum of every rank's top-k (int, between k and kP):
    #: the fill-in that decides its sparse or dense second phase. Diagnostics.
    fill_in: int | None


class OkTopkState(TensorState):
    """Ok-Topk ("Near-Optimal Sparse Allreduce for Distributed Deep Learning", Li and Hoefler,
    PPoPP 2022, Algorithm 1): thresholds re-estimated every ``tau'`` steps, region boundaries
    every ``tau`` steps, reused in between."""

    __slots__ = ("local_th", "global_th", "boundaries", "next_boundaries", "next_boundaries_step",
                 "last_global", "local_count", "global_count", "local_count_reused",
                 "global_count_reused")
    FIELDS = (("local_th", "local_th"), ("boundaries", "boundaries"),
              ("global_th", "global_th"), ("local_count", "local_count"),
              ("global_count", "global_count"), ("local_count_reused", "local_count_reused"),
              ("global_count_reused", "global_count_reused"),
              ("next_boundaries", "next_boundaries"),
              ("next_boundaries_step", "next_boundaries_step"), ("last_global", "last_global"))

    #: The local threshold ``th`` (Algorithm 1, line 4): |acc| >= th selects about k entries of
    #: this rank; exact on the first step of a ``tau'`` period, scaled toward k in between (float).
    local_th: float | None
    #: The global threshold ``gth`` (line 10) on the reduced values: about k entries in total.
    global_th: float | None
    #: The P + 1 region boundaries of the split-and-reduce (line 6; int64, ascending, 0 ... n),
    #: re-balanced every ``tau`` steps.
    boundaries: Any
    #: Boundaries computed ahead for step ``next_boundaries_step`` (int64), overlapping that
    #: computation with the previous exchange; used only on that step.
    next_boundaries: Any
    #: The step the boundaries in ``next_boundaries`` are for (int).
    next_boundaries_step: int | None
    #: The last step's global top-k indices (int64, ascending, the same on every rank), which
    #: the next boundary proposal splits together with the local top-k (ours; in checkpoints, so
    #: a resumed run proposes the same boundaries).
    last_global: Any
    #: Entries the last step selected locally / globally (ints). Diagnostics.
    local_count: int | None
    global_count: int | None
    #: The same counts where the step reused a threshold (ints). Diagnostics.
    local_count_reused: int | None
    global_count_reused: int | None


class SelectedState(TensorState):
    """DeepReduce ("DeepReduce: A Sparse-tensor Communication Framework for Distributed Deep
    Learning", Kostopoulou et al., NeurIPS 2021, Section 3): the last container's size."""

    __slots__ = ("container_bytes", "selected")
    FIELDS = (("container_bytes", "container_bytes"), ("selected", "selected"))

    #: Bytes of this rank's last encoded container (index and value parts; int). Diagnostics.
    container_bytes: int | None
    #: Entries the last container carried (int). Diagnostics.
    selected: int | None


class QuantizedState(TensorState):
    """QSGD (Alistarh et al., NeurIPS 2017) and Global-QSGD (Xin et al., "Global-QSGD:
    Allreduce-Compatible Quantization for Distributed Learning with Theoretical Guarantees")."""

    __slots__ = ("dense_fallback_steps", "zero_norm_steps", "saturated")
    FIELDS = (("dense_fallback_steps", "dense_fallback_steps"),
              ("zero_norm_steps", "zero_norm_steps"), ("saturated", "saturated"))
    COUNTERS = ("dense_fallback_steps", "zero_norm_steps", "saturated")

    #: Steps sent dense because quantization could not represent the input (a norm that
    #: overflows the work dtype); each also warns.
    dense_fallback_steps: int
    #: Global-QSGD steps whose global norm was zero: only the norm was sent.
    zero_norm_steps: int
    #: Global-QSGD: entries whose summed level exceeded its integer lane and was held at the
    #: lane's bound, over all steps; 0 while the ``headroom`` bits hold (see
    #: ``compressors.global_qsgd``: the lanes and the reduction tree).
    saturated: int


class SubspaceState(TensorState):
    """A low-rank method's basis of a tensor's m x n matrix view."""

    __slots__ = ("Q", "svd_step")
    FIELDS = (("Q", "Q"), ("svd_step", "svd_step"))

    #: PowerSGD ("PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    #: Optimization", Vogels et al., NeurIPS 2019, Algorithm 1): the right factor ``Q``
    #: (n x r, work dtype), warm-started from the last step's (Section 3, "reuse of Q"); an empty
    #: 0 x 0 array marks a tensor sent dense. Lazy projection: the left basis (m x r, the top r
    #: left singular vectors of the averaged gradient), recomputed every ``period`` steps.
    Q: Any
    #: Lazy projection: the step ``t`` of the last SVD (int).
    svd_step: int | None


class GreedyLoreState(TensorState):
    """GreedyLore ("Greedy Low-Rank Gradient Compression for Distributed Learning with
    Convergence Guarantees", Algorithm 3): a shared basis ``U``, greedy columns, error ``e_i``."""

    __slots__ = ("U", "error", "error_q", "error_c", "columns", "svd_step")
    FIELDS = (("U", "U"), ("error", "error"), ("columns", "columns"), ("svd_step", "svd_step"),
              ("error_q", "error_q"), ("error_c", "error_c"))

    #: The m x m left singular vectors of the averaged gradient at the last SVD step
    #: (``period`` steps apart; work dtype).
    U: Any
    #: ``e_i`` (eq. 9b), m x n in the working orientation (column-major for a tall tensor),
    #: zeroed at each SVD step. After a fused step it holds ``A_i`` and the error is
    #: ``A_i - Q C_i`` with the two fields below (see ``greedylore.current_error``).
    error: Any
    #: A pending error's ``Q`` (m x r, the chosen columns of ``U``) and ``C_i = Q^T A_i``
    #: (r x n; eq. 10), applied by the next step's first pass; ``None`` when none is pending.
    error_q: Any
    error_c: Any
    #: The indices of the columns of ``U`` chosen at the last step (int64, greedy by the
    #: averaged probe scores; empty after an SVD step).
    columns: Any
    #: The step ``t`` of the last SVD (int).
    svd_step: int | None


class RowState(TensorState):
    """ARC-Top-K ("An All-Reduce Compatible Top-K Compressor for Communication-Efficient
    Distributed Learning", Algorithm 1): the rows the last step sent."""

    __slots__ = ("rows",)
    FIELDS = (("rows", "rows"),)

    #: The K row indices chosen from the averaged sketch at the last step (int32, the same on
    #: every rank); ``None`` after a step sent dense. Diagnostics.
    rows: Any


class MethodScratch:
    """Work buffers a method reuses across calls instead of allocating (and page-faulting) each
    step. Per tensor name where keyed by name; never checkpointed; a dry run's copy of a
    method starts with empty ones."""

    __slots__ = ("call", "local", "select", "oktopk", "rows", "spare_error", "spare_h",
                 "qsgd_local")

    #: name -> the ring's work arrays of one call (``Method._scratch_buffers``).
    call: dict
    #: name -> the dense ``local`` contribution of a sparsifier, with its support
    #: (``sparse_common.SparseScratch``, DeepReduce's local buffer).
    local: dict
    #: The top-k selection kernel's buffers (``kernels.selection``), shared by a method's tensors.
    select: dict
    #: name -> Ok-Topk's exchange buffers (``mpi_collectives.oktopk``).
    oktopk: dict
    #: name -> a row method's local buffers (``kernels.scatter.RowScratch``).
    rows: dict
    #: name -> GreedyLore's second error buffer (the next step's ``A_i``).
    spare_error: dict
    #: name -> ARC-Top-K's second EF21M ``h`` buffer (the next step's (11a) output).
    spare_h: dict
    #: name -> Global-QSGD's local-contribution buffers.
    qsgd_local: dict

    def __init__(self) -> None:
        for attr in self.__slots__:
            setattr(self, attr, {})


__all__ = ["FillInState", "GreedyLoreState", "MethodScratch", "OkTopkState", "QuantizedState",
           "RowState", "STATE_FORMAT_VERSION", "SelectedState", "SubspaceState", "TensorState",
           "ThresholdState"]
