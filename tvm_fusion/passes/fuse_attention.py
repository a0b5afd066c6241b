"""FuseAttention: scaled-dot-product attention, as exporters write it, becomes one fused function.

Exporters spell attention as five to fifteen ops: ``Q.K^T``, scales, mask arithmetic, softmax,
``.V``, with reshape/transpose head split and merge around them. Run op by op, the scores
(``batch x heads x S_q x S_kv``) are written to memory and read back twice, which dominates
time and memory at long sequences; ApplyFusionPolicy will not fuse the block (two contractions
in one group). This pass finds the blocks with the Relax pattern language (``relax.dpl``) and
outlines each into one ``Primitive`` function ``fused_attention`` whose attribute
``"tvm_fusion.attention"`` is an :class:`~tvm_fusion.schedules.attention.AttentionSpec`. Its body
is the block's own computation, so without further lowering ``LegalizeOps`` + ``FuseTIR`` make
it one (plain) kernel; ``LowerAttention`` (in ``tvm_fusion.schedules``, part of the pipeline)
replaces it by the FlashAttention-style kernel for the target, which never materialises the
scores.

Matched (``q``, ``k^T``, ``v`` 3-D ``(B*N, S, D)`` or 4-D ``(B, N, S, D)``):

* ``matmul(q, k^T)``; scalar-constant scales on ``q`` and/or ``k^T`` (the SDPA decomposition of
  both torch exporters scales both by ``sqrt(scale)``) and/or one ``multiply``/``divide`` of the
  scores by a scalar constant (``/ sqrt(d)`` in HF eager attention);
* up to two mask stages, in any order: ``add`` of a bias broadcasting per key (HF
  BERT/RoBERTa/DistilBERT's extended mask ``(1 - mask) * finfo.min``, T5's position bias, the
  SDPA decomposition's ``where(mask4d, 0, finfo.min)``), and ``where(causal, scores, fill)`` /
  ``where(~causal, fill, scores)`` with a constant lower-triangular condition and a constant
  fill ``<= -1e4`` (GPT-2 eager). A bias ``where(logical_and(C, m), 0, fill)`` whose constant
  ``C`` is all true or causal is split into ``where(m, 0, fill)`` (per key, not ``S x S``) plus
  the causal stage (exact for ``fill = finfo.min`` or ``-inf``: ``s + finfo.min == finfo.min``
  for ``|s| < 1e31``); a constant additive mask that is 0 on and below the diagonal and
  ``finfo.min`` / ``-inf`` above becomes the causal stage;
* ``softmax`` over the last axis, optionally ``where(isnan(p), 0, p)`` (the SDPA decomposition's
  guard for fully masked rows), then ``matmul(p, v)``.

Layout: ``q``, ``k``, ``v`` are taken in BSNH from before the exporter's head-split transposes
(also through the reshapes to ``(B*N, S, D)`` and back that the SDPA decomposition inserts, and
single-input concats); the result's head-merge transposes are folded into one (or none).

Declined blocks keep their ops, and ``explain()`` says why: dtype not float32, symbolic shapes
(kernels are specialised on static shapes), softmax over another axis, an intermediate with
another consumer (e.g. returned attention probabilities), a scale that is not a scalar constant
or comes after the mask, a bias that does not broadcast per key, a ``where`` that is not a
constant causal triangle, more than two biases.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ..ir import constant_value, count_uses, is_constant, scalar_value, static_shape
from ..policy import FusionPolicy
from ..schedules.attention import ATTENTION_OPS, MAX_BIASES, SPEC_ATTR, AttentionSpec, fused_attention_spec

ATTR_KEY = "tvm_fusion.fuse_attention"
FUNCTION_NAME = "fused_attention"
MASK_STAGES = 2  # bias adds / causal wheres between the scores and the softmax
LARGE_NEGATIVE = -1.0e4  # a where-fill at most this excludes: exp(fill - rowmax) == 0 in float32
HUGE_NEGATIVE = -1.0e38  # finfo.min-like: s + fill == fill for any realistic score


@dataclasses.dataclass
class AttentionDecision:
    """What FuseAttention made of one attention block (named by its softmax's variable)."""

    function: str
    block: str
    fused: bool
    reason: str

    def __str__(self) -> str:
        return f"attention {self.block}: {'fused' if self.fused else 'not fused'} ({self.reason})"


class _Pattern:
    """The dpl pattern of an attention block with ``stages`` mask stages."""

    def __init__(self, stages: int):
        self.q, self.k, self.v = wildcard(), wildcard(), wildcard()
        self.scores = is_op("relax.matmul")(self.q, self.k)
        self.scale = is_const()
        self.scales = {
            "mul": is_op("relax.multiply")(self.scores, self.scale),
            "rmul": is_op("relax.multiply")(self.scale, self.scores),
            "div": is_op("relax.divide")(self.scores, self.scale),
        }
        x = self.scores
        for pat in self.scales.values():
            x = x | pat
        self.stages = []
        for _ in range(stages):
            other, cond = wildcard(), wildcard()
            stage = {
                "add": is_op("relax.add")(x, other),
                "radd": is_op("relax.add")(other, x),
                "keep": is_op("relax.where")(cond, x, other),
                "drop": is_op("relax.where")(cond, other, x),
            }
            self.stages.append((stage, other, cond))
            x = stage["add"] | stage["radd"] | stage["keep"] | stage["drop"]
        self.softmax = is_op("relax.nn.softmax")(x)
        self.nan_zero = is_const()
        self.nan_fix = is_op("relax.where")(is_op("relax.isnan")(self.softmax), self.nan_zero, self.softmax)
        self.context = is_op("relax.matmul")(self.softmax | self.nan_fix, self.v)


@dataclasses.dataclass
class _Match:
    q: relax.Expr
    k_t: relax.Expr
    v: relax.Expr
    scores: relax.Call
    scale_call: relax.Call | None
    stages: list  # [(kind, call, other, cond)], from the scores to the softmax
    softmax: relax.Call
    nan_fix: relax.Call | None
    context: relax.Call


@dataclasses.dataclass
class _Plan:
    """A matched block, checked, in the terms the rewrite needs."""

    match: _Match
    spec: AttentionSpec
    q: relax.Expr  # BSNH
    k: relax.Expr
    v: relax.Expr
    biases: list
    keep: np.ndarray | None  # the causal mask, for the reference body
    rank: int
    summary: str
    block: str  # the softmax's variable name


class _Analysis:
    """Matching and checking of the attention blocks of one function (no rewriting)."""

    def __init__(self, name: str, func: relax.Function):
        self.name = name
        self.func = func
        self.var2val = relax.analysis.get_var2val(func)
        self.var_of = {value: var for var, value in self.var2val.items()}
        self.uses = count_uses(func)
        self.decisions: dict[str, AttentionDecision] = {}
        self.plans: dict[relax.Var, _Plan] = {}  # context var -> plan
        for stages in range(MASK_STAGES, -1, -1):
            pattern = _Pattern(stages)
            rewrite_call(pattern.context, self._collector(pattern), func)

    def _collector(self, p: _Pattern):
        def collect(orig, m):
            match = self._match(p, m, orig)
            name = self._name(match.softmax)
            if name not in self.decisions:
                plan = self._plan(match)
                if isinstance(plan, str):
                    self.decisions[name] = AttentionDecision(self.name, name, False, plan)
                else:
                    self.decisions[name] = AttentionDecision(self.name, name, True, plan.summary)
                    self.plans[self.var_of[orig]] = plan
            return orig

        return collect

    def _match(self, p: _Pattern, m, orig) -> _Match:
        stages = []  # p.stages runs from the scores outwards
        for stage, other, cond in p.stages:
            for kind, pat in stage.items():
                if pat in m:
                    stages.append((kind, m[pat], m[other], m.get(cond)))
                    break
        scale_call = next((m[s] for s in p.scales.values() if s in m), None)
        nan_fix = m[p.nan_fix] if p.nan_fix in m else None
        return _Match(m[p.q], m[p.k], m[p.v], m[p.scores], scale_call, stages, m[p.softmax], nan_fix, orig)

    def _name(self, call) -> str:
        var = self.var_of.get(call)
        return var.name if var is not None else f"softmax@{id(call)}"

    # -- checks ---------------------------------------------------------------------------
    def _plan(self, mt: _Match):
        """A _Plan, or the reason the block is declined."""
        if str(mt.scores.ty.dtype) != "float32":
            return f"dtype {mt.scores.ty.dtype}: the fused kernel is float32"
        for role, expr in (("q", mt.q), ("k^T", mt.k_t), ("v", mt.v), ("scores", mt.scores)):
            if _shape(expr) is None:
                return f"{role} has a symbolic shape; the fused kernel is specialised on static shapes"
        q_shape, k_shape, v_shape = _shape(mt.q), _shape(mt.k_t), _shape(mt.v)
        rank = len(q_shape)
        if rank not in (3, 4) or len(k_shape) != rank or len(v_shape) != rank:
            return f"matmul operands of rank {rank}: expected (B*N, S, D) or (B, N, S, D)"
        if q_shape[:-2] != k_shape[:-2] or q_shape[:-2] != v_shape[:-2]:
            return f"q, k, v batch dims differ ({q_shape}, {k_shape}, {v_shape})"
        seq_q, head_dim, seq_kv, head_dim_v = q_shape[-2], q_shape[-1], k_shape[-1], v_shape[-1]
        if k_shape[-2] != head_dim or v_shape[-2] != seq_kv:
            return "q.k^T.v shapes do not chain"
        axis = int(mt.softmax.attrs.axis)
        if axis not in (-1, rank - 1):
            return f"softmax over axis {axis}, not the key axis {rank - 1}"
        inner = [mt.scores, *(s[1] for s in mt.stages)]
        if mt.scale_call is not None:
            inner.append(mt.scale_call)
        allowed = {self.var_of.get(mt.softmax): 1}
        if mt.nan_fix is not None:  # p feeds isnan(p) and the where
            allowed[self.var_of.get(mt.softmax)] = 2
            inner.append(mt.nan_fix.args[0])
        inner.append(mt.softmax)
        for call in inner:
            var = self.var_of.get(call)
            if var is not None and self.uses.get(var, 0) > allowed.get(var, 1):
                return f"{var.name} ({call.op.name.removeprefix('relax.')}) has other consumers"
        if mt.nan_fix is not None and scalar_value(mt.nan_fix.args[1]) != 0.0:
            return "the probabilities' NaN guard does not write 0"
        scale = 1.0
        if mt.scale_call is not None:
            value = scalar_value(next(a for a in mt.scale_call.args if is_constant(a)))
            if value is None:
                return "the score scale is not a scalar constant"
            scale = 1.0 / value if mt.scale_call.op.name == "relax.divide" else value
        q, q_scale = self._strip_scale(mt.q)
        k_t, k_scale = self._strip_scale(mt.k_t)
        scale *= q_scale * k_scale
        if not math.isfinite(scale) or scale == 0.0:
            return f"score scale {scale}"
        scores_shape = [*q_shape[:-1], seq_kv]
        biases, causal, before = [], None, 0
        # an added mask is read as "causal + per-key part" only when it is the block's one mask
        # stage: s + finfo.min == finfo.min, but next to another mask (say of -inf) it would not be
        split = len(mt.stages) == 1
        for kind, _call, other, cond in mt.stages:
            if kind in ("add", "radd"):
                parts = self._bias_parts(other, seq_q, seq_kv, scores_shape, split)
                if isinstance(parts, str):
                    return parts
                for part in parts:
                    if isinstance(part[0], int):  # (offset, fill)
                        causal, before = part, len(biases)
                    else:
                        biases.append(part)
                continue
            found = self._causal_where(kind, cond, other, seq_q, seq_kv)
            if isinstance(found, str):
                return found
            if causal is not None:
                return "two causal masks"
            causal, before = found, len(biases)
        if len(biases) > MAX_BIASES:
            return f"{len(biases)} additive masks; the kernel takes at most {MAX_BIASES}"
        if rank == 4:
            batch, heads = q_shape[0], q_shape[1]
            views = [self._to_bsnh(q, [0, 2, 1, 3], q_shape), self._to_bsnh(k_t, [0, 3, 1, 2], k_shape),
                     self._to_bsnh(mt.v, [0, 2, 1, 3], v_shape)]  # fmt: skip
            bias_shapes = [tuple([1] * (4 - len(shape)) + shape) for _, shape in biases]
        else:  # (B*N, S, D): one head per batch row
            batch, heads = q_shape[0], 1
            views = [relax.op.reshape(q, [batch, seq_q, 1, head_dim]),
                     relax.op.reshape(self._to_bsnh(k_t, [0, 2, 1], k_shape), [batch, seq_kv, 1, head_dim]),
                     relax.op.reshape(mt.v, [batch, seq_kv, 1, head_dim_v])]  # fmt: skip
            bias_shapes = []
            for _, shape in biases:
                padded = [1] * (3 - len(shape)) + shape
                bias_shapes.append((padded[0], 1, padded[1], padded[2]))
        offset, fill = causal if causal is not None else (None, -math.inf)
        spec = AttentionSpec(batch, heads, seq_q, seq_kv, head_dim, head_dim_v, scale, tuple(bias_shapes),
                             offset, fill, before, mt.nan_fix is not None)  # fmt: skip
        biases = [
            b if tuple(shape) == s else relax.op.reshape(b, list(s))
            for (b, shape), s in zip(biases, bias_shapes)
        ]
        keep = None
        if offset is not None:
            keep = (np.arange(seq_kv)[None, :] <= np.arange(seq_q)[:, None] + offset).reshape(
                1, 1, seq_q, seq_kv
            )
        return _Plan(mt, spec, *views, biases, keep, rank, spec.describe(), self._name(mt.softmax))

    def _strip_scale(self, expr):
        """(operand, scale): scalar-constant multiplies producing a matmul operand folded into
        one score scale (a multiply behind a transpose stays where it is)."""
        scale = 1.0
        for _ in range(4):
            mul = self._call_of(expr, "relax.multiply")
            if mul is None or sum(is_constant(a) for a in mul.args) != 1:
                break
            value = scalar_value(next(a for a in mul.args if is_constant(a)))
            if value is None:
                break
            scale *= value
            expr = next(a for a in mul.args if not is_constant(a))
        return expr, scale

    def _to_bsnh(self, expr, perm: list[int], shape: list[int]):
        """``permute_dims(expr, perm)`` (a BSNH tensor), composed with the transposes and
        batch-merging reshapes that produced ``expr``, so an exporter's head split cancels."""
        rank = len(perm)
        logical = list(shape)  # the 4-D (or 3-D) shape ``expr`` is viewed as
        for _ in range(12):
            if perm == list(range(rank)) and len(_shape(expr) or []) == rank:
                return expr
            value = self._value(expr)
            if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
                break
            name = value.op.name
            src = value.args[0]
            src_shape = _shape(src)
            if src_shape is None:
                break
            if name == "relax.concat" and isinstance(src, relax.Tuple) and len(src.fields) == 1:
                expr = src.fields[0]
                continue
            if name == "relax.reshape" and _same_view(src_shape, logical):
                expr = src
                continue
            if name == "relax.permute_dims":
                axes = _axes(value, len(src_shape))
                if len(src_shape) == rank:
                    axes_r = axes
                elif len(src_shape) == rank - 1 and rank == 4 and _same_view(_shape(expr) or [], logical):
                    axes_r = None  # a 3-D permute of a view: only the leading-unit / merged forms
                    if logical[0] == 1:
                        axes_r = [0] + [a + 1 for a in axes]
                    elif axes[0] == 0:
                        axes_r = [0, 1] + [a + 1 for a in axes[1:]]
                    if axes_r is None:
                        break
                else:
                    break
                new_logical = [0] * rank
                for i, a in enumerate(axes_r):
                    new_logical[a] = logical[i]
                if len(src_shape) != rank and not _same_view(src_shape, new_logical):
                    break
                perm = [axes_r[p] for p in perm]
                logical = new_logical
                expr = src
                continue
            break
        if len(_shape(expr) or []) != rank:
            expr = relax.op.reshape(expr, logical)
        if perm == list(range(rank)):
            return expr
        return _permute_or_reshape(expr, perm, logical)

    def _bias_parts(self, other, seq_q, seq_kv, scores_shape, split: bool):
        """An added mask as [(bias, shape)] or, with ``split``, [(per-key bias, shape),
        (offset, fill)] / [(offset, fill)] when it hides a causal triangle; or why not."""
        value = constant_value(other, self.var2val) if split else None
        if value is not None and value.dtype.kind == "f":
            found = _causal_additive(value, seq_q, seq_kv)
            if found is not None:
                return [found]
        where = self._call_of(other, "relax.where")
        if where is not None and scalar_value(where.args[1]) == 0.0:
            fill = scalar_value(where.args[2])
            cond = where.args[0]
            land = self._call_of(cond, "relax.logical_and")
            if fill is not None and (fill == -math.inf or fill <= HUGE_NEGATIVE) and land is not None:
                consts = [a for a in land.args if constant_value(a, self.var2val) is not None]
                if len(consts) == 1:
                    rest = next(a for a in land.args if not a.same_as(consts[0]))
                    keep = constant_value(consts[0], self.var2val)
                    small = relax.op.where(rest, relax.const(0.0, "float32"), relax.const(fill, "float32"))
                    rest_shape = _shape(rest)
                    if (
                        keep.dtype == np.bool_
                        and rest_shape is not None
                        and _broadcasts(rest_shape, scores_shape)
                    ):
                        if bool(np.all(keep)):  # where(True & m, 0, fill) is where(m, 0, fill)
                            return [(small, rest_shape)]
                        offset = _tril_offset(keep, seq_q, seq_kv) if split else None
                        if offset is not None:
                            return [(small, rest_shape), (offset, fill)]
        shape = _shape(other)
        if shape is None or str(other.ty.dtype) != "float32":
            return "the additive mask is not a static float32 tensor"
        if not _broadcasts(shape, scores_shape):
            return f"the additive mask of shape {shape} does not broadcast to the scores {scores_shape}"
        return [(other, shape)]

    def _causal_where(self, kind, cond, fill, seq_q, seq_kv):
        """(offset, fill) of ``where(keep, x, fill)`` / ``where(drop, fill, x)``, or why not."""
        cond_value = constant_value(cond, self.var2val)
        if cond_value is None or cond_value.dtype != np.bool_:
            return "where with a condition that is not a constant (not a causal mask)"
        fill_value = scalar_value(fill, self.var2val)
        if fill_value is None or fill_value > LARGE_NEGATIVE:
            return f"where fills {fill_value}, not a large negative constant (<= {LARGE_NEGATIVE:g})"
        keep = cond_value if kind == "keep" else ~cond_value
        offset = _tril_offset(keep, seq_q, seq_kv)
        if offset is None:
            return "where with a constant condition that is not a causal (lower-triangular) mask"
        return offset, fill_value

    # -- helpers --------------------------------------------------------------------------
    def _value(self, expr):
        return self.var2val.get(expr, expr) if isinstance(expr, relax.Var) else expr

    def _call_of(self, expr, name):
        value = self._value(expr)
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name:
            return value
        return None


# -- small helpers ------------------------------------------------------------------------------
def _shape(expr) -> list[int] | None:
    dims = static_shape(expr)
    return None if dims is None else list(dims)


def _axes(call: relax.Call, rank: int) -> list[int]:
    axes = call.attrs.axes
    return list(range(rank))[::-1] if axes is None else [int(a) % rank for a in axes]


def _same_view(shape: list[int], logical: list[int]) -> bool:
    """Whether a row-major tensor of ``shape`` is the tensor ``logical`` (same elements in the
    same order): equal, equal up to leading unit dims, or with the two leading dims merged."""
    if list(shape) == list(logical):
        return True
    strip = lambda s: list(s)[next((i for i, d in enumerate(s) if d != 1), len(s)) :]  # noqa: E731
    if strip(shape) == strip(logical) and len(shape) != len(logical):
        return True
    if len(logical) == 4 and len(shape) == 3:
        return shape[0] == logical[0] * logical[1] and list(shape[1:]) == list(logical[2:])
    return False


def _permute_or_reshape(expr, perm, shape):
    """``permute_dims(expr, perm)``, or a free reshape when the permutation only moves unit dims."""
    moved = [a for a in perm if shape[a] != 1]
    if moved == sorted(moved):
        return relax.op.reshape(expr, [shape[a] for a in perm])
    return relax.op.permute_dims(expr, perm)


def _broadcasts(shape: list[int], target: list[int]) -> bool:
    if len(shape) > len(target):
        return False
    padded = [1] * (len(target) - len(shape)) + list(shape)
    return all(s in (1, t) for s, t in zip(padded, target)) and padded[-1] == target[-1]


def _tril_offset(keep: np.ndarray, seq_q: int, seq_kv: int) -> int | None:
    """``offset`` when ``keep`` (broadcast to (.., seq_q, seq_kv)) is ``j <= i + offset``."""
    if keep.ndim < 2 or keep.shape[-2:] != (seq_q, seq_kv) or any(d != 1 for d in keep.shape[:-2]):
        return None
    keep = keep.reshape(seq_q, seq_kv).astype(bool)
    offset = int(np.count_nonzero(keep[0])) - 1
    if offset < 0 or not np.array_equal(
        keep, np.arange(seq_kv)[None, :] <= np.arange(seq_q)[:, None] + offset
    ):
        return None
    return offset


def _causal_additive(value: np.ndarray, seq_q: int, seq_kv: int):
    """(offset, fill) for a constant mask that is 0 on and below the diagonal and one huge
    negative value (finfo.min-like or -inf) above it: adding it equals masking with that fill."""
    if value.ndim < 2 or value.shape[-2:] != (seq_q, seq_kv):
        return None
    keep = value == 0
    masked = value[~keep]
    if masked.size == 0 or not np.all(masked == masked.reshape(-1)[0]):
        return None
    fill = float(masked.reshape(-1)[0])
    if not (fill == -math.inf or fill <= HUGE_NEGATIVE):
        return None
    offset = _tril_offset(keep, seq_q, seq_kv)
    return None if offset is None else (offset, fill)


# -- unmatched candidates, for explain() --------------------------------------------------------
def _unmatched_reason(analysis: _Analysis, softmax: relax.Call) -> str | None:
    """Why no pattern matched at a softmax that looks like attention (its input comes from a
    matmul through elementwise ops), or None when it does not look like attention."""
    steps, expr = [], softmax.args[0]
    for _ in range(10):
        value = analysis._value(expr)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        if value.op.name == "relax.matmul":
            break
        steps.append(value.op.name.removeprefix("relax."))
        operands = [a for a in value.args if not is_constant(a) and _shape(a) is not None]
        if not operands:
            return None
        expr = max(operands, key=lambda a: int(np.prod(_shape(a))))  # the scores are the largest
    else:
        return None
    steps.reverse()
    allowed = {"add", "where"}
    for i, name in enumerate(steps):
        if name in ("multiply", "divide"):
            if i == 0:
                continue
            return f"the scores are scaled ({name}) after the mask"
        if name not in allowed:
            return f"the scores pass through {name}, which the pattern does not accept"
    if len(steps) - (steps[:1] in (["multiply"], ["divide"])) > MASK_STAGES:
        return f"more than {MASK_STAGES} mask stages between the scores and the softmax"
    return "the probabilities do not feed matmul(p, v) directly"


def _softmax_feeding_matmul(analysis: _Analysis):
    """Softmax calls whose result (possibly through a NaN guard) is the left operand of a matmul."""
    consumers: dict = {}
    lhs = set()
    for var, value in analysis.var2val.items():
        for used in relax.analysis.free_vars(value):
            consumers.setdefault(used, []).append(var)
        if (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.matmul"
        ):
            if isinstance(value.args[0], relax.Var):
                lhs.add(value.args[0])
    for var, value in analysis.var2val.items():
        if (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.nn.softmax"
        ):
            near = {var, *consumers.get(var, [])}
            near |= {c for u in list(near) for c in consumers.get(u, [])}
            if near & lhs:
                yield var, value


def _functions(mod: tvm.IRModule):
    for gvar, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        if func.attrs is not None and "Primitive" in func.attrs.keys():
            continue
        yield gvar, func


def attention_decisions(
    mod: tvm.IRModule, policy: FusionPolicy | dict | None = None
) -> list[AttentionDecision]:
    """Each attention block of ``mod`` and whether FuseAttention fuses it (or already did), with
    the reason; nothing is rewritten."""
    policy = FusionPolicy.coerce(policy)
    decisions = []
    for gvar, func in _functions(mod):
        analysis = _Analysis(gvar.name_hint, func)
        for var, value in analysis.var2val.items():
            if not isinstance(value, relax.Call):
                continue
            if isinstance(value.op, tvm.ir.Op) and value.op.name in ATTENTION_OPS:
                decisions.append(
                    AttentionDecision(gvar.name_hint, var.name, True, f"one op already ({value.op.name})")
                )
            elif isinstance(value.op, relax.GlobalVar) and value.op in mod.functions:
                spec = fused_attention_spec(mod[value.op])
                if spec is not None:
                    decisions.append(
                        AttentionDecision(
                            gvar.name_hint, var.name, True, f"{value.op.name_hint}: {spec.describe()}"
                        )
                    )
        found = dict(analysis.decisions)
        for var, softmax in _softmax_feeding_matmul(analysis):
            if var.name not in found:
                reason = _unmatched_reason(analysis, softmax)
                if reason is not None:
                    found[var.name] = AttentionDecision(gvar.name_hint, var.name, False, reason)
        for decision in found.values():
            if decision.fused and not policy.attention:
                decision.fused = False
                decision.reason = "the fusion policy's attention switch is off"
            decisions.append(decision)
    return decisions


# -- the rewrite --------------------------------------------------------------------------------
def _reference_function(plan: _Plan) -> relax.Function:
    """``fused_attention(q, k, v, *biases[, keep])``: the spec computed with plain ops, so that
    LegalizeOps + FuseTIR give one (unscheduled) kernel where LowerAttention has none."""
    spec = plan.spec
    f32 = "float32"
    params = [
        relax.Var("q", relax.TensorType((spec.batch, spec.seq_q, spec.heads, spec.head_dim), f32)),
        relax.Var("k", relax.TensorType((spec.batch, spec.seq_kv, spec.heads, spec.head_dim), f32)),
        relax.Var("v", relax.TensorType((spec.batch, spec.seq_kv, spec.heads, spec.head_dim_v), f32)),
    ]
    params += [relax.Var(f"bias{i}", relax.TensorType(s, f32)) for i, s in enumerate(spec.bias_shapes)]
    if spec.causal_offset is not None:
        params.append(relax.Var("keep", relax.TensorType((1, 1, spec.seq_q, spec.seq_kv), "bool")))
    bb = relax.BlockBuilder()
    attrs = {"Primitive": True, SPEC_ATTR: spec.to_json()}
    with bb.function(FUNCTION_NAME, params, attrs, private=True):
        with bb.dataflow():
            q, k, v = params[:3]
            qh = bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3]))
            kt = bb.emit(relax.op.permute_dims(k, [0, 2, 3, 1]))
            vh = bb.emit(relax.op.permute_dims(v, [0, 2, 1, 3]))
            s = bb.emit(relax.op.matmul(qh, kt))
            s = bb.emit(relax.op.multiply(s, relax.const(spec.scale, f32)))
            biases = params[3 : 3 + len(spec.bias_shapes)]
            n_before = spec.biases_before_causal if spec.causal_offset is not None else len(biases)
            for b in biases[:n_before]:
                s = bb.emit(relax.op.add(s, b))
            if spec.causal_offset is not None:
                s = bb.emit(relax.op.where(params[-1], s, relax.const(spec.causal_fill, f32)))
            for b in biases[n_before:]:
                s = bb.emit(relax.op.add(s, b))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            if spec.nan_to_zero:
                p = bb.emit(relax.op.where(relax.op.isnan(p), relax.const(0.0, f32), p))
            o = bb.emit(relax.op.matmul(p, vh))
            out = bb.emit_output(relax.op.permute_dims(o, [0, 2, 1, 3]))
        bb.emit_func_output(out)
    return bb.get()[FUNCTION_NAME]


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Each planned block's context binding becomes a call of its ``fused_attention`` function
    (transposed back to the block's layout); head-merge transposes / identity reshapes of that
    result are folded into one permutation (none when they cancel)."""

    def __init__(self, mod: tvm.IRModule, plans: dict):
        super().__init__(mod)
        self.plans = plans
        self.tracked: dict = {}  # var -> (attention output var, perm): var == permute_dims(out, perm)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        plan = self.plans.get(binding.var)
        if plan is not None:
            self._emit_fused(binding.var, plan)
            return
        folded = self._fold(binding)
        if folded is not None:
            value, entry = folded
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))
            self.tracked[binding.var] = entry
            return
        super().visit_var_binding_(binding)

    def _emit_fused(self, var, plan: _Plan) -> None:
        gvar = self.builder_.add_func(_reference_function(plan), FUNCTION_NAME)
        args = [self.visit_expr(e) for e in (plan.q, plan.k, plan.v, *plan.biases)]
        if plan.keep is not None:
            args.append(relax.const(plan.keep))
        out = self.builder_.emit(relax.Call(gvar, args), f"attention_{plan.block}")
        spec = plan.spec
        if plan.rank == 4:  # out is (B, S_q, N, Dv); the context was (B, N, S_q, Dv)
            perm = [0, 2, 1, 3]
            value = _permute_or_reshape(out, perm, [spec.batch, spec.seq_q, spec.heads, spec.head_dim_v])
            self.tracked[var] = (out, perm)
        else:
            value = relax.op.reshape(out, [spec.batch, spec.seq_q, spec.head_dim_v])
        self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(value)))

    def _fold(self, binding):
        value = binding.value
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        src = value.args[0]
        if isinstance(src, relax.Tuple) and value.op.name == "relax.concat" and len(src.fields) == 1:
            src = src.fields[0]
        elif value.op.name == "relax.concat":
            return None
        if not isinstance(src, relax.Var) or src not in self.tracked:
            return None
        out, perm = self.tracked[src]
        if value.op.name == "relax.permute_dims":
            perm = [perm[a] for a in _axes(value, len(perm))]
        elif value.op.name not in ("relax.reshape", "relax.concat") or _shape(binding.var) != _shape(src):
            return None
        out_shape = _shape(out)
        if perm == list(range(len(perm))):
            return out, (out, perm)
        return _permute_or_reshape(out, perm, out_shape), (out, perm)


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Outline each scaled-dot-product attention block into one ``fused_attention`` function.

    Run it after ``FoldConstant`` (scales, masks and causal triangles must be constants) and
    before fusion and ``LegalizeOps``; ``tvm_fusion.schedules.LowerAttention`` then swaps in the
    fused kernel (the pipeline does both). Blocks it declines keep their ops; the reasons are in
    ``self.decisions`` and in :func:`tvm_fusion.explain`. The module attribute
    ``"tvm_fusion.fuse_attention"`` counts the blocks fused (accumulated over runs).

    Parameters
    ----------
    enabled : bool
        False makes the pass the identity (the fusion policy's ``attention`` switch).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.decisions: list[AttentionDecision] = []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        self.decisions = []
        if not self.enabled:
            return mod
        plans = {}
        functions = list(_functions(mod))
        for gvar, func in functions:
            analysis = _Analysis(gvar.name_hint, func)
            self.decisions += analysis.decisions.values()
            plans.update(analysis.plans)
        if not plans:
            return mod
        rewriter = _Rewriter(mod, plans)
        for gvar, func in functions:
            new_func = rewriter.visit_expr(func)
            rewriter.builder_.update_func(gvar, new_func)
        new_mod = rewriter.builder_.get()
        previous = int(mod.attrs[ATTR_KEY]) if mod.attrs is not None and ATTR_KEY in mod.attrs else 0
        new_mod = new_mod.with_attr(ATTR_KEY, previous + len(plans))
        new_mod = relax.transform.CanonicalizeBindings()(relax.transform.Normalize()(new_mod))
        return relax.transform.DeadCodeElimination()(new_mod)
