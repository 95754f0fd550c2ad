"""Long runs hold nothing per step: every method through every per-step entry point.

A job that trains for days must not grow with the step count. Each entry point
with a per-step path -- ``Method.allreduce``, our PyTorch ``DistributedOptimizer``,
the TensorFlow ``DistributedGradientTape`` (in ``tf.function``), the Keras
``DistributedOptimizer`` (its compiled training step), Horovod's PyTorch
``DistributedOptimizer`` with our methods, and the DDP comm hook (``torchrun``)
-- builds every method side by side and steps them in turn, for a warm-up and
then twice :data:`STEPS` rounds; the process is measured at the three points:
MPI communicators created (every ``Dup``/``Split``/``Create``/... of a
counting ``MPI.Intracomm`` subclass the world communicator is built on;
``torch.distributed.new_group`` calls for the DDP hook), pending requests,
threads, greenlets, open file descriptors, resident memory, and the number of
live Python objects of each type. Nothing may be created after the warm-up,
and none of the counts may rise; a leak of one object per step of any method
shows as a type that grew by ``2 * STEPS`` or more (the threshold is
``STEPS``), and the type names the culprit. Resident memory is bounded
grossly here (:data:`RSS_SLACK_KB`: the allocators themselves settle only
after about a thousand steps, with or without our code -- measured on plain
DDP); one long run per world size (the issue's 2-layer model and GreedyLore,
:data:`LONG_STEPS` steps after a warm-up) bounds its slope.

Before the fix (one check communicator per real MPI communicator, cached on
it: ``mpi_collectives/check_group.py``) this test failed: the lockstep
runner's per-tensor proxies were the keys of a weak-keyed check-communicator
cache whose values referenced the keys, so every lockstep method (GreedyLore,
ARC-Top-K, lazy projection, the row methods) kept its proxies, their stand-in
check communicators and their rounds: ``case_torch_optimizer`` at P = 2
reported ``lockstep._Proxy``, ``lockstep._CheckProxy`` and
``weakref.ReferenceType`` objects growing by 4.00 per step (one per tensor of
the 4-tensor model) and ``lockstep._Round`` by 1.00 per step.

This file is also the script the ``torchrun`` ranks run (``python
tests/test_long_run.py ranks_ddp_hook OUT``).
"""
from __future__ import annotations

import collections
import gc
import json
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every registered method (``Compression.available()``, read on the ranks), each compressing
# the small 2-layer model from the first steps: a density of 0.05 where it has one,
# and these parameters where a method needs its own.
OWN_PARAMS = {
    "oktopk": {"density": 0.05, "warmup_steps": 1, "tau": 2, "tau_prime": 1},
    "deepreduce": {"sparsifier_params": {"density": 0.05}},
    "arc_topk": {"rank": 2},
    "powersgd": {"rank": 4},
    "greedylore": {"rank": 4, "period": 2},
    "lazy_projection": {"rank": 4, "period": 2},
}
WARMUP = 6          # rounds before the first measurement (lazy state, periodic refreshes, caches)
STEPS = 16          # rounds between measurements: a leak of one object per step grows 2 * STEPS
RSS_SLACK_KB = 16384  # gross growth bound of the short runs (the allocators warm up for ~1,000 steps)
LONG_STEPS = 1500   # the long run's steps after its warm-up; its slope must stay under:
LONG_KB_PER_STEP = 0.25


def method_names() -> list[str]:
    import horovod_compress as hvdc
    return hvdc.Compression.available()


def make(name: str) -> Any:
    import horovod_compress as hvdc
    params = OWN_PARAMS.get(name)
    if params is None:
        params = {"density": 0.05} if "density" in hvdc.Compression.by_name(name).config() else {}
    return hvdc.Compression.by_name(name, **params)


