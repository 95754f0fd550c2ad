"""``DistributedOptimizer``: Horovod's signature, our compressed allreduce underneath.

The returned object is an instance of a subclass of the wrapped optimizer's
class (as Horovod does), so ``isinstance(opt, torch.optim.SGD)`` still holds
and schedulers work. Each parameter gets a post-accumulate-grad hook: after
``backward_passes_per_step`` backward passes its gradient is handed to a
:class:`~horovod_compress.runtime.GradientExchange`, which launches fused
buckets while the backward pass goes on; ``step()`` (or ``synchronize()``)
waits, writes the averaged gradients into ``p.grad`` and steps.

Argument checks, op scaling (``op``, ``gradient_predivide_factor``), the
working-dtype rule, statistics (:attr:`stats`, :attr:`comm_seconds`,
:attr:`wait_seconds`), the warm-up switch and the compression-error probe
(:attr:`training_exchange`'s ``settings``) and the ``nonfinite="skip"``
bookkeeping are the framework-independent runtime's
(:class:`~horovod_compress.runtime.session.TrainingExchange`), shared with
the TensorFlow and Keras front-ends; this module converts tensors and wires
the hooks.

Compressor state (residuals, thresholds, subspaces, step counters) is part of
``state_dict()`` under the key ``"hvdc"`` and restored by ``load_state_dict``.
It is stored as tensors and plain Python types only (:func:`to_safe_state`),
so ``torch.load(path)`` with PyTorch's default ``weights_only=True`` reads the
checkpoint; every NumPy array comes back with its dtype, shape and bytes.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from ..compressors.base import Method
from ..mpi_collectives import timeline as _timeline
from ..runtime.buckets import DEFAULT_BUCKET_BYTES, TensorSpec
from ..runtime.delegate import delegated
from ..runtime.ops import Average
from ..runtime.scaling import Scaling, check_backward_passes, check_method, working_dtype
from ..runtime.session import TrainingExchange
from . import world
from .tensors import copy_into, to_array
from ..compressors.registry import create


_ARRAY_KEY = "__hvdc_ndarray__"


def _map_items(fn: Callable[[Any], Any], obj: Any) -> Any:
    """A dict, list or tuple of the same keys with ``fn`` of each value; any other ``obj`` as is."""
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fn(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(fn(v) for v in obj)
    return obj


def to_safe_state(obj: Any) -> Any:
    """``obj`` with every NumPy array or scalar replaced by a ``weights_only``-loadable dict.

    An array becomes ``{"__hvdc_ndarray__": dtype.str, "shape": [...],
    "scalar": bool, "data": <uint8 tensor of its bytes>}`` (exact for any
    dtype); dicts, lists and tuples are converted recursively, other values
    are kept. :func:`from_safe_state` inverts it.
    """
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.array(obj, copy=True, order="C")   # keeps 0-d scalars 0-d
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
        return {_ARRAY_KEY: arr.dtype.str, "shape": list(arr.shape),
                "scalar": isinstance(obj, np.generic), "data": torch.from_numpy(raw)}
    return _map_items(to_safe_state, obj)


def from_safe_state(obj: Any) -> Any:
    """Invert :func:`to_safe_state` (values that are not encoded arrays pass through)."""
    if isinstance(obj, dict):
        if _ARRAY_KEY in obj:
            dtype = np.dtype(obj[_ARRAY_KEY])
            data = obj["data"]
            raw = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data, np.uint8)
            arr = np.frombuffer(raw.tobytes(), dtype=dtype).reshape(obj["shape"]).copy()
            return arr[()] if obj.get("scalar") else arr
    return _map_items(from_safe_state, obj)


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, named_parameters: Any, compression: Method,
                 backward_passes_per_step: int = 1, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 overlap: bool = True, comm: Any = None) -> None:
        super(self.__class__, self).__init__(params)
        self._hvdc_method = check_method(compression)
        self.backward_passes_per_step = check_backward_passes(backward_passes_per_step)
        scaling = Scaling.from_args(op, gradient_predivide_factor)
        self._hvdc_comm = comm if comm is not None else world.communicator()

        all_params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
                raise ValueError("named_parameters must be (name, parameter) pairs, "
                                 "e.g. model.named_parameters()")
            names = {id(p): n for n, p in named}
            missing = [p for p in all_params if id(p) not in names]
            if missing:
                raise ValueError(f"{len(missing)} optimized parameter(s) are not in named_parameters")
            seen = [n for n, _ in named]
            if len(set(seen)) != len(seen):
                raise ValueError("named_parameters contains duplicate names")
        else:
            names = {id(p): f"param.{i}" for i, p in enumerate(all_params)}
        self._hvdc_params = all_params
        self._hvdc_names = names
        # Gradients become ready roughly in reverse registration order.
        specs = [TensorSpec(names[id(p)], tuple(p.shape), working_dtype(str(p.dtype)))
                 for p in reversed(all_params)]
        self._hvdc_session = TrainingExchange(compression, self._hvdc_comm, specs,
                                              scaling=scaling, bucket_bytes=bucket_bytes,
                                              overlap=overlap)
        self._hvdc_passes = {id(p): 0 for p in all_params}
        self._hvdc_synchronized = False
        self._hvdc_skip_sync = False
        self_ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:  # a weak reference: a dropped optimizer unhooks
            opt = self_ref()
            if opt is not None:
                opt._hvdc_hook(p)

        self._hvdc_hooks = [p.register_post_accumulate_grad_hook(hook) for p in all_params]
        self._hvdc_since: float | None = None    # end of the last step or zero_grad (timeline)

    # ------------------------------------------------------------- hooks
    def _hvdc_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        rec = _timeline.recorder
        if rec is not None and self._hvdc_since is not None:
            # the step's compute up to its first gradient: forward and the start of backward
            rec.add("forward + backward to first gradient", "step", self._hvdc_since,
                    time.perf_counter())
            self._hvdc_since = None
        self._hvdc_passes[key] += 1
        if self._hvdc_passes[key] < self.backward_passes_per_step:
            return
        if self._hvdc_passes[key] > self.backward_passes_per_step:
            raise RuntimeError(
                f"gradient of {self._hvdc_names[key]!r} computed more often than "
                f"backward_passes_per_step={self.backward_passes_per_step} before step(); "
                "raise backward_passes_per_step or call step() in between")
        grad = to_array(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        self._hvdc_session.submit(self._hvdc_names[key], grad)

    # ------------------------------------------------------- synchronize
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the averages into ``p.grad``.

        Under ``nonfinite="skip"`` a step in which any rank had a NaN/Inf
        gradient sets :attr:`step_skipped` (on every rank alike), and the
        following ``step()`` leaves the parameters and the wrapped
        optimizer's state as they are.
        """
        with _timeline.span("synchronize", "step"):
            averaged = self._hvdc_session.finish()
        for p in self._hvdc_params:
            avg = averaged[self._hvdc_names[id(p)]]
            if p.grad is None or p.grad.is_sparse:  # unused parameter: Horovod gives it the
                p.grad = torch.zeros_like(p)             # (zero-averaged) grad; sparse -> dense
            copy_into(p.grad, avg)
            self._hvdc_passes[id(p)] = 0
        self._hvdc_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (call ``synchronize()`` first)."""
        self._hvdc_skip_sync = True
        try:
            yield
        finally:
            self._hvdc_skip_sync = False

    def step(self, closure: Any = None) -> Any:
        if not self._hvdc_skip_sync:
            if self._hvdc_synchronized:
                raise RuntimeError("synchronize() was called before step(); wrap step() in "
                                   "optimizer.skip_synchronize()")
            self.synchronize()
        self._hvdc_synchronized = False
        if self._hvdc_session.step_skipped:
            return None
        with _timeline.span("optimizer update", "step"):
            out = super(self.__class__, self).step(closure)
        self._hvdc_since = time.perf_counter()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(n >= self.backward_passes_per_step for n in self._hvdc_passes.values()):
            raise RuntimeError("zero_grad() was called after backward() and before step() or "
                               "synchronize(): the gradients' allreduce is in flight")
        self._hvdc_since = time.perf_counter()
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication thread."""
        for h in self._hvdc_hooks:
            h.remove()
        self._hvdc_hooks = []
        self._hvdc_session.close()

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        sd = super(self.__class__, self).state_dict()
        sd["hvdc"] = to_safe_state(self._hvdc_method.state_dict())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        hv = sd.pop("hvdc", None)
        super(self.__class__, self).load_state_dict(sd)
        if hv is not None:
            self._hvdc_method.load_state_dict(from_safe_state(hv))

    # ------------------------------------------------------------ extras
    compression = delegated("_hvdc_method", "The compression method.")
    communicator = delegated("_hvdc_comm", "The communicator.")
    exchange = delegated("_hvdc_session.exchange",
                         "The compressed bucket exchange (its ``comm_seconds``/``wait_seconds`` alone).")
    training_exchange = delegated("_hvdc_session", "The runtime's exchange: ``settings.dense`` "
                                  "(warm-up), error probes, statistics.")
    stats = delegated("_hvdc_session.stats",
                      "Cumulative exchange statistics on this rank (as the TensorFlow reducer's).")
    comm_seconds = delegated("_hvdc_session.comm_seconds",
                             "Seconds spent inside the method's allreduce (warm-up exchange included).")
    wait_seconds = delegated("_hvdc_session.wait_seconds", "Seconds ``synchronize()`` waited for the "
                             "communication thread (warm-up included).")
    step_skipped = delegated("_hvdc_session.step_skipped", "Whether the last synchronized step was "
                             "dropped (``nonfinite='skip'``, NaN/Inf on some rank).")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Method | None = None,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                         comm: Any = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses averaged (compressed) gradients.

    The signature follows ``horovod.torch.DistributedOptimizer``; a Horovod
    script changes one import. ``compression`` defaults to
    ``Compression.none()`` (dense). ``bucket_bytes`` is the fusion cap for
    flat methods; ``overlap`` reduces buckets during the backward pass;
    ``comm`` defaults to the communicator of :func:`init`.
    """
    if compression is None:
        compression = create("none")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step, op, gradient_predivide_factor, bucket_bytes,
               overlap, comm)
