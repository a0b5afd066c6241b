"""ConcatPerReader: a concat that several convs or pools read becomes one concat per reader.

Why: a concat is an index remap of its pieces, and the fusion policy lets a conv or a pool take
one in front (``concat -> conv``, ``concat -> pool``): the kernel then reads the pieces where
they lie and the joined tensor is never written. The policy's unique-consumer rule stops that
when the concat has several readers, which is how Inception-style blocks use it: GoogLeNet's
and Inception-v3's module outputs each feed three or four branches (1x1 convs, a pool). A copy
of the concat per reader costs nothing to compute, so each reader gets its own, and each can
fuse it. Readers of other kinds keep the original (written once, as before).

Only readers that can take it with the pieces read in place (``ir.reads_pieces_in_place``: pools,
1x1 convs) and whose class the policy lets follow a concat (``vertical["concat"]``) get a copy:
with the policy's concat -> conv / pool edges removed this pass does nothing. A copy the planner
then leaves unfused (a policy's higher benefit threshold, say) would be one more write of the
joined tensor: ``MergeUnfusedConcats``, right after ``ApplyFusionPolicy``, merges such copies
back into one.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from ..ir import (
    UseCountingMutator,
    count_uses,
    op_calls,
    op_name,
    reads_pieces_in_place,
    rewrite_and_prune,
)
from ..policy import CONCAT_READERS, FusionPolicy

__all__ = ["ConcatPerReader", "MergeUnfusedConcats"]

_CONCAT = "relax.concat"


@relax.expr_functor.mutator
class _Rewriter(UseCountingMutator):
    def __init__(self, mod: tvm.IRModule, uses: dict, reader_ops: set[str]):
        super().__init__(mod, uses)
        self.reader_ops = reader_ops

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) not in self.reader_ops or not reads_pieces_in_place(call):
            return call
        data = call.args[0]
        if not isinstance(data, relax.Var) or self.uses.get(data, 0) < 2:
            return call
        joined = self.lookup_binding(data)
        if op_name(joined) != _CONCAT:
            return call
        own = self.builder_.emit(relax.Call(joined.op, joined.args, joined.attrs, joined.ty_args))
        self.rewrote = True
        return relax.Call(call.op, [own, *call.args[1:]], call.attrs, call.ty_args)


@tvm.transform.module_pass(opt_level=0, name="ConcatPerReader")
class ConcatPerReader:
    """Give each conv / pool reading a shared concat its own copy of it (see the module doc)."""

    def __init__(self, policy: FusionPolicy | None = None):
        policy = FusionPolicy.coerce(policy)
        classes = [c for c in policy.vertical.get("concat", []) if c in CONCAT_READERS]
        self.reader_ops = {f"relax.{op}" for c in classes for op in policy.op_classes.get(c, [])}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not self.reader_ops:
            return mod
        return rewrite_and_prune(
            mod,
            lambda func: op_calls(func, {_CONCAT}),
            lambda func: _Rewriter(mod, count_uses(func), self.reader_ops),
        )


@relax.expr_functor.mutator
class _Merger(relax.PyExprMutator):
    """Binds every concat equal to an earlier one of the same binding block (same pieces, same
    axis) to that one: within a block every earlier var is in scope, and a block's output var is
    not bound to one of its dataflow vars. (Blocks nested in an ``If`` start afresh and leave
    nothing behind.)"""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.seen: list[tuple[relax.Call, relax.Var]] = []
        self.rewrote = False

    def visit_binding_block_(self, block):
        return self._in_own_scope(super().visit_binding_block_, block)

    def visit_dataflow_block_(self, block):
        return self._in_own_scope(super().visit_dataflow_block_, block)

    def _in_own_scope(self, visit, block):
        outer, self.seen = self.seen, []
        try:
            return visit(block)
        finally:
            self.seen = outer

    def visit_var_binding_(self, binding):
        if op_name(binding.value) != _CONCAT:
            super().visit_var_binding_(binding)
            return
        value = self.visit_expr(binding.value)  # its pieces may be merged copies themselves
        dataflow_ok = isinstance(binding.var, relax.DataflowVar)
        twin = next(
            (
                var
                for call, var in self.seen
                if (dataflow_ok or not isinstance(var, relax.DataflowVar))
                and tvm_ffi.structural_equal(call, value)
            ),
            None,
        )
        if twin is not None:
            self.set_var_remap(binding.var, twin)
            self.rewrote = True
            return
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
        self.seen.append((value, binding.var))


@tvm.transform.module_pass(opt_level=0, name="MergeUnfusedConcats")
class MergeUnfusedConcats:
    """Merge the concat calls left equal in a binding block of a graph function back into one: the
    copies ``ConcatPerReader`` made for readers the planner then did not fuse them into (and any
    equal concats the model had itself). Only ``relax.concat`` calls in graph functions: fused
    kernels, and so tuning records' keys, are not touched (a general CSE would also merge calls
    inside the fused groups and change their PrimFuncs)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_and_prune(
            mod, lambda func: len(op_calls(func, {_CONCAT})) >= 2, lambda func: _Merger(mod)
        )
