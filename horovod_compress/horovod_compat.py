"""Every method inside Horovod's own optimizers: the ``Compressor`` protocol on torch/TF tensors.

Horovod's ``hvd.DistributedOptimizer`` (PyTorch), ``hvd.DistributedGradientTape``
(TensorFlow) and ``hvd.allreduce(..., compression=...)`` call
``compression.compress(tensor) -> (tensor', ctx)``, reduce ``tensor'`` with
their own allreduce (``op`` Average/Sum/Adasum, ``prescale_factor``,
``postscale_factor``, ``process_set``) and call
``compression.decompress(reduced, ctx)``. Every :class:`~horovod_compress.Method`
has these two calls (``Method.compress``/``decompress`` delegate here).

Two ways through:

* **Native** (``none``, ``fp16``): Horovod's allreduce *is* the method -- a
  cast before and after, exactly Horovod's own ``Compression.fp16``. Every
  ``op`` and option is Horovod's business.
* **Exchange** (every other method, ``bf16`` included: Horovod 0.28 has no
  bfloat16 allreduce on either framework): ``compress`` runs the method's own
  compressed allreduce through the front-ends' shared
  :class:`~horovod_compress.mpi_collectives.Communicator` (mpi4py, the same
  MPI world as Horovod) and hands Horovod a 2-element float64 *placeholder*
  ``[1, rank == 0]``; ``decompress`` returns the method's average times the
  factor Horovod applied to the placeholder. For every linear reduction
  Horovod reduces ``x_i`` to ``c * sum_i x_i`` (``c = 1/P`` for Average,
  1 for Sum, times ``prescale_factor * postscale_factor``; the
  ``gradient_predivide_factor`` split cancels), so the placeholder comes back
  as ``[c P, c]``: the method's average times ``c P`` is exactly what Horovod
  would have returned for a dense reduction. A non-linear reduction (Adasum,
  Min, Max, Product) breaks ``out[0] == P out[1]`` and ``decompress`` raises
  on every rank; Horovod's Adasum optimizer and ``reducescatter`` are refused
  in ``compress`` already, before anything is sent.

Tensor names: Horovod passes none to ``compress``. The adapter reads them
from its caller, Horovod 0.28's own frames: the parameter's name in the
PyTorch optimizer (``named_parameters``), the variable's position and name in
``DistributedGradientTape``, the ``name=`` of ``hvd.allreduce``. Per-tensor
method state (residuals, thresholds, subspaces) is keyed by those names, so it
is the same state the method keeps in our own front-ends. In TensorFlow,
Horovod's tape always reduces inside a ``tf.function`` (its own, eagerly), so
AutoGraph runs converted copies of Horovod's functions: code in temporary
files named ``tf__allreduce``, ``tf__allreduce_grads`` ..., executing in the
``horovod.tensorflow`` module's globals with Horovod's parameter names. A
frame is Horovod's when ``f_globals["__name__"]`` is ``horovod.tensorflow``,
and the function is its name less the ``tf__`` prefix (plain frames, eager
``hvd.allreduce``, match the same way). :func:`compress`/:func:`decompress`
are marked so AutoGraph does not convert them (their branches are trace-time
decisions), and :class:`HorovodAdapterError` passes through AutoGraph's error
rewriting unchanged (otherwise it would surface as a ``StagingError``).
``compress()`` called outside Horovod's allreduce/optimizer/tape, where
neither the tensor nor the reduction can be identified, raises
:class:`HorovodAdapterError`.

In the PyTorch optimizer the gradients go to a
:class:`~horovod_compress.runtime.GradientExchange` built over the optimizer's
parameters -- the same fused buckets, launch order and bucket names as
``horovod_compress.torch.DistributedOptimizer`` -- so Horovod's optimizer with
a method gives bit for bit the gradients our own optimizer gives with it.
Launching follows the bucket plan, not the hook order, so ranks whose hooks
fire in different orders still issue the same collectives. In TensorFlow
each gradient is reduced on its own inside the traced step (a
``tf.numpy_function`` per tensor, program order).

``process_set`` is honoured: the exchange runs on an MPI sub-communicator of
the set's ranks. Anything the adapter cannot place (an unknown caller, a
stateful method in an unnamed ``hvd.allreduce``) raises ``ValueError`` naming
what to do instead.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import numpy as np

from .compressors.horovod_protocol import register_horovod_protocol
from .horovod_api.method_limits import HorovodAdapterError, is_stateless  # noqa: F401 - re-exported
from .kernels.arrays import to_host
from .runtime.buckets import DEFAULT_BUCKET_BYTES, TensorSpec
from .runtime.engine import GradientExchange

_LINEARITY_RTOL = 1e-6


# ----------------------------------------------------------------------------- helpers
def _is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.split(".")[0] == "torch"


def _frames(limit: int = 12):
    f = sys._getframe(2)
    for _ in range(limit):
        if f is None:
            return
        yield f
        f = f.f_back


def _in_horovod(frame: Any, *parts: str) -> bool:
    fn = frame.f_code.co_filename.replace("\\", "/")
    return "/horovod/" in fn and fn.endswith("/".join(parts))


# ------------------------------------------------------------------- process sets / comm
_SUBCOMMS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def _world_comm(framework: str) -> Any:
    if framework == "torch":
        from .torch import world
    else:
        from .tensorflow import world
    return world.communicator()


def communicator_for(framework: str, process_set: Any) -> Any:
    """Our Communicator for Horovod's ``process_set`` (the world's, or one over the set's ranks).

    A sub-communicator is created (``MPI_Comm_create_group``, collective over
    the set's ranks only) the first time a set is used and kept.
    """
    comm = _world_comm(framework)
    ranks = getattr(process_set, "ranks", None)
    ps_id = getattr(process_set, "process_set_id", 0)
    if ranks is None or ps_id == 0 or sorted(ranks) == list(range(comm.size)):
        return comm
    key = tuple(sorted(int(r) for r in ranks))
    if comm.rank not in key:
        raise HorovodAdapterError(f"rank {comm.rank} is not in process set {list(key)} but was "
                                  "asked to reduce over it")
    with _LOCK:
        sub = _SUBCOMMS.get(key)
    if sub is None:
        from .mpi_collectives import Communicator
        raw = comm.comm
        group = raw.Get_group().Incl(list(key))
        sub = Communicator(raw.Create_group(group, tag=7316))
        with _LOCK:
            _SUBCOMMS[key] = sub
    return sub


def _check_world(framework: str, comm: Any) -> None:
    """Horovod and our front-ends must see the same world (horovodrun/mpirun start both)."""
    try:
        hvd = sys.modules["horovod.torch" if framework == "torch" else "horovod.tensorflow"]
        hsize = hvd.size()
    except Exception:  # noqa: BLE001 - Horovod not initialised: nothing to compare
        return
    world = _world_comm(framework)
    if hsize != world.size:
        raise HorovodAdapterError(
            f"Horovod runs {hsize} processes but horovod_compress's communicator has "
            f"{world.size}; initialise both on the same MPI world (horovodrun/mpirun, "
            "hvd.init() and horovod_compress.torch.init()/horovod_compress.tensorflow.init())")


# --------------------------------------------------------------------------- call sites
class _Site:
    """What Horovod is doing when it calls ``compress``: where, with which names and options."""

    def __init__(self, kind: str, name: str | None = None, process_set: Any = None,
                 optimizer: Any = None, param: Any = None) -> None:
        self.kind = kind            # "torch_optimizer", "allreduce", "tape"
        self.name = name
        self.process_set = process_set
        self.optimizer = optimizer
        self.param = param


_REFUSED_CALLERS = {
    "reducescatter": "hvd.reducescatter/grouped_reducescatter with a compression method "
                     "(the methods produce an average of the whole tensor, not its shards); "
                     "use compression=Compression.none there",
    "grouped_reducescatter": "hvd.reducescatter/grouped_reducescatter with a compression method "
                             "(the methods produce an average of the whole tensor, not its "
                             "shards); use compression=Compression.none there",
}


def _torch_site(method: Any, tensor: Any) -> _Site:
    frames = list(_frames(40))
    for i, f in enumerate(frames):
        loc = f.f_locals
        me = loc.get("self")
        if me is not None and hasattr(me, "_starting_models") and hasattr(me, "_parameter_names"):
            raise HorovodAdapterError(
                f"{method.name}: Horovod's Adasum optimizer (op=hvd.Adasum) combines each rank's "
                "model delta with the Adasum rule, which a compressed average cannot replace; "
                "use op=hvd.Average or op=hvd.Sum with this method, or compression="
                "hvd.Compression.none/fp16/bf16 with Adasum")
        if me is not None and hasattr(me, "_parameter_names") and hasattr(me, "_requires_update"):
            param = None
            for g in frames[:i + 1]:
                p = g.f_locals.get("p")
                if p is not None and hasattr(p, "grad") and (p.grad is tensor or
                                                             tuple(p.shape) == tuple(tensor.shape)):
                    param = p
                    break
            if param is None or param not in me._parameter_names:
                break
            return _Site("torch_optimizer", name=me._parameter_names[param],
                         process_set=getattr(me, "process_set", None), optimizer=me, param=param)
        if _in_horovod(f, "torch", "mpi_ops.py"):
            if f.f_code.co_name in _REFUSED_CALLERS:
                raise HorovodAdapterError(f"{method.name}: {_REFUSED_CALLERS[f.f_code.co_name]}")
            if f.f_code.co_name in ("allreduce", "grouped_allreduce"):
                name = loc.get("name")
                if f.f_code.co_name == "grouped_allreduce" and name is not None:
                    idx = next((j for j, t in enumerate(loc.get("tensors", ())) if t is tensor), None)
                    name = f"{name}.{idx}" if idx is not None else None
                return _Site("allreduce", name=name, process_set=loc.get("process_set"))
    raise HorovodAdapterError(
        f"{method.name}.compress() was called from outside Horovod's DistributedOptimizer and "
        "hvd.allreduce/grouped_allreduce (horovod.torch 0.28), so the tensor and the reduction "
        "cannot be identified; call method.allreduce(array, name, comm) directly, or use "
        "horovod_compress.torch.DistributedOptimizer")


_HVD_TF = "horovod.tensorflow"
_AUTOGRAPH_PREFIX = "tf__"


def _horovod_tf_function(frame: Any) -> str | None:
    """The ``horovod.tensorflow`` function running in ``frame``, plain or autograph-converted.

    Inside ``tf.function`` (and in the eager tape, which Horovod wraps in one)
    AutoGraph runs converted copies of Horovod's functions: the code lives in
    a temporary file and is named ``tf__<name>``, but it runs in the original
    module's globals. So the module is recognised by ``f_globals['__name__']``
    and the function by its name without the ``tf__`` prefix; AutoGraph keeps
    parameter and local names. Closures AutoGraph adds (``if_body``,
    ``else_body_3``, ``<listcomp>``) and Horovod's own (``allreduce_fn``) have
    other names and are passed over.
    """
    if frame.f_globals.get("__name__") != _HVD_TF:
        return None
    name = frame.f_code.co_name
    return name[len(_AUTOGRAPH_PREFIX):] if name.startswith(_AUTOGRAPH_PREFIX) else name


def _tf_site(method: Any, tensor: Any) -> _Site:
    site = None
    for f in _frames(200):
        code = _horovod_tf_function(f)
        if code is None:
            continue
        loc = f.f_locals
        if code in _REFUSED_CALLERS:
            raise HorovodAdapterError(f"{method.name}: {_REFUSED_CALLERS[code]}")
        if code in ("allreduce", "grouped_allreduce") and site is None:
            adasum = f.f_globals.get("Adasum", 2)
            try:
                op = int(loc.get("op", 0) or 0)
            except (TypeError, ValueError):   # not a plain op (an AutoGraph placeholder)
                op = None
            if op == adasum:
                raise HorovodAdapterError(
                    f"{method.name}: op=hvd.Adasum combines the ranks' tensors non-linearly, which "
                    "a compressed average cannot replace; use op=hvd.Average or op=hvd.Sum with "
                    "this method, or compression=hvd.Compression.none/fp16 with Adasum")
            name = loc.get("name")
            if code == "grouped_allreduce" and name is not None:
                idx = next((j for j, t in enumerate(loc.get("tensor_list", ())) if t is tensor), None)
                name = f"{name}.{idx}" if idx is not None else None
            site = _Site("allreduce", name=name if isinstance(name, str) else None,
                         process_set=loc.get("process_set"))
        elif code == "allreduce_grads" and site is not None:
            grads, variables = loc.get("grads"), loc.get("vars")
            if isinstance(grads, (list, tuple)) and isinstance(variables, (list, tuple)):
                j = next((k for k, g in enumerate(grads) if g is tensor), None)
                if j is not None and j < len(variables):
                    from .tensorflow.tensors import variable_name
                    site.kind = "tape"
                    site.name = f"tape/{j}/{variable_name(variables[j], j)}"
            break
    if site is None:
        raise HorovodAdapterError(
            f"{method.name}.compress() was called from outside horovod.tensorflow's allreduce/"
            "grouped_allreduce/DistributedGradientTape (Horovod 0.28), so the tensor and the "
            "reduction cannot be identified; pass the method to hvd.allreduce(..., name=...) or "
            "hvd.DistributedGradientTape, call method.allreduce(array, name, comm) directly, or "
            "use horovod_compress.tensorflow.DistributedGradientTape")
    return site


def _state_key(method: Any, site: _Site, shape: tuple) -> str:
    if site.name is not None:
        return str(site.name)
    if is_stateless(method):
        return f"horovod.allreduce.noname{tuple(shape)}"
    raise HorovodAdapterError(
        f"{method.name} keeps per-tensor state (residuals, thresholds or subspaces): pass "
        "name=... to hvd.allreduce so every tensor keeps its own state")


# ------------------------------------------------------------------ torch optimizer path
class _TorchOptimizerExchange:
    """One GradientExchange over a Horovod torch optimizer's parameters (our optimizer's plan)."""

    def __init__(self, method: Any, comm: Any, optimizer: Any) -> None:
        from .torch.tensors import numpy_dtype_name
        names = optimizer._parameter_names
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        specs = [TensorSpec(names[p], tuple(p.shape), numpy_dtype_name(p)) for p in reversed(params)]
        bucket_bytes = getattr(method, "_hvdc_bucket_bytes", DEFAULT_BUCKET_BYTES)
        self.exchange = GradientExchange(method, comm, specs, bucket_bytes=bucket_bytes,
                                         overlap=True)
        self.step = 0
        self.results: dict[str, Any] | None = None
        self.submitted: set[str] = set()

    def submit(self, name: str, array: Any) -> int:
        if self.results is not None:          # the previous step was collected: a new one
            self.results = None
            self.submitted.clear()
            self.step += 1
        if name in self.submitted:
            raise RuntimeError(f"Horovod compressed {name!r} twice in one step")
        self.submitted.add(name)
        self.exchange.submit(name, array)
        return self.step

    def result(self, name: str, step: int) -> Any:
        if step != self.step:
            raise RuntimeError(f"decompress() of {name!r} for step {step} after step {self.step} "
                               "began")
        if self.results is None:
            self.results = self.exchange.finish(fill_missing=True)
        return self.results[name]


_EXCHANGES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _torch_exchange(method: Any, comm: Any, optimizer: Any) -> _TorchOptimizerExchange:
    per_opt = _EXCHANGES.setdefault(optimizer, {})
    ex = per_opt.get(id(method))
    if ex is None or ex[0]() is not method:
        ex = (weakref.ref(method), _TorchOptimizerExchange(method, comm, optimizer))
        per_opt[id(method)] = ex
    return ex[1]


# -------------------------------------------------------------------------- protocol
class _Ctx:
    __slots__ = ("kind", "payload", "dtype", "shape", "device", "world")

    def __init__(self, kind: str, payload: Any, dtype: Any, shape: Any, device: Any,
                 world: int) -> None:
        self.kind, self.payload, self.dtype = kind, payload, dtype
        self.shape, self.device, self.world = shape, device, world


def _placeholder_values(rank: int) -> np.ndarray:
    return np.array([1.0, 1.0 if rank == 0 else 0.0], dtype=np.float64)


def compress(method: Any, tensor: Any) -> tuple[Any, Any]:
    """``Compressor.compress`` for ``method`` (see the module docstring)."""
    if method.name == "none":
        return tensor, None
    if method.name == "fp16":
        return compress_cast(tensor, method.name)
    # bf16 included: Horovod 0.28 has no bfloat16 allreduce, so bf16 runs our exchange.
    if _is_torch(tensor):
        return _compress_torch(method, tensor)
    return _compress_tf(method, tensor)


def decompress(method: Any, tensor: Any, ctx: Any) -> Any:
    """``Compressor.decompress`` for ``method``."""
    if not isinstance(ctx, _Ctx):
        return decompress_cast(tensor, ctx)     # native: none, fp16, bf16 on torch
    if _is_torch(tensor):
        return _decompress_torch(method, tensor, ctx)
    return _decompress_tf(method, tensor, ctx)


# Inside tf.function AutoGraph converts what it calls; these two (and all they
# call) run as plain Python instead: their Python branches are decisions made
# while tracing, and their errors must come out unchanged. The attribute is
# what ``tf.autograph.experimental.do_not_convert`` sets, without importing
# TensorFlow here.
compress.autograph_info__ = None      # type: ignore[attr-defined]
decompress.autograph_info__ = None    # type: ignore[attr-defined]
register_horovod_protocol(compress, decompress)   # Method.compress/decompress delegate here


def _nonlinear_error(method: Any, out: Any, world: int) -> HorovodAdapterError:
    return HorovodAdapterError(
        f"{method.name}: Horovod reduced the placeholder to {list(map(float, out))} on {world} "
        "ranks, which no linear reduction (Average/Sum with pre-/postscale factors) gives: it "
        "used a non-linear op (Adasum, Min, Max or Product). Compressed methods produce an "
        "average; use op=hvd.Average or op=hvd.Sum")


def _compress_torch(method: Any, tensor: Any) -> tuple[Any, Any]:
    import torch

    from .torch.tensors import to_array
    site = _torch_site(method, tensor)
    _check_world("torch", None)
    comm = communicator_for("torch", site.process_set)
    dense = tensor.to_dense() if tensor.is_sparse else tensor
    if site.kind == "torch_optimizer":
        ex = _torch_exchange(method, comm, site.optimizer)
        step = ex.submit(site.name, to_array(dense.detach()))
        ctx = _Ctx("exchange", (ex, site.name, step), dense.dtype, tuple(dense.shape),
                   dense.device, comm.size)
    else:
        key = _state_key(method, site, tuple(dense.shape))
        avg = method.allreduce(to_array(dense.detach()), key, comm)
        ctx = _Ctx("direct", avg, dense.dtype, tuple(dense.shape), dense.device, comm.size)
    placeholder = torch.from_numpy(_placeholder_values(comm.rank)).to(dense.device)
    return placeholder, ctx


def _decompress_torch(method: Any, tensor: Any, ctx: _Ctx) -> Any:
    import torch

    out = tensor.detach().to("cpu", torch.float64).numpy()
    if not np.isclose(out[0], ctx.world * out[1], rtol=_LINEARITY_RTOL, atol=0.0):
        raise _nonlinear_error(method, out, ctx.world)
    if ctx.kind == "exchange":
        ex, name, step = ctx.payload
        avg = ex.result(name, step)
    else:
        avg = ctx.payload
    scale = float(out[0])
    if type(avg).__module__.split(".")[0] == "cupy":
        res = torch.from_dlpack((avg * avg.dtype.type(scale)) if scale != 1.0 else avg.copy())
    else:
        arr = np.asarray(to_host(avg))
        arr = arr * arr.dtype.type(scale) if scale != 1.0 else np.array(arr, copy=True)
        res = torch.from_numpy(np.ascontiguousarray(arr))
    return res.reshape(ctx.shape).to(device=ctx.device, dtype=ctx.dtype)


def _compress_tf(method: Any, tensor: Any) -> tuple[Any, Any]:
    import tensorflow as tf

    from .tensorflow.bridge import numpy_call
    from .tensorflow.tensors import check_float_dtype, to_wire, wire_dtype
    site = _tf_site(method, tensor)
    _check_world("tensorflow", None)
    comm = communicator_for("tensorflow", site.process_set)
    value = to_wire(tensor)
    shape = tuple(int(d) for d in value.shape)
    dtype = check_float_dtype(tensor.dtype, site.name or "tensor")
    key = _state_key(method, site, shape)

    def run(x: np.ndarray) -> list[np.ndarray]:
        return [np.ascontiguousarray(method.allreduce(x, key, comm), dtype=x.dtype)]

    (avg,) = numpy_call(run, [value], [wire_dtype(dtype)], [shape], name="hvdc_horovod_exchange",
                        in_shapes=[shape])
    with tf.control_dependencies([avg]):
        placeholder = tf.identity(tf.constant(_placeholder_values(comm.rank)))
    return placeholder, _Ctx("direct", avg, dtype, shape, None, comm.size)


def _decompress_tf(method: Any, tensor: Any, ctx: _Ctx) -> Any:
    import tensorflow as tf
    out = tf.cast(tensor, tf.float64)
    p = float(ctx.world)
    linear = tf.less_equal(tf.abs(out[0] - p * out[1]), _LINEARITY_RTOL * tf.abs(out[0]))
    message = (f"{method.name}: Horovod reduced the placeholder non-linearly (Adasum, Min, Max "
               "or Product); compressed methods produce an average: use op=hvd.Average or "
               "op=hvd.Sum. Placeholder after the reduction:")
    if tf.executing_eagerly():
        if not bool(linear):
            raise _nonlinear_error(method, out.numpy(), ctx.world)
        checks = []
    else:
        checks = [tf.debugging.Assert(linear, [message, out])]
    with tf.control_dependencies(checks):
        avg = ctx.payload
        res = avg * tf.cast(out[0], avg.dtype)
    return tf.cast(res, ctx.dtype) if res.dtype != ctx.dtype else res


# ---------------------------------------------------------------- native casts (fp16/bf16)
def compress_cast(tensor: Any, kind: str) -> tuple[Any, Any]:
    """Cast a floating tensor to fp16/bf16; ctx is the original dtype."""
    if _is_torch(tensor):
        import torch
        target = torch.float16 if kind == "fp16" else torch.bfloat16
        if tensor.dtype.is_floating_point and tensor.dtype != target:
            return tensor.to(target), tensor.dtype
        return tensor, None
    import tensorflow as tf
    target = tf.float16 if kind == "fp16" else tf.bfloat16
    if tensor.dtype.is_floating and tensor.dtype != target:
        return tf.cast(tensor, target), tensor.dtype
    return tensor, None


def decompress_cast(tensor: Any, ctx: Any) -> Any:
    """Undo :func:`compress_cast` (``ctx`` is the original dtype, or None)."""
    if ctx is None:
        return tensor
    if _is_torch(tensor):
        return tensor.to(ctx)
    import tensorflow as tf
    return tf.cast(tensor, ctx)
