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
with the policy's concat -> conv / pool edges removed this pass does nothing.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..ir import (
    UseCountingMutator,
    count_uses,
    graph_functions,
    op_calls,
    op_name,
    reads_pieces_in_place,
    with_functions,
)
from ..policy import CONCAT_READERS, FusionPolicy

__all__ = ["ConcatPerReader"]

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
        updates = {}
        for gvar, func in graph_functions(mod):
            if not op_calls(func, {_CONCAT}):
                continue
            rewriter = _Rewriter(mod, count_uses(func), self.reader_ops)
            rewritten = rewriter.visit_expr(func)
            if rewriter.rewrote:
                updates[gvar] = relax.analysis.remove_all_unused(rewritten)
        return with_functions(mod, updates)