# ------------------------------------------------------------------ measuring a rank
class CountingComms:
    """Counts every communicator created from (and freed on) communicators of :meth:`wrap`.

    ``wrap(MPI.COMM_WORLD)`` is an ``MPI.Intracomm`` subclass sharing the world's
    handle; every communicator derived from it is returned as that subclass too,
    so the count follows every generation.
    """

    CREATORS = ("Dup", "Dup_with_info", "Idup", "Idup_with_info", "Split", "Split_type",
                "Create", "Create_group", "Create_cart", "Create_graph", "Create_dist_graph",
                "Create_dist_graph_adjacent", "Create_intercomm", "Clone")

    def __init__(self) -> None:
        from mpi4py import MPI
        self.created = collections.Counter()
        self.freed = 0
        counts = self

        def creator(name: str) -> Callable[..., Any]:
            base = getattr(MPI.Intracomm, name)

            def make_comm(comm: Any, *args: Any, **kwargs: Any) -> Any:
                counts.created[name] += 1
                made = base(comm, *args, **kwargs)
                if isinstance(made, MPI.Intracomm) and not isinstance(made, counts.cls):
                    made = counts.cls(made)       # Split & co. return the base class: count theirs too
                return made
            return make_comm

        def free(comm: Any) -> None:
            counts.freed += 1
            MPI.Intracomm.Free(comm)

        attrs = {n: creator(n) for n in self.CREATORS if hasattr(MPI.Intracomm, n)}
        attrs["Free"] = free
        self.cls = type("CountingIntracomm", (MPI.Intracomm,), attrs)

    def wrap(self, comm: Any) -> Any:
        return self.cls(comm)

    def total(self) -> int:
        return sum(self.created.values())


def _rss_kb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024.0


def _type_key(obj: Any) -> str:
    t = type(obj)
    key = f"{t.__module__}.{t.__qualname__}"
    if t.__name__ == "builtin_function_or_method":    # which object's methods they are
        owner = type(getattr(obj, "__self__", None))
        key += f" of {owner.__module__}.{owner.__qualname__}"
    return key


def _is_jit_artifact(obj: Any) -> bool:
    """An object Numba makes when it compiles or loads a kernel's specialization: a weakref to
    one of its types (with its ``_destroy`` callback), a compiled closure's bound function.

    A code path taken for the first time after the warm-up (``auto`` re-deciding when its
    measured times drift, a guard re-evaluating) loads a specialization then: a one-time cost
    bounded by the number of kernels, counted apart as ``specializations``."""
    owner = getattr(obj, "__self__", None) if type(obj).__name__ == "builtin_function_or_method" \
        else obj
    if isinstance(owner, weakref.ReferenceType):
        target = owner()
        return target is not None and (_from_numba(type(target))
                                       or (isinstance(target, type) and _from_numba(target)))
    return owner is not obj and _from_numba(type(owner))


def _from_numba(cls: type) -> bool:
    """Whether ``cls`` is one of Numba's (its compiled closures are ``_dynfunc._Closure``)."""
    module = str(type.__dict__["__module__"].__get__(cls))
    return module.startswith("numba") or module == "_dynfunc"


def _specializations(objs: list[Any]) -> int:
    """How many compiled specializations Numba's CPU dispatchers hold."""
    registry = sys.modules.get("numba.core.registry")
    if registry is None:
        return 0
    return sum(len(o.overloads) for o in objs if isinstance(o, registry.CPUDispatcher))


def snapshot(created: Callable[[], int]) -> dict[str, Any]:
    """What this process holds now (after a full garbage collection)."""
    from horovod_compress.mpi_collectives.accounting import PendingRequest
    gc.collect()
    objs = gc.get_objects()
    types = collections.Counter(_type_key(o) for o in objs if not _is_jit_artifact(o))
    mpi = sys.modules.get("mpi4py.MPI")
    requests = sum(1 for o in objs if isinstance(o, PendingRequest)
                   or (mpi is not None and isinstance(o, mpi.Request)
                       and o != mpi.REQUEST_NULL))
    greenlets = sum(n for k, n in types.items() if k.startswith("greenlet."))
    specializations = _specializations(objs)
    del objs
    return {"created": created(), "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")), "rss_kb": _rss_kb(),
            "requests": requests, "greenlets": greenlets, "types": types,
            "specializations": specializations, "modules": len(sys.modules)}


