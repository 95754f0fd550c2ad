"""Framework-independent training runtime: bucket plans, cross-rank checks, the exchange engine.

Everything a front-end does that is not converting tensors and wiring hooks.
The PyTorch and TensorFlow front-ends hand NumPy views of gradients to a
:class:`TrainingExchange`: it pre-divides them (:mod:`.scaling`), hands them to
a :class:`GradientExchange`, which fuses them into buckets and runs the
method's compressed allreduce (on a communication thread, overlapping the
backward pass), and returns the scaled averages, counting each step into
:class:`ExchangeStats` (:mod:`.stats`) and switching to a dense exchange
during warm-up. A DDP comm hook, whose buckets the framework fuses, hands
each bucket to a :class:`HookExchange` (:mod:`.hook`) instead: the same
methods, statistics and switches, per DDP iteration.
"""
from .buckets import Bucket, TensorSpec, plan_buckets
from ..mpi_collectives.consistency import check_same_tensors
from .engine import GradientExchange
from .hook import ArraySlot, BucketView, HookExchange
from .hook_buckets import HookBuckets
from .scaling import Scaling, working_dtype
from .session import StepSettings, TrainingExchange
from .stats import ExchangeStats

__all__ = ["ArraySlot", "Bucket", "BucketView", "ExchangeStats", "GradientExchange", "HookBuckets",
           "HookExchange", "Scaling", "StepSettings", "TensorSpec", "TrainingExchange",
           "check_same_tensors", "plan_buckets", "working_dtype"]
