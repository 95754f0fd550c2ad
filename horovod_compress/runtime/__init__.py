"""Framework-independent training runtime: bucket plans, cross-rank checks, the exchange engine.

Front-ends (torch, tensorflow, keras) hand NumPy views of gradients to a
:class:`GradientExchange`; it fuses them into buckets, runs the method's
compressed allreduce (on a communication thread, overlapping the backward
pass) and returns the averaged gradients.
"""
from .buckets import Bucket, TensorSpec, plan_buckets
from .consistency import check_same_tensors
from .engine import GradientExchange

__all__ = ["Bucket", "GradientExchange", "TensorSpec", "check_same_tensors", "plan_buckets"]