def growth_problems(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any],
                    steps: int = STEPS) -> list[str]:
    """What grew from ``a`` to ``c`` (``2 * steps`` steps apart, ``b`` in the middle)."""
    out = []
    if c["created"] != a["created"]:
        out.append(f"communicators created after the warm-up: {c['created'] - a['created']}")
    for key in ("threads", "fds", "requests", "greenlets"):
        if c[key] > a[key]:
            out.append(f"{key}: {a[key]} -> {b[key]} -> {c[key]}")
    # a kernel loaded on a path first taken after the warm-up is a one-time cost; one a step
    # would be a compilation per step
    if c.get("specializations", 0) - a.get("specializations", 0) >= steps:
        out.append(f"Numba specializations: {a['specializations']} -> {b['specializations']} -> "
                   f"{c['specializations']}")
    if c["rss_kb"] - a["rss_kb"] > RSS_SLACK_KB:
        out.append(f"resident memory +{c['rss_kb'] - a['rss_kb']:.0f} KB over {2 * steps} steps")
    # A half in which Numba loaded or compiled a kernel, or a module was imported (a path taken
    # for the first time), made that kernel's or module's objects: its object counts are not
    # evidence of a leak. A leak grows in every half: when one half loaded something, the
    # other must show one object a step.
    def loaded(x: dict[str, Any]) -> tuple[int, int]:
        return x.get("specializations", 0), x.get("modules", 0)
    clean = [(x, y) for x, y in ((a, b), (b, c)) if loaded(x) == loaded(y)]
    clean = clean if len(clean) == 1 else []
    for key in set(c["types"]) | set(a["types"]):
        grew = c["types"][key] - a["types"][key]
        if not (grew >= steps and c["types"][key] > b["types"][key] > a["types"][key]):
            continue
        if clean and all(y["types"][key] - x["types"][key] < steps for x, y in clean):
            continue
        out.append(f"{key} objects: {a['types'][key]} -> {b['types'][key]} -> "
                   f"{c['types'][key]} (+{grew / (2 * steps):.2f} per step; Numba "
                   f"specializations {a.get('specializations')} -> {b.get('specializations')} "
                   f"-> {c.get('specializations')}, modules {a.get('modules')} -> "
                   f"{b.get('modules')} -> {c.get('modules')})")
    return sorted(out)


def flat_over_steps(steps_by_label: dict[str, Callable[[int], Any]], created: Callable[[], int],
                    warmup: int = WARMUP, steps: int = STEPS) -> list[str]:
    """Step every method in turn, warm-up + 2 * ``steps`` times; what grew after the warm-up.

    All methods of an entry point live side by side and are measured together
    (three measurements per entry point, not per method): a leak in any of
    them shows as its type growing; the type names which one.
    """
    def one_round(i: int) -> None:
        for step in steps_by_label.values():
            step(i)
    for i in range(warmup):
        one_round(i)
    points = [snapshot(created)]
    i = warmup
    for _ in range(2):
        for _ in range(steps):
            one_round(i)
            i += 1
        points.append(snapshot(created))
    return growth_problems(*points, steps=steps)


# ------------------------------------------------------------- the check group itself
def case_one_check_group_per_communicator(comm):
    """Every wrapper of one MPI communicator shares one check group; a communicator's own
    ``Dup`` does not inherit it; freeing a communicator frees its group (MPI's delete callback)."""
    from horovod_compress.mpi_collectives import Communicator
    from horovod_compress.mpi_collectives.check_group import check_groups_alive
    from horovod_compress.mpi_collectives.consistency import check_comm
    world, counts = _counting_world(comm)
    first = check_comm(world)
    alive, made = check_groups_alive(), counts.total()

    class Wrapper:          # e.g. a device wrapper: a ``comm`` that is itself a Communicator
        def __init__(self, inner):
            self.comm = inner
    again = [check_comm(Communicator(world.comm)), check_comm(Wrapper(world)),
             check_comm(Wrapper(Wrapper(Communicator(world.comm))))]
    assert all(g is first for g in again), again
    assert check_groups_alive() == alive and counts.total() == made
    own = world.comm.Dup()                       # the user's duplicate: a group of its own
    assert check_comm(Communicator(own)) is not first
    assert check_groups_alive() == alive + 1
    own.Free()                                   # ... freed with it, at the same point everywhere
    assert check_groups_alive() == alive
    assert counts.freed == 2, counts.freed       # the user's communicator and its check group
    sub = Communicator(world.comm.Split(color=comm.rank % 2, key=comm.rank))
    a = sub.allreduce(np.ones(3), "sum")
    assert check_comm(sub) is not first and check_comm(sub).Get_size() == sub.size
    sub.comm.Free()
    assert check_groups_alive() == alive
    return {"sum": float(a[0]), "created": counts.total() - made}


