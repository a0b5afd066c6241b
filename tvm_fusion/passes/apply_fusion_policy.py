"""ApplyFusionPolicy: group high-level Relax ops into fused kernels, as a FusionPolicy decides.

Stock ``FuseOps`` fuses by TIR op-pattern kinds with a fixed rule set and no cost model. This pass
works one level up, on named Relax ops (conv2d, matmul, add, gelu, layer_norm ...), so the rules are
a readable table, and every decision can be explained. It runs *before* ``LegalizeOps``:

    ApplyFusionPolicy -> LegalizeOps -> AnnotateTIROpPattern -> FuseTIR

Each group becomes a private Relax function with ``Primitive=True``; after legalisation
``FuseTIR`` turns it into one PrimFunc, so one group is one kernel. Groups are chains: a consumer
joins the group that ends with its producer. Chains through single-consumer intermediates are
always convex, so outlining them can never create a cycle.

``explain(mod)`` runs the same planning without rewriting and reports each group formed and why
each rejected candidate was rejected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import tvm
from tvm import relax

from ..ir import count_uses, graph_functions, reads_pieces_in_place
from ..policy import (
    CONCAT_READERS,
    ELEMENTWISE,
    FLOPS_PER_ELEMENT,
    FREE_REMAPS,
    INDEX_REMAPS,
    REDUCTION_PASSES,
    FusionPolicy,
    Roofline,
)
from ..targets import parse_target

# A symbolic dimension is priced as this many elements (decisions must not depend on run-time shapes).
SYMBOLIC_DIM_GUESS = 32


@dataclasses.dataclass
class Node:
    """One fusable binding: ``var = op(args...)`` with a single tensor result."""

    var: relax.Var
    call: relax.Call
    op_name: str  # without the "relax." prefix
    op_class: str | None


@dataclasses.dataclass
class Group:
    nodes: list[Node]
    has_anchor: bool = False

    @property
    def last(self) -> Node:
        return self.nodes[-1]

    @property
    def depth(self) -> int:
        """Ops that count toward ``max_fusion_depth``: views (reshape, squeeze, ...), slices and
        concats are free index remaps (fused into their readers, they write nothing: the readers
        read the data in place), so one in the chain leaves room for the op after it."""
        return sum(n.op_class not in FREE_REMAPS for n in self.nodes)

    @property
    def name(self) -> str:
        return "fused_" + "_".join(n.op_name.split(".")[-1] for n in self.nodes)


@dataclasses.dataclass
class Decision:
    """One producer -> consumer candidate edge and what the policy made of it."""

    producer: str
    consumer: str
    accepted: bool
    reason: str
    benefit_us: float | None = None


@dataclasses.dataclass
class FusionReport:
    function: str
    groups: list[Group]
    decisions: list[Decision]

    @property
    def fused_groups(self) -> list[Group]:
        return [g for g in self.groups if len(g.nodes) > 1]

    def __str__(self) -> str:
        lines = [
            f"function {self.function}: {len(self.groups)} kernels from "
            f"{sum(len(g.nodes) for g in self.groups)} ops, {len(self.fused_groups)} fused groups"
        ]
        for group in self.fused_groups:
            lines.append(
                f"  group {group.name}: " + " -> ".join(f"{n.var.name}={n.op_name}" for n in group.nodes)
            )
        rejected = [d for d in self.decisions if not d.accepted]
        if rejected:
            lines.append("  rejected candidates:")
            for d in rejected:
                lines.append(f"    {d.producer} -> {d.consumer}: {d.reason}")
        return "\n".join(lines)


class FusionPlanner:
    """Decides the groups of one Relax function (pure analysis, no rewriting)."""

    def __init__(self, policy: FusionPolicy, roofline: Roofline):
        self.policy = policy
        self.roofline = roofline

    def plan(self, name: str, func: relax.Function) -> FusionReport:
        uses = count_uses(func)
        groups: list[Group] = []
        decisions: list[Decision] = []
        for block in func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                self._plan_block(block, uses, groups, decisions)
        return FusionReport(name, groups, decisions)

    def _plan_block(self, block, uses, groups, decisions) -> None:
        group_of: dict[relax.Var, Group] = {}
        for binding in block.bindings:
            node = _as_node(binding, self.policy)
            if node is None:
                continue
            candidates: list[tuple[Decision, Group]] = []
            for arg in _tensor_var_args(node.call):
                group = group_of.get(arg)
                if group is None or not group.last.var.same_as(arg):
                    continue  # groups are chains: only a group's last op can be extended
                decision = self._judge(group, node, arg, uses)
                decisions.append(decision)
                if decision.accepted:
                    candidates.append((decision, group))
            if candidates:
                chosen, group = max(candidates, key=lambda c: c[0].benefit_us)
                for decision, _ in candidates:
                    if decision is not chosen:
                        decision.accepted = False
                        decision.reason = "another producer of this consumer gave a larger benefit"
                group.nodes.append(node)
            else:
                group = Group([node])
                groups.append(group)
            group.has_anchor |= self.policy.is_anchor(node.op_class)
            group_of[node.var] = group

    def _judge(self, group: Group, consumer: Node, arg: relax.Var, uses) -> Decision:
        producer = group.last
        edge = dict(
            producer=f"{producer.var.name}={producer.op_name}",
            consumer=f"{consumer.var.name}={consumer.op_name}",
        )
        policy = self.policy
        if not policy.allows(producer.op_class, consumer.op_class):
            pair = f"{producer.op_class or producer.op_name} -> {consumer.op_class or consumer.op_name}"
            return Decision(**edge, accepted=False, reason=f"pair {pair} is not in the policy table")
        if uses.get(arg, 0) != 1:
            return Decision(
                **edge,
                accepted=False,
                reason=f"producer output has {uses.get(arg, 0)} consumers (unique-consumer rule)",
            )
        if consumer.op_class not in FREE_REMAPS and group.depth >= policy.max_fusion_depth:
            return Decision(
                **edge,
                accepted=False,
                reason=f"group already has max_fusion_depth={policy.max_fusion_depth} ops "
                "(views, slices and concats not counted)",
            )
        if producer.op_class == "concat" and consumer.op_class in CONCAT_READERS:
            if not (consumer.call.args[0].same_as(arg) and reads_pieces_in_place(consumer.call)):
                return Decision(
                    **edge,
                    accepted=False,
                    reason="only a pool or a 1x1 conv reads a concat's pieces in place",
                )
        if group.has_anchor and policy.is_anchor(consumer.op_class):
            return Decision(**edge, accepted=False, reason="group already holds an anchor op (conv/gemm)")
        if group.has_anchor and consumer.op_class not in policy.epilogue_classes:
            return Decision(
                **edge, accepted=False, reason=f"{consumer.op_class} is not an epilogue class after an anchor"
            )
        benefit, detail = self.benefit_us(producer, consumer, arg)
        if policy.use_cost_model and benefit < policy.benefit_threshold_us:
            return Decision(
                **edge,
                accepted=False,
                reason=f"cost model: benefit {benefit:.2f} us < threshold "
                f"{policy.benefit_threshold_us:.2f} us ({detail})",
                benefit_us=benefit,
            )
        return Decision(**edge, accepted=True, reason=detail, benefit_us=benefit)

    def benefit_us(self, producer: Node, consumer: Node, arg: relax.Var) -> tuple[float, str]:
        """Roofline price of fusing the edge producer -> consumer, in microseconds saved."""
        numel, itemsize = _numel(arg), _itemsize(arg)
        intermediate = numel * itemsize
        saved_bytes = 2.0 * intermediate  # the producer's write and the consumer's read
        extra_flops = 0.0
        inlinable = producer.op_class in (*ELEMENTWISE, *INDEX_REMAPS)
        reads = _reads_per_element(consumer, arg)
        if reads > 1 and inlinable:
            # The schedule inlines the producer into the consumer's loads: it is recomputed per read.
            extra_flops = FLOPS_PER_ELEMENT.get(producer.op_name, 1.0) * numel * (reads - 1)
        elif reads > 1 and intermediate > self.roofline.cache_bytes:
            saved_bytes = 0.0  # materialised inside the kernel, but it does not stay in cache
        roof = self.roofline
        benefit = (
            saved_bytes / (roof.bandwidth_gbps * 1e3)
            - extra_flops / (roof.peak_gflops * 1e3)
            + roof.launch_overhead_us
        )
        detail = f"saves {saved_bytes / 1024:.0f} KiB, recomputes {extra_flops / 1e6:.2f} MFLOP"
        return benefit, detail


# -- IR helpers -------------------------------------------------------------------------------
def _as_node(binding, policy: FusionPolicy) -> Node | None:
    if not isinstance(binding, relax.VarBinding):
        return None
    call = binding.value
    if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
        return None
    if not isinstance(binding.var.ty, relax.TensorType) or binding.var.ty.dtype == "":
        return None
    op_name = call.op.name.removeprefix("relax.")
    namespace = op_name.split(".")[0] if "." in op_name else ""
    if op_name.startswith("call_") or namespace not in ("", "nn", "image"):
        return None  # call_tir/call_dps_packed, builtin/memory/vm ops: not tensor compute to regroup
    return Node(binding.var, call, op_name, policy.op_class(op_name))


def _tensor_var_args(call: relax.Call) -> Iterable[relax.Var]:
    seen = []
    for arg in call.args:
        for item in arg.fields if isinstance(arg, relax.Tuple) else [arg]:
            if isinstance(item, relax.Var) and item not in seen:
                seen.append(item)
    return seen


def _shape(expr) -> list[int]:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
        return [SYMBOLIC_DIM_GUESS]
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else SYMBOLIC_DIM_GUESS for d in ty.shape.values]


def _numel(expr) -> int:
    return int(np.prod(_shape(expr), dtype=np.int64))


def _itemsize(expr) -> int:
    try:
        return np.dtype(str(expr.ty.dtype)).itemsize
    except TypeError:
        return 4


def _reads_per_element(consumer: Node, arg: relax.Var) -> float:
    """How often the consumer reads each element of ``arg`` (1 for elementwise consumers)."""
    name, args = consumer.op_name, list(consumer.call.args)
    if name == "matmul" and len(args) == 2:
        a, b = _shape(args[0]), _shape(args[1])
        return float(b[-1] if args[0].same_as(arg) else int(np.prod(a[:-1])))
    if name.startswith("nn.conv") and len(args) >= 2:
        w = _shape(args[1])
        if args[0].same_as(arg):
            groups = int(getattr(consumer.call.attrs, "groups", 1))
            strides = [int(s) for s in getattr(consumer.call.attrs, "strides", [1])]
            return max(1.0, w[0] / groups * float(np.prod(w[2:])) / float(np.prod(strides)))
        out = _shape(consumer.var)
        return float(out[0] * np.prod(out[2:]))
    return float(REDUCTION_PASSES.get(name, 1))


# -- the pass ---------------------------------------------------------------------------------
def _target_or_current(target):
    if target is not None:
        return parse_target(target)
    return tvm.target.Target.current(allow_none=True)


def _planned_functions(mod: tvm.IRModule):
    return ((gvar, func) for gvar, func in graph_functions(mod) if isinstance(func.body, relax.SeqExpr))


def explain(mod: tvm.IRModule, policy: FusionPolicy | dict | None = None, target=None) -> str:
    """A readable report of the groups ApplyFusionPolicy would form and why candidates were
    rejected, and of each attention block: fused by FuseAttention (or already one op), or why not."""
    from .fuse_attention import attention_decisions

    mod = without_aliases(mod)
    reports = _plan(mod, policy, target)
    attention = attention_decisions(mod, policy)
    lines = []
    for report in reports:
        lines.append(str(report))
        lines += [f"  {d}" for d in attention if d.function == report.function]
    return "\n".join(lines)


def without_aliases(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its ``y = x`` bindings resolved (``CanonicalizeBindings``): the planner extends
    a group only by readers of its last op's var, so such a binding would end the chain at ``x``.
    The pipeline's only ``CanonicalizeBindings`` is in its BN-folding step: with
    ``fold_batch_norm=False``, or after a user's own passes, such bindings can reach the planner."""
    return relax.transform.CanonicalizeBindings()(mod)


