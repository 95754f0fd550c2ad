"""Framework-independent training runtime: bucket plans, cross-rank checks, the exchange engine.

Front-ends (torch, tensorflow, keras) hand NumPy views of gradients to a
:class:`TrainingExchange`: it pre-divides them (:mod:`.scaling`), hands them to
a :class:`GradientExchange`, which fuses them into buckets and runs the
method's compressed allreduce (on a communication thread, overlapping the
backward pass), and returns the scaled averages, counting each step into
:class:`ExchangeStats` (:mod:`.stats`) and switching to a dense exchange
during warm-up.
"""
from .buckets import Bucket, TensorSpec, plan_buckets
from .consistency import check_same_tensors
from .engine import GradientExchange
from .scaling import Scaling, working_dtype
from .session import StepSettings, TrainingExchange
from .stats import ExchangeStats

__all__ = ["Bucket", "ExchangeStats", "GradientExchange", "Scaling", "StepSettings",
           "TensorSpec", "TrainingExchange", "check_same_tensors", "plan_buckets",
           "working_dtype"]