# --------------------------------------------------------------- the model
def _torch_model(seed: int = 0) -> Any:
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _torch_batch(rank: int, step: int) -> tuple[Any, Any]:
    import torch
    g = torch.Generator().manual_seed(1000 * (step % 16) + rank)
    return torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)


def _torch_step(model: Any, opt: Any, rank: int, step: int) -> None:
    import torch
    x, y = _torch_batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _counting_world(comm: Any) -> tuple[Any, CountingComms]:
    """A Communicator on a counting view of ``comm``'s world, made the front-ends' default."""
    from mpi4py import MPI

    import horovod_compress.torch as hvdc_torch
    from horovod_compress.mpi_collectives import Communicator
    counts = CountingComms()
    world = counts.wrap(MPI.COMM_WORLD)
    hvdc_torch.init(comm=world)
    return Communicator(world), counts


# ---------------------------------------------------------------- cases on MPI ranks
def case_method_allreduce(comm):
    """Plain ``Method.allreduce`` on the issue's four tensors, one call per tensor per step."""
    world, counts = _counting_world(comm)
    shapes = {"0.weight": (64, 64), "0.bias": (64,), "2.weight": (10, 64), "2.bias": (10,)}

    def stepper(method):
        def step(i):
            for k, (name, shape) in enumerate(shapes.items()):
                g = np.random.default_rng([k, i % 16, world.rank]).standard_normal(shape)
                method.allreduce(g.astype(np.float32), name, world)
        return step
    return flat_over_steps({label: stepper(make(label)) for label in method_names()}, counts.total)


def case_torch_optimizer(comm):
    """``horovod_compress.torch.DistributedOptimizer`` (the exchange engine, lockstep groups)."""
    import torch

    from horovod_compress.torch import DistributedOptimizer
    torch.set_num_threads(1)
    world, counts = _counting_world(comm)
    steps, opts = {}, []
    for label in method_names():
        model = _torch_model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=make(label), comm=world)
        opts.append(opt)
        steps[label] = lambda i, m=model, o=opt: _torch_step(m, o, world.rank, i)
    problems = flat_over_steps(steps, counts.total)
    for opt in opts:
        opt.close()
    return problems


def case_long_run_memory(comm):
    """The issue's run: GreedyLore r=4 in the PyTorch optimizer, :data:`LONG_STEPS` steps.

    Returns the resident-memory slope (KB per step) and the communicators created after
    the warm-up; the test bounds both."""
    import torch

    from horovod_compress.torch import DistributedOptimizer
    torch.set_num_threads(1)
    world, counts = _counting_world(comm)
    model = _torch_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(),
                               compression=make("greedylore"), comm=world)
    for i in range(200):
        _torch_step(model, opt, world.rank, i)
    gc.collect()
    rss0, made0 = _rss_kb(), counts.total()
    for i in range(200, 200 + LONG_STEPS):
        _torch_step(model, opt, world.rank, i)
    gc.collect()
    slope = (_rss_kb() - rss0) / LONG_STEPS
    opt.close()
    return {"kb_per_step": slope, "created": counts.total() - made0}


def case_tf_tape(comm):
    """``horovod_compress.tensorflow.DistributedGradientTape`` in ``tf.function``."""
    import tensorflow as tf

    import horovod_compress.tensorflow as hvdc_tf
    world, counts = _counting_world(comm)
    batches = [_torch_batch(world.rank, i) for i in range(16)]
    batches = [(tf.constant(x.numpy()), tf.constant(y.numpy(), dtype=tf.int32)) for x, y in batches]

    def stepper(method, k):
        variables = [tf.Variable(tf.random.stateless_normal([64, 64], seed=[1, k]) * 0.1, name="l1/kernel"),
                     tf.Variable(tf.zeros([64]), name="l1/bias"),
                     tf.Variable(tf.random.stateless_normal([64, 10], seed=[2, k]) * 0.1, name="l2/kernel"),
                     tf.Variable(tf.zeros([10]), name="l2/bias")]

        @tf.function
        def train(x, y):
            w1, b1, w2, b2 = variables
            with tf.GradientTape() as tape:
                logits = tf.nn.relu(x @ w1 + b1) @ w2 + b2
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            grads = hvdc_tf.DistributedGradientTape(tape, compression=method, comm=world).gradient(
                loss, variables)
            for v, g in zip(variables, grads):
                v.assign_sub(0.01 * g)
            return loss
        return lambda i: train(*batches[i % len(batches)])
    return flat_over_steps({label: stepper(make(label), k) for k, label in enumerate(method_names())},
                           counts.total)