def plan_module(mod: tvm.IRModule, policy=None, target=None) -> list[FusionReport]:
    """The groups :class:`ApplyFusionPolicy` forms in each graph function of ``mod`` (``y = x``
    bindings resolved first, as the pass does)."""
    return _plan(without_aliases(mod), policy, target)


def _plan(mod: tvm.IRModule, policy, target) -> list[FusionReport]:
    target = _target_or_current(target)
    policy = FusionPolicy.coerce(policy).for_target(target)
    planner = FusionPlanner(policy, policy.roofline or Roofline.for_target(target))
    return [planner.plan(gvar.name_hint, func) for gvar, func in _planned_functions(mod)]


@tvm.transform.module_pass(opt_level=0, name="ApplyFusionPolicy")
class ApplyFusionPolicy:
    """Outline each multi-op group the policy forms into a ``Primitive`` function (one kernel).

    Parameters
    ----------
    policy : FusionPolicy | dict | path | None
        The fusion rules; None means ``FusionPolicy()`` defaults.
    target : Target | str | dict | None
        Picks the cost model's roofline preset; None uses the target in scope (``with target:``).
    """

    def __init__(self, policy: FusionPolicy | dict | None = None, target=None):
        self.policy = FusionPolicy.coerce(policy)
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = without_aliases(mod)  # the module the reports' vars belong to
        reports = _plan(mod, self.policy, self.target)
        builder = relax.BlockBuilder(mod)
        updates = {}
        for (gvar, func), report in zip(list(_planned_functions(mod)), reports):
            groups = [g for g in report.fused_groups]
            if groups:
                updates[gvar] = _outline(func, groups, builder)
        new_mod = builder.get()
        for gvar, func in updates.items():
            new_mod[gvar] = func
        return relax.transform.Normalize()(new_mod)


