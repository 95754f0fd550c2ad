"""Register-level casts for Numba kernels: one LLVM instruction each, so loops that use
them still vectorise (a bit pattern read as another type, or IEEE binary16 <-> float32
through the CPU's F16C instructions)."""
from __future__ import annotations

from typing import Any, Callable

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def llvm_cast(source: types.Type, target: types.Type,
              emit: Callable[[ir.IRBuilder, ir.Value], ir.Value], doc: str) -> Any:
    """A Numba intrinsic ``f(x) -> target`` for an argument of ``source``'s kind and width
    (any signedness for integers), computed by ``emit(builder, value)``."""
    def typer(typingctx: Any, x: types.Type) -> Any:
        if not isinstance(x, type(source)) or x.bitwidth != source.bitwidth:
            return None

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
            return emit(builder, args[0])
        return target(x), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


float32_bits = llvm_cast(types.float32, types.uint32, lambda b, v: b.bitcast(v, ir.IntType(32)),
                         "The IEEE-754 bit pattern of a float32 as a uint32.")
bits_float32 = llvm_cast(types.uint32, types.float32, lambda b, v: b.bitcast(v, ir.FloatType()),
                         "The float32 whose bit pattern is the 32-bit integer ``b``.")
float64_bits = llvm_cast(types.float64, types.int64, lambda b, v: b.bitcast(v, ir.IntType(64)),
                         "The IEEE-754 bit pattern of a float64 as an int64.")
bits_float64 = llvm_cast(types.int64, types.float64, lambda b, v: b.bitcast(v, ir.DoubleType()),
                         "The float64 whose IEEE-754 bit pattern is the 64-bit integer ``b``.")
float32_to_f16_bits = llvm_cast(
    types.float32, types.uint16,
    lambda b, v: b.bitcast(b.fptrunc(v, ir.HalfType()), ir.IntType(16)),
    "float32 -> IEEE binary16 bit pattern (uint16), round to nearest even (``vcvtps2ph``).")
f16_bits_to_float32 = llvm_cast(
    types.uint16, types.float32,
    lambda b, v: b.fpext(b.bitcast(v, ir.HalfType()), ir.FloatType()),
    "IEEE binary16 bit pattern (uint16) -> float32, exact (``vcvtph2ps``).")