def case_keras_optimizer(comm):
    """``horovod_compress.keras.DistributedOptimizer`` (the TensorFlow ``DistributedOptimizer``
    is the same object), one compiled training step per batch (``train_on_batch``)."""
    import keras

    import horovod_compress.keras as hvdc_keras
    world, counts = _counting_world(comm)
    batches = [tuple(t.numpy() for t in _torch_batch(world.rank, i)) for i in range(16)]

    def stepper(method):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        opt = hvdc_keras.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=method,
                                              comm=world)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        return lambda i: model.train_on_batch(*batches[i % len(batches)])
    return flat_over_steps({label: stepper(make(label)) for label in method_names()}, counts.total)


def case_horovod_torch_optimizer(comm):
    """Horovod's own ``horovod.torch.DistributedOptimizer`` with our methods."""
    from horovod_compress.tools.testing import horovod_build_skipped
    try:
        import horovod.torch as hvd
    except Exception as exc:  # noqa: BLE001 - a skip only where the setup left Horovod out
        if horovod_build_skipped():
            return {"skipped": f"Horovod not built (HVDC_SKIP_HOROVOD=1): {exc!r}"}
        raise
    import torch
    torch.set_num_threads(1)
    world, counts = _counting_world(comm)
    if not hvd.is_initialized():
        hvd.init(comm=comm.comm)
    steps = {}
    for label in method_names():
        model = _torch_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       compression=make(label))
        steps[label] = lambda i, m=model, o=opt: _torch_step(m, o, world.rank, i)
    return flat_over_steps(steps, counts.total)