def _outline(func: relax.Function, groups: list[Group], builder: relax.BlockBuilder) -> relax.Function:
    """Replace each group's bindings by one call of a new Primitive function."""
    last_of = {}
    inner = set()
    for group in groups:
        made = _make_group_function(group)
        if made is None:
            continue
        prim, inputs = made
        gvar = builder.add_func(prim, group.name)
        last_of[group.last.var] = relax.Call(gvar, inputs)
        inner.update(n.var for n in group.nodes[:-1])
    blocks = []
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            blocks.append(block)
            continue
        bindings = []
        for binding in block.bindings:
            if binding.var in inner:
                continue
            if binding.var in last_of:
                binding = relax.VarBinding(binding.var, last_of[binding.var])
            bindings.append(binding)
        blocks.append(relax.DataflowBlock(bindings))
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def _make_group_function(group: Group):
    """Build ``fused_*(inputs) { ops }``; constants become parameters (FuseTIR requires it)."""
    inputs: list[relax.Expr] = []
    params: list[relax.Var] = []
    defined = {n.var for n in group.nodes}

    def param_for(expr):
        for i, known in enumerate(inputs):
            if known.same_as(expr):
                return params[i]
        inputs.append(expr)
        params.append(relax.Var(f"p{len(params)}", expr.ty))
        return params[-1]

    mapping: dict[relax.Var, relax.Expr] = {}

    def substitute(expr):
        if isinstance(expr, relax.Var):
            return mapping[expr] if expr in defined else param_for(expr)
        if isinstance(expr, tvm.ir.GenericConst):
            return param_for(expr)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([substitute(f) for f in expr.fields])
        return expr

    bb = relax.BlockBuilder()
    with bb.function(group.name, None, {"Primitive": True}, private=True):
        with bb.dataflow():
            for node in group.nodes:
                call = node.call
                new_call = relax.Call(call.op, [substitute(a) for a in call.args], call.attrs, call.ty_args)
                emit = bb.emit_output if node is group.last else bb.emit
                mapping[node.var] = emit(new_call, name_hint=node.var.name)
        bb.emit_func_output(mapping[group.last.var], params=params)
    func = bb.get()[group.name]
    if relax.analysis.free_symbolic_vars(func):
        return None  # a shape in the body refers to a symbolic var no parameter defines
    return func, inputs
