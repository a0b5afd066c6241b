"""Horizontal fusion: merge sibling ops that read the same tensor into one wider op + ``split``.

Why: Q/K/V projections, inception-style 1x1 branches and similar siblings are each a small
GEMM/conv kernel that re-reads the same input. One kernel with the weights concatenated on the
output axis reads the input once, gives the tuner a bigger (better-utilised) problem and cuts
launches; the bias adds are concatenated too so they stay in the big kernel's epilogue.

Runs on high-level Relax (before ``LegalizeOps``), ideally after BN folding and
``FoldConstant``; it also works on the raw ONNX import, because it looks through
``permute_dims``/``reshape`` of constants (ONNX ``Gemm`` imports as
``matmul(x, permute_dims(W))``, a conv bias as ``add(conv, reshape(b, (1,C,1,1)))``).

What it rewrites (every group needs >= ``min_branches`` members, same dataflow block):

* **matmul**: ``matmul(x, W_i)`` with the same ``x`` Var, constant ``W_i`` of equal rank,
  equal leading dims and K, same dtype and ``out_dtype`` -> ``matmul(x, concat(W_i, axis=-1))``
  -> ``split`` on the last axis. The concatenated weight is computed here (numpy), so no
  runtime concat is left.
* **conv2d**: same ``x``, constant weights, identical strides/padding/dilation/layouts/
  out_dtype, ``groups == 1``, same in-channels and kernel size -> one conv2d with weights
  concatenated on the kernel's ``O`` axis -> ``split`` on the output's ``C`` axis.
* **bias carrying** (both of the above): members whose result is used only by an ``add``
  with a constant whose broadcast does not change the output shape have their biases
  concatenated (zeros for the other members: Whisper's bias-free K between a biased Q and V)
  and added once before the split (exact same math). Without any such member the
  matmuls/convs are still merged and the existing adds stay after the split.
* **activation carrying**: if then every member's result feeds exactly one identical unary
  elementwise op (relu, gelu, sigmoid, clip, ...), it is applied once before the split too, so
  conv+bias+relu branches stay one kernel (without this each branch's relu would become its
  own kernel after the split).
* **output form** (``output_op``): ``split`` by default; ``strided_slice`` per branch, or
  ``auto`` (slices only when all consumers are injective/elementwise, where FuseOps folds the
  slice into the consumer, e.g. Q/K/V's reshape+transpose; a matmul's ``split`` never fuses).
* **elementwise** (off by default, ``fuse_elementwise=True``): the same unary op (relu,
  sigmoid, ...; identical attrs) on different same-shape/dtype tensors -> ``concat`` on axis 0
  -> op -> ``split``. Benefit rule: it only saves launches (N kernels -> 1: FuseOps folds
  concat -> op -> split into one kernel), while the concat/split inside that kernel may still
  materialise an intermediate (up to 2 extra passes over the data). So it fires only for
  groups of >= ``min_branches`` tensors of at most ``elementwise_max_numel`` elements each
  (default 16384: launch-bound sizes, where ~us launch cost exceeds moving <= 64 KiB), and
  only where the merged op can be placed after all inputs and before every use of the
  outputs.

Difference from stock ``relax.transform.CombineParallelMatmul`` (which we do not duplicate:
run it too if weights are function parameters):
the stock pass binds the RHS through dataflow-pattern matches that must be *Vars*, so with
constant weights (``from_onnx(..., keep_params_in_input=False)`` + ``FoldConstant``) it fuses
nothing - Q/K/V of ``models.transformer_block()`` stay three matmuls. When it does fire it
emits a runtime ``concat`` of the weights. It also has no conv2d support, its bias and
activation carrying (relu/gelu/gelu_tanh/silu only) likewise needs Var biases, and it always
splits. This pass handles constant weights (concatenated at compile time), the ONNX Gemm
``permute_dims`` form, conv2d siblings, commutative bias adds with constant (also reshaped)
biases, more activations, slice outputs, and optional elementwise siblings.

Counting: the pass records what it did in the module attribute ``"tvm_fusion.horizontal_fuse"``
(a dict ``{"groups", "branches", "matmul", "conv2d", "elementwise"}``, accumulated over runs);
``count_horizontal_groups(mod)`` returns it, or counts the recognisable ``split``/slice sets
structurally when the attribute was dropped by a later pass (the attribute survives
``relax.get_pipeline("zero")``). New bindings are named ``hfuse_*``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..ir import constant_value, dtype_of, graph_functions, is_constant, op_name, shape_dims

ATTR_KEY = "tvm_fusion.horizontal_fuse"

# Unary, shape-preserving elementwise ops that are safe to apply to a concatenation.
_ELEMWISE_OPS = frozenset(
    "relax." + n
    for n in (
        "nn.relu",
        "nn.gelu",
        "nn.gelu_tanh",
        "nn.silu",
        "nn.hardswish",
        "nn.leakyrelu",
        "sigmoid",
        "tanh",
        "exp",
        "erf",
        "negative",
        "sqrt",
        "rsqrt",
        "abs",
        "log",
        "clip",
        "square",
        "floor",
        "ceil",
        "round",
        "sin",
        "cos",
    )
)
# Consumers a strided_slice fuses into (FuseOps: injective producer -> injective/elemwise consumer).
_SLICE_FRIENDLY = _ELEMWISE_OPS | frozenset(
    "relax." + n
    for n in (
        "reshape",
        "permute_dims",
        "expand_dims",
        "squeeze",
        "flatten",
        "add",
        "subtract",
        "multiply",
        "divide",
    )
)
_MATMUL = "relax.matmul"
_CONV2D = "relax.nn.conv2d"
_ADD = "relax.add"
_INF = float("inf")


# -- small helpers ------------------------------------------------------------------------------


def _layout_axis(layout: str, letter: str) -> int | None:
    """Axis of ``letter`` in a plain 4-letter layout (packed layouts like NCHW4c are refused)."""
    if len(layout) != 4 or not layout.isupper() or layout.count(letter) != 1:
        return None
    return layout.index(letter)


def _use_sites(func: relax.Function) -> dict:
    """Var -> list of (block index, binding index) of its users; (inf, inf) for the body result."""
    uses: dict = {}
    seq = func.body
    if not isinstance(seq, relax.SeqExpr):
        return uses
    for bi, block in enumerate(seq.blocks):
        for pi, binding in enumerate(block.bindings):
            for v in relax.analysis.free_vars(binding.value):
                uses.setdefault(v, []).append((bi, pi))
    for v in relax.analysis.free_vars(seq.body):
        uses.setdefault(v, []).append((_INF, _INF))
    return uses


# -- plan -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Branch:
    pos: int  # index of the call's binding in its block
    call_var: relax.Var  # var bound to the matmul/conv2d/unary call
    call: relax.Call
    weight: np.ndarray | None = None
    width: int = 0  # size along the split axis
    add_var: relax.Var | None = None  # bias add using call_var (candidate)
    bias: np.ndarray | None = None
    act_var: relax.Var | None = None  # unary activation after the (bias-added) result
    act: relax.Call | None = None


@dataclasses.dataclass
class _Group:
    kind: str  # "matmul" | "conv2d" | "elementwise"
    branches: list
    split_axis: int
    weight_axis: int = 0
    carry_bias: bool = False
    lhs: relax.Var | None = None
    slice_friendly: bool = False  # every output is read only by ops a strided_slice fuses into

    carry_act: bool = False

    def _pre_act_vars(self):
        return [b.add_var if self.carry_bias and b.add_var is not None else b.call_var for b in self.branches]

    def out_vars(self):
        return [b.act_var for b in self.branches] if self.carry_act else self._pre_act_vars()

    def dropped_vars(self):
        out = [b.call_var for b in self.branches]
        if self.carry_bias:
            out += [b.add_var for b in self.branches if b.add_var is not None]
        if self.carry_act:
            out += [b.act_var for b in self.branches]
        return out


class _Planner:
    def __init__(self, func, opts):
        self.func = func
        self.opts = opts
        self.var2val = relax.analysis.get_var2val(func)
        self.uses = _use_sites(func)

    def plan(self):
        """Groups per dataflow block, in block and binding order (deterministic)."""
        groups = []
        for bi, block in enumerate(self.func.body.blocks):
            if not isinstance(block, relax.DataflowBlock):
                continue
            groups += self._plan_block(bi, block)
        return groups

    def _plan_block(self, bi, block):
        buckets: dict = {}  # key -> list of _Branch, insertion ordered by first member
        elem_buckets: dict = {}
        self.def_pos = {}
        for pi, binding in enumerate(block.bindings):
            self.def_pos[binding.var] = pi
            if not isinstance(binding, relax.VarBinding):
                continue
            value = binding.value
            name = op_name(value)
            if name == _MATMUL and self.opts["matmul"]:
                key_br = self._matmul_branch(pi, binding.var, value)
            elif name == _CONV2D and self.opts["conv2d"]:
                key_br = self._conv_branch(pi, binding.var, value)
            elif name in _ELEMWISE_OPS and self.opts["elementwise"]:
                key = self._elem_key(binding.var, value)
                if key is not None:
                    elem_buckets.setdefault(key, []).append(_Branch(pi, binding.var, value))
                continue
            else:
                continue
            if key_br is not None:
                key, br = key_br
                buckets.setdefault(key, []).append(br)

        groups = []
        for key, branches in self._chunked(buckets):
            if len(branches) < self.opts["min_branches"]:
                continue
            kind, split_axis, weight_axis = key[0], key[1], key[2]
            group = _Group(kind, branches, split_axis, weight_axis, lhs=branches[0].call.args[0])
            group.carry_bias = self.opts["carry_bias"] and self._carry_biases(bi, group)
            group.carry_act = self.opts["carry_activation"] and self._act_all(bi, group)
            group.slice_friendly = all(self._slice_friendly(bi, v) for v in group.out_vars())
            groups.append(group)
        taken = {v for g in groups for v in g.dropped_vars()}  # e.g. activations carried above
        for branches in elem_buckets.values():
            groups += self._elem_groups(bi, [b for b in branches if b.call_var not in taken])
        return groups

    def _chunked(self, buckets):
        """Cut each bucket, in binding order, into runs whose merged width <= max_fused_width."""
        cap = self.opts["max_fused_width"]
        for key, branches in buckets.items():
            run, width = [], 0
            for br in branches:
                if cap is not None and run and width + br.width > cap:
                    yield key, run
                    run, width = [], 0
                run.append(br)
                width += br.width
            yield key, run

    # matmul ---------------------------------------------------------------------------------
    def _matmul_branch(self, pi, var, call):
        lhs, rhs = call.args
        if not isinstance(lhs, relax.Var):
            return None
        w = constant_value(rhs, self.var2val)
        out_shape = shape_dims(var)
        if w is None or w.ndim < 2 or out_shape is None or shape_dims(lhs) is None:
            return None
        if str(w.dtype) != dtype_of(rhs) or out_shape[-1] != w.shape[-1]:
            return None
        key = (
            "matmul",
            len(out_shape) - 1,
            w.ndim - 1,
            lhs,
            w.shape[:-1],
            str(w.dtype),
            dtype_of(var),
            str(call.attrs.out_dtype),
            dtype_of(lhs),
        )
        return key, _Branch(pi, var, call, weight=w, width=int(w.shape[-1]))

    # conv2d ---------------------------------------------------------------------------------
    def _conv_branch(self, pi, var, call):
        lhs, rhs = call.args
        a = call.attrs
        if not isinstance(lhs, relax.Var) or int(a.groups) != 1:
            return None
        out_layout = str(a.out_layout) or str(a.data_layout)
        o_axis = _layout_axis(str(a.kernel_layout), "O")
        c_axis = _layout_axis(out_layout, "C")
        w = constant_value(rhs, self.var2val)
        out_shape = shape_dims(var)
        if o_axis is None or c_axis is None or w is None or w.ndim != 4 or out_shape is None:
            return None
        if str(w.dtype) != dtype_of(rhs) or out_shape[c_axis] != w.shape[o_axis]:
            return None
        rest = tuple(d for i, d in enumerate(w.shape) if i != o_axis)
        ints = lambda arr: tuple(int(x) for x in arr)  # noqa: E731
        key = (
            "conv2d",
            c_axis,
            o_axis,
            lhs,
            rest,
            str(w.dtype),
            dtype_of(var),
            str(a.out_dtype),
            ints(a.strides),
            ints(a.padding),
            ints(a.dilation),
            str(a.data_layout),
            str(a.kernel_layout),
            out_layout,
        )
        return key, _Branch(pi, var, call, weight=w, width=int(w.shape[o_axis]))

    # bias -----------------------------------------------------------------------------------
    def _carry_biases(self, bi, group) -> bool:
        """True when some branch's result feeds exactly one ``add`` with a compatible constant;
        the others get zero biases (Whisper's K projection has none, its Q and V have one), so
        no add is left after the split to copy a branch out on its own."""
        others = None
        for br in group.branches:
            found = self._bias_of(bi, group, br)
            if found is None:
                continue
            add_var, padded = found
            target = list(padded.shape)
            target[group.split_axis] = br.width
            rest = tuple(d for i, d in enumerate(target) if i != group.split_axis)
            if others is not None and rest != others:
                return False
            others = rest
            br.add_var, br.bias = add_var, np.broadcast_to(padded, target)
        if others is None:
            return False
        for br in group.branches:
            if br.add_var is None:
                shape = list(others)
                shape.insert(group.split_axis, br.width)
                br.bias = np.zeros(shape, dtype_of(br.call_var))
        return True

    def _bias_of(self, bi, group, br):
        """``(add var, bias padded to the result's rank)`` when the branch's result feeds exactly
        one ``add`` of a constant that does not broadcast it, else None."""
        sites = self.uses.get(br.call_var, [])
        if len(sites) != 1 or sites[0][0] != bi:
            return None
        add_binding = self.func.body.blocks[bi].bindings[sites[0][1]]
        value = add_binding.value
        if op_name(value) != _ADD or not isinstance(add_binding, relax.VarBinding):
            return None
        a, b = value.args
        other = b if a.same_as(br.call_var) else a if b.same_as(br.call_var) else None
        if other is None or other.same_as(br.call_var):
            return None
        bias = constant_value(other, self.var2val)
        if bias is None or str(bias.dtype) != dtype_of(br.call_var):
            return None
        if shape_dims(add_binding.var) != shape_dims(br.call_var):
            return None  # the add broadcasts the result: not a plain bias
        shape = shape_dims(br.call_var)
        if bias.ndim > len(shape):
            return None
        padded = bias.reshape((1,) * (len(shape) - bias.ndim) + bias.shape)
        if padded.shape[group.split_axis] not in (1, br.width):
            return None
        return add_binding.var, padded

    def _act_all(self, bi, group) -> bool:
        """True when every branch's result feeds exactly one identical unary elementwise op.

        Carried so that conv+bias+relu branches keep their activation in the merged kernel
        (otherwise it would become one extra kernel per branch after the split).
        """
        first = None
        for var, br in zip(group._pre_act_vars(), group.branches):
            sites = self.uses.get(var, [])
            if len(sites) != 1 or sites[0][0] != bi:
                return False
            binding = self.func.body.blocks[bi].bindings[sites[0][1]]
            value = binding.value
            if not isinstance(binding, relax.VarBinding) or op_name(value) not in _ELEMWISE_OPS:
                return False
            if not value.args[0].same_as(var) or any(a.same_as(var) for a in value.args[1:]):
                return False
            if shape_dims(binding.var) != shape_dims(var) or dtype_of(binding.var) != dtype_of(var):
                return False
            if first is None:
                first = value
            elif not (
                value.op.same_as(first.op)
                and tvm_ffi.structural_equal(value.args[1:], first.args[1:])
                and tvm_ffi.structural_equal(value.attrs, first.attrs)
            ):
                return False
            br.act_var, br.act = binding.var, value
        return True

    def _slice_friendly(self, bi, var) -> bool:
        block = self.func.body.blocks[bi]
        sites = self.uses.get(var, [])
        return bool(sites) and all(
            b == bi and op_name(block.bindings[p].value) in _SLICE_FRIENDLY for b, p in sites
        )

    # elementwise ------------------------------------------------------------------------------
    def _elem_key(self, var, call):
        if len(call.args) < 1 or not isinstance(call.args[0], relax.Var):
            return None
        shape = shape_dims(var)
        if shape is None or len(shape) == 0 or None in shape or shape_dims(call.args[0]) != shape:
            return None
        if int(np.prod(shape)) > self.opts["elementwise_max_numel"]:
            return None
        # extra args (e.g. clip bounds) and attrs must be identical across the group
        extra = tuple(tvm_ffi.structural_hash(a) for a in call.args[1:])
        attrs = tvm_ffi.structural_hash(call.attrs) if call.attrs is not None else 0
        return (call.op.name, shape, dtype_of(var), dtype_of(call.args[0]), extra, attrs)

    def _first_use(self, bi, var):
        sites = [p if b == bi else _INF for b, p in self.uses.get(var, [])]
        return min(sites, default=_INF)

    def _elem_groups(self, bi, branches):
        """Greedy, in binding order: keep a branch if inputs still precede all output uses.

        Merged at the point right after the last input's definition, so the rule is
        ``max(def(input_i)) < min(first use(output_j))``; a branch whose input *is* a chosen
        branch's output is refused explicitly (indirect dependencies already fail the rule).
        """
        groups = []
        remaining = list(branches)
        while len(remaining) >= self.opts["min_branches"]:
            chosen, rest, last_input, first_use, inputs = [], [], -1, _INF, []
            for br in remaining:
                x = br.call.args[0]
                if (
                    any(x.same_as(i) for i in inputs + [c.call_var for c in chosen])
                    or not tvm_ffi.structural_equal(br.call.args[1:], remaining[0].call.args[1:])
                    or not tvm_ffi.structural_equal(br.call.attrs, remaining[0].call.attrs)
                ):
                    rest.append(br)
                    continue
                q = max(last_input, self.def_pos.get(x, -1))
                u = min(first_use, self._first_use(bi, br.call_var))
                if q < u:
                    chosen.append(br)
                    inputs.append(x)
                    last_input, first_use = q, u
                else:
                    rest.append(br)
            if len(chosen) >= self.opts["min_branches"]:
                g = _Group("elementwise", chosen, split_axis=0)
                g.emit_before = last_input + 1
                groups.append(g)
            if len(rest) == len(remaining):
                break
            remaining = rest
        return groups


# -- rewrite --------------------------------------------------------------------------------------
@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, groups, output_op):
        super().__init__(mod)
        self.output_op = output_op
        self.emit_at: dict = {}  # binding var -> groups to emit just before that binding
        self.drop: set = set()
        # At a shared anchor, elementwise groups go first: they are emitted *before* the anchor
        # binding (their inputs are all defined earlier), while a matmul/conv2d group replaces
        # the anchor binding itself and may read an elementwise group's output.
        for g in sorted(groups, key=lambda g: g.kind != "elementwise"):
            self.emit_at.setdefault(g.anchor_var, []).append(g)
            self.drop.update(g.dropped_vars())

    def visit_var_binding_(self, binding):
        for group in self.emit_at.get(binding.var, []):
            self._emit_group(group)
        if binding.var in self.drop:
            return
        super().visit_var_binding_(binding)

    def visit_match_cast_(self, binding):
        for group in self.emit_at.get(binding.var, []):  # an elementwise emit point may land here
            self._emit_group(group)
        super().visit_match_cast_(binding)

    def _emit_group(self, g: _Group):
        bb = self.builder_
        if g.kind == "elementwise":
            xs = [self.visit_expr(br.call.args[0]) for br in g.branches]
            cat = bb.emit(relax.op.concat(xs, axis=0), "hfuse_concat")
            tmpl = g.branches[0].call
            args = [cat] + [self.visit_expr(a) for a in tmpl.args[1:]]
            y = bb.emit(
                relax.Call(tmpl.op, args, tmpl.attrs, tmpl.ty_args), "hfuse_" + tmpl.op.name.split(".")[-1]
            )
            widths = [int(shape_dims(br.call_var)[0]) for br in g.branches]
        else:
            tmpl = g.branches[0].call
            x = self.visit_expr(g.lhs)
            w = relax.const(
                np.ascontiguousarray(np.concatenate([br.weight for br in g.branches], axis=g.weight_axis))
            )
            y = bb.emit(relax.Call(tmpl.op, [x, w], tmpl.attrs, tmpl.ty_args), "hfuse_" + g.kind)
            if g.carry_bias:
                bias = np.concatenate([br.bias for br in g.branches], axis=g.split_axis)
                y = bb.emit(relax.op.add(y, relax.const(np.ascontiguousarray(bias))), "hfuse_bias")
            if g.carry_act:
                act = g.branches[0].act
                args = [y] + [self.visit_expr(a) for a in act.args[1:]]
                y = bb.emit(relax.Call(act.op, args, act.attrs, act.ty_args), "hfuse_act")
            widths = [br.width for br in g.branches]
        bounds = [0] + [int(v) for v in np.cumsum(widths)]
        # elementwise groups always split: FuseOps folds concat -> op -> split into one kernel
        use_slices = g.kind != "elementwise" and (
            self.output_op == "strided_slice" or (self.output_op == "auto" and g.slice_friendly)
        )
        if not use_slices:
            parts = bb.emit(relax.op.split(y, bounds[1:-1], axis=g.split_axis), "hfuse_split")
            items = [relax.TupleGetItem(parts, i) for i in range(len(widths))]
        else:  # one slice per branch: each can fuse into its (injective) consumer
            items = [
                relax.op.strided_slice(y, [g.split_axis], [lo], [hi], assume_inbound=True)
                for lo, hi in zip(bounds[:-1], bounds[1:])
            ]
        for var, item in zip(g.out_vars(), items):
            bb.emit_normalized(relax.VarBinding(var, bb.normalize(item)))


def _finish_groups(func, groups):
    """Anchor each group on a binding var: first member (matmul/conv2d) or emit point (elementwise)."""
    for g in groups:
        if g.kind == "elementwise":
            bi = None
            for i, block in enumerate(func.body.blocks):
                if any(b.var.same_as(g.branches[0].call_var) for b in block.bindings):
                    bi = i
            g.anchor_var = func.body.blocks[bi].bindings[g.emit_before].var
        else:
            g.anchor_var = g.branches[0].call_var
    return groups


@tvm.transform.module_pass(opt_level=0, name="HorizontalFuse")
class HorizontalFuse:
    """Merge sibling matmul / conv2d (and optionally unary elementwise) ops; see module doc.

    Parameters
    ----------
    min_branches : smallest group that is merged (>= 2).
    fuse_matmul, fuse_conv2d : enable the GEMM / conv2d rewrites (on by default).
    fuse_elementwise : enable concat -> op -> split for same-shape unary siblings (off).
    elementwise_max_numel : per-tensor element limit for the elementwise rewrite.
    max_fused_width : optional cap on a merged op's output width (sum of N / out-channels);
        larger groups are cut into consecutive runs. None (default): no cap.
    carry_bias : concatenate constant bias adds into the merged op (zeros for members without one).
    carry_activation : also apply an identical unary activation (relu, gelu, ...) once before
        the split when every member's result feeds exactly one such op.
    output_op : how a merged matmul/conv2d result is cut back into branches:
        ``"split"`` (default; one ``split`` + ``TupleGetItem``s), ``"strided_slice"`` (one slice
        per branch) or ``"auto"`` (slices when every branch output is read only by
        injective/elementwise ops, else split). FuseOps never fuses a matmul/conv2d's ``split``
        with its consumers, so ``split`` costs one extra copy kernel; slices are injective and
        fold into injective consumers (e.g. the reshape/transpose after Q/K/V), saving it - but
        in front of a GEMM consumer each slice would be its own kernel. Elementwise groups
        always use ``split`` (concat -> op -> split fuses into one kernel).
    """

    def __init__(
        self,
        min_branches: int = 2,
        fuse_matmul: bool = True,
        fuse_conv2d: bool = True,
        fuse_elementwise: bool = False,
        elementwise_max_numel: int = 16384,
        carry_bias: bool = True,
        carry_activation: bool = True,
        output_op: str = "split",
        max_fused_width: int | None = None,
    ):
        if min_branches < 2:
            raise ValueError("min_branches must be >= 2")
        if output_op not in ("split", "strided_slice", "auto"):
            raise ValueError(f"output_op must be 'split', 'strided_slice' or 'auto', not {output_op!r}")
        self.output_op = output_op
        self.opts = dict(
            min_branches=int(min_branches),
            matmul=bool(fuse_matmul),
            conv2d=bool(fuse_conv2d),
            elementwise=bool(fuse_elementwise),
            elementwise_max_numel=int(elementwise_max_numel),
            carry_bias=bool(carry_bias),
            carry_activation=bool(carry_activation),
            max_fused_width=None if max_fused_width is None else int(max_fused_width),
        )

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        stats = {"groups": 0, "branches": 0, "matmul": 0, "conv2d": 0, "elementwise": 0}
        updates = {}
        for gvar, func in graph_functions(mod):
            if not isinstance(func.body, relax.SeqExpr):
                continue
            groups = _Planner(func, self.opts).plan()
            if not groups:
                continue
            _finish_groups(func, groups)
            new_func = _Rewriter(mod, groups, self.output_op).visit_expr(func)
            updates[gvar] = relax.analysis.remove_all_unused(new_func)
            for g in groups:
                stats["groups"] += 1
                stats["branches"] += len(g.branches)
                stats[g.kind] += 1
        if not updates:
            return mod
        mod = mod.clone()  # never mutate the caller's module
        for gvar, func in updates.items():
            mod[gvar] = func
        prev = mod.get_attr(ATTR_KEY) if mod.attrs is not None else None
        if prev is not None:
            for k in stats:
                stats[k] += int(prev.get(k, 0))
        return mod.with_attr(ATTR_KEY, {k: tvm.tirx.IntImm("int64", v) for k, v in stats.items()})


def count_horizontal_groups(mod: tvm.IRModule) -> dict:
    """What HorizontalFuse did: the module attribute if present, else a structural count.

    The structural fallback (for modules where a later pass dropped the attribute, before
    FuseOps) counts ``split``s, or sets of >= 2 ``strided_slice``s of one tensor, whose input is
    a matmul/conv2d (optionally through a constant bias add) or a unary op applied to a
    ``concat`` - the shapes this pass emits - in every Relax function of ``mod``.
    """
    attr = mod.get_attr(ATTR_KEY) if mod.attrs is not None else None
    if attr is not None:
        return {k: int(v) for k, v in attr.items()}
    stats = {"groups": 0, "branches": 0, "matmul": 0, "conv2d": 0, "elementwise": 0}
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        var2val = relax.analysis.get_var2val(func)
        outputs: dict = {}  # source var -> number of branches read from it
        for value in var2val.values():
            name = op_name(value)
            if name not in ("relax.split", "relax.strided_slice") or not isinstance(value.args[0], relax.Var):
                continue
            n = len(value.ty.fields) if name == "relax.split" else 1
            outputs[value.args[0]] = outputs.get(value.args[0], 0) + n
        for src_var, n in outputs.items():
            kind = _source_kind(src_var, var2val)
            if kind is None or n < 2:
                continue
            stats["groups"] += 1
            stats[kind] += 1
            stats["branches"] += n
    return stats


def _source_kind(var, var2val) -> str | None:
    src = var2val.get(var)
    if op_name(src) in _ELEMWISE_OPS and isinstance(src.args[0], relax.Var):
        src = var2val.get(src.args[0])  # elementwise group's op, or a carried activation
        if op_name(src) == "relax.concat":
            return "elementwise"
    if op_name(src) == _ADD:
        a, b = src.args
        inner = a if isinstance(a, relax.Var) and is_constant(b) else b
        src = var2val.get(inner) if isinstance(inner, relax.Var) else None
    return {_MATMUL: "matmul", _CONV2D: "conv2d"}.get(op_name(src))