# --------------------------------------------------------- torchrun: the DDP hook
def ranks_ddp_hook(out: Path) -> None:
    """Every method as a DDP comm hook; groups created counted at ``dist.new_group``."""
    import torch
    import torch.distributed as dist

    from horovod_compress.torch import ddp as hvdc_ddp
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    made = collections.Counter()
    new_group = dist.new_group

    def counting_new_group(*args, **kwargs):
        made["new_group"] += 1
        return new_group(*args, **kwargs)
    dist.new_group = counting_new_group
    steps, hooks = {}, []
    for label in method_names():
        model = torch.nn.parallel.DistributedDataParallel(_torch_model(), bucket_cap_mb=0.004)
        hook = hvdc_ddp.comm_hook(make(label), model=model)
        model.register_comm_hook(hook.state, hook)
        hooks.append(hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        steps[label] = lambda i, m=model, o=opt: _torch_step(m, o, dist.get_rank(), i)
    problems = flat_over_steps(steps, lambda: sum(made.values()))
    for hook in hooks:
        hook.state.close()
    (out / f"ddp_rank{dist.get_rank()}.json").write_text(json.dumps(problems))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------ the tests
def test_own_parameters_name_real_methods():
    assert set(OWN_PARAMS) <= set(method_names())
    for name in OWN_PARAMS:
        assert make(name).name == name


# At P = 2 every entry point; at P = 4 (two ranks per core here) the core paths, the per-tensor
# fusion and the check group -- the TensorFlow, Keras and Horovod front-ends call into those same
# paths, and tracing their 18 models on 4 oversubscribed ranks would cost minutes. The core and
# the framework cases run as two jobs (each within the suite's per-test time limit).
CORE_CASES = [case_one_check_group_per_communicator, case_method_allreduce, case_torch_optimizer,
              case_long_run_memory]
FRAMEWORK_CASES = [case_tf_tape, case_keras_optimizer, case_horovod_torch_optimizer]
GROWTH_CASES = {2: [case_method_allreduce, case_torch_optimizer, *FRAMEWORK_CASES],
                4: [case_method_allreduce, case_torch_optimizer]}
_RUNS: dict[tuple[int, str], Any] = {}


def mpi_results(nprocs: int, case: Callable[[Any], Any]) -> dict[int, Any]:
    """``case``'s per-rank results on ``nprocs`` ranks; its job (core or framework cases, one
    ``mpirun``) runs once, on first use."""
    from horovod_compress.tools.mpi_launcher import selected
    from horovod_compress.tools.testing import run_cases
    group = "frameworks" if case in FRAMEWORK_CASES else "core"
    if (nprocs, group) not in _RUNS:
        cases = FRAMEWORK_CASES if group == "frameworks" else CORE_CASES
        if nprocs != 2:                       # the long run once, on a core per rank
            cases = [c for c in cases if c is not case_long_run_memory]
        if selected().name != "openmpi":      # Horovod is built against Open MPI
            cases = [c for c in cases if c is not case_horovod_torch_optimizer]
        _RUNS[nprocs, group] = run_cases(nprocs, __file__, cases, timeout=540,
                                         env={"HVDC_ABORT_ON_EXCEPTION": "0"})
    return _RUNS[nprocs, group][case]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_one_check_group_per_communicator(nprocs):
    """Wrappers share the group of their MPI communicator; each new communicator (the user's
    Dup, a Split) gets one group of its own, freed when the communicator is freed."""
    for r, got in mpi_results(nprocs, case_one_check_group_per_communicator).items():
        # a Split by parity: P/2 ranks each; created: the Dup, its group, the Split, its group
        assert got == {"sum": float(nprocs // 2), "created": 4}, (r, got)


def _counts(objects: int, specializations: int) -> dict[str, Any]:
    return {"created": 0, "threads": 1, "fds": 1, "rss_kb": 0.0, "requests": 0, "greenlets": 0,
            "types": collections.Counter({"tests.Leaked": objects}),
            "specializations": specializations, "modules": len(sys.modules)}


def test_growth_rules_tell_a_leak_from_a_kernel_load():
    """The rules on three snapshots: a steady leak fails, even beside a kernel loaded late; the
    burst of a kernel loaded once after the warm-up does not; a compilation a step fails."""
    s = STEPS
    assert growth_problems(_counts(0, 5), _counts(s, 5), _counts(2 * s, 5))
    assert growth_problems(_counts(0, 5), _counts(s // 2, 5), _counts(s, 5))
    assert growth_problems(_counts(0, 5), _counts(s + 30, 8), _counts(2 * s + 30, 8))
    assert not growth_problems(_counts(0, 5), _counts(2544, 8), _counts(2552, 8))
    assert growth_problems(_counts(0, 5), _counts(0, 5 + s), _counts(0, 5 + 2 * s))


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs,case", [
    pytest.param(p, c, marks=[pytest.mark.horovod] if c is case_horovod_torch_optimizer else [])
    for p, cases in GROWTH_CASES.items() for c in cases],
                         ids=lambda v: f"P{v}" if isinstance(v, int) else v.__name__[len("case_"):])
def test_nothing_grows_per_step(nprocs, case):
    """After the warm-up, no communicator is created and nothing the process holds grows."""
    per_rank = mpi_results(nprocs, case)
    if any(isinstance(v, dict) and "skipped" in v for v in per_rank.values()):
        pytest.skip(per_rank[0].get("skipped", "skipped"))
    bad = {f"rank {r}": got for r, got in per_rank.items() if got}
    assert not bad, json.dumps(bad, indent=1)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2])
def test_long_run_memory_is_flat(nprocs):
    """GreedyLore through the PyTorch optimizer: no communicator after the warm-up, and a
    resident-memory slope below :data:`LONG_KB_PER_STEP` (the leak was 1.6 KB per step)."""
    for r, got in mpi_results(nprocs, case_long_run_memory).items():
        assert got["created"] == 0, (r, got)
        assert got["kb_per_step"] < LONG_KB_PER_STEP, (r, got)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ddp_hook_holds_nothing_per_step(tmp_path, nprocs):
    pytest.importorskip("torch.distributed")
    from horovod_compress.tools.testing import torchrun_command, torchrun_env
    cmd = torchrun_command(nprocs, __file__, "ranks_ddp_hook", str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=torchrun_env({"HVDC_ABORT_ON_EXCEPTION": "0"}))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    bad = {f"rank {r}": got for r in range(nprocs)
           if (got := json.loads((tmp_path / f"ddp_rank{r}.json").read_text()))}
    assert not bad, json.dumps(bad, indent=1)


if __name__ == "__main__":
    _out = Path(sys.argv[2])
    _out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HVDC_ABORT_ON_EXCEPTION", "0")
    {"ranks_ddp_hook": ranks_ddp_hook}[sys.argv[1]](_out)
