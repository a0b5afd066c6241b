"""Keep the scratch buffers a loop body allocates on the stack, not in TVM's workspace pool.

Why: this TVM's ``LowerTVMBuiltin`` turns every CPU ``AllocBuffer`` that is not a small
``global`` one into a ``TVMBackendAllocWorkspace`` / ``TVMBackendFreeWorkspace`` pair at the
place it is allocated. Our schedules allocate per parallel task: a register tile's accumulators
(``Contraction``, 1.5 KiB for 6 x 64 floats), a depthwise task's padded and polyphase rows (2 KiB
each). Counted with a ``perf`` probe on ``TVMBackendAllocWorkspace``: 22,600 calls per
mobilenet_v2 inference, and the pool's bookkeeping was ~7 % of the CPU samples; with a free-list
of zero cost (the runtime's allocator swapped for a bump allocator in the same process) the model
ran 6 % faster (mobilenet_v3_small 5 %, efficientnet_b0 3.4 %, squeezenet1_1 2 %).

``LowerTVMBuiltin`` leaves an ``AllocBuffer`` annotated ``disable_lower_builtin`` alone, and LLVM
codegen makes it an ``alloca`` in the entry block of the function that holds it: for a buffer
inside a parallel loop that is the loop's outlined body, so one allocation per thread and kernel
call instead of one per task. This pass sets the annotation on the constant-size buffers (of the
scopes in ``STACK_SCOPES``) allocated inside a loop of a CPU function, while the function's stack
frame stays within ``MAX_FRAME_BYTES``; it runs right before ``LowerTVMBuiltin`` in the TIR
pipeline ``tvm_fusion.pipeline.tir_pipeline`` names for CPU builds.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx

__all__ = ["StackAllocateLoopBuffers"]

DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # TVM's tirx::transform::kDisableLowerTVMBuiltin
# Every annotated buffer is its own alloca in the function's entry block (no lifetime markers;
# UnrollLoop may have copied an allocation), and a thread's stack can be as small as 512 KiB (a
# Python thread on macOS runs the parallel loop's first task): a budget per function. A task's
# scratch is a few KiB (the largest seen in the zoo, a 7x7 depthwise task's padded rows, 37 KiB).
MAX_FRAME_BYTES = 256 << 10
# ``local`` too (the schedules' register tiles): LLVM keeps such an alloca in registers as long as
# the tile is read in the SIMD-register pieces it was written in (``Contraction``'s epilogue
# splits its vectors so: read as <48 x float>, a K=384 GEMM tile spilled 621 times, 7x slower).
STACK_SCOPES = ("global", "local")
ALLOCA_ALIGN = 64


def _stack_bytes(buffer) -> int | None:
    """The buffer's size in bytes (rounded up to the alloca alignment) when its shape is
    constant, else None."""
    dims = list(buffer.shape)
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    dtype = tvm.DataType(str(buffer.dtype))
    size = math.prod(int(d) for d in dims) * dtype.bits * dtype.lanes // 8
    return -(-size // ALLOCA_ALIGN) * ALLOCA_ALIGN


class _Rewriter:
    """Rebuilds the statements on the way to each annotated ``AllocBuffer`` (this TVM has no
    Python ``ir_transform``); statement kinds it does not know are kept as they are."""

    def __init__(self, budget: int):
        self.budget = budget

    def visit(self, stmt, in_loop: bool):
        """``stmt`` with its in-loop buffers annotated; the same object where nothing changed."""
        if isinstance(stmt, tirx.AllocBuffer):
            return self._alloc(stmt, in_loop)
        if isinstance(stmt, tirx.SeqStmt):
            seq = [self.visit(s, in_loop) for s in stmt.seq]
            changed = any(not new.same_as(old) for new, old in zip(seq, stmt.seq))
            return tirx.SeqStmt(seq) if changed else stmt
        if isinstance(stmt, tirx.For):
            body = self.visit(stmt.body, True)
            if body.same_as(stmt.body):
                return stmt
            return tirx.For(
                stmt.loop_var,
                stmt.min,
                stmt.extent,
                stmt.kind,
                body,
                stmt.thread_binding,
                stmt.annotations,
                stmt.step,
            )
        if isinstance(stmt, tirx.AttrStmt):
            body = self.visit(stmt.body, in_loop)
            return (
                stmt if body.same_as(stmt.body) else tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
            )
        if isinstance(stmt, tirx.IfThenElse):
            then_case = self.visit(stmt.then_case, in_loop)
            else_case = None if stmt.else_case is None else self.visit(stmt.else_case, in_loop)
            if then_case.same_as(stmt.then_case) and (else_case is None or else_case.same_as(stmt.else_case)):
                return stmt
            return tirx.IfThenElse(stmt.condition, then_case, else_case)
        return stmt  # leaves (stores, evaluates, binds, declarations) and anything else: unchanged

    def _alloc(self, stmt, in_loop: bool):
        size = _stack_bytes(stmt.buffer)
        annotations = dict(stmt.annotations or {})
        if (
            not in_loop
            or size is None
            or size > self.budget
            or stmt.buffer.scope() not in STACK_SCOPES
            or DISABLE_LOWER_BUILTIN in annotations
        ):
            return stmt
        self.budget -= size
        annotations[DISABLE_LOWER_BUILTIN] = tirx.IntImm("bool", 1)
        return tirx.AllocBuffer(stmt.buffer, annotations)


@tirx.transform.prim_func_pass(opt_level=0, name="StackAllocateLoopBuffers")
class StackAllocateLoopBuffers:
    """Annotate the constant-size scratch buffers allocated inside loops of CPU functions so that
    ``LowerTVMBuiltin`` leaves them to LLVM's stack (see the module docstring). Run it on lowered
    TIR, right before ``LowerTVMBuiltin``."""

    def transform_function(self, func, _mod, _ctx):
        target = func.attrs.get("target") if func.attrs is not None else None
        if target is not None and target.kind.name != "llvm":
            return func
        body = _Rewriter(MAX_FRAME_BYTES).visit(func.body, False)
        return func if body.same_as(func.body) else func.with_body(body)
