"""FuseAttention: scaled-dot-product attention, as exporters write it, becomes one ``R.nn.attention``.

Exporters spell attention as five to ten ops: ``Q.K^T``, a scale, mask arithmetic, ``softmax``,
``.V``, with reshape/transpose head split and merge around it. Run op by op, the scores
(``batch x heads x S_q x S_kv``) are written to memory and read back twice; at long sequences
that dominates time and memory, and ApplyFusionPolicy will not fuse it (two contractions in one
group). This pass recognises the block with the Relax pattern language (``relax.dpl``) and
replaces it by one ``R.nn.attention`` / ``R.nn.attention_bias`` call in BSNH layout, which
``tvm_fusion.schedules.attention`` lowers to one FlashAttention-style kernel (online softmax, no
score tensor).

What is matched (``matmul`` operands may be 3-D ``(B*N, S, D)`` or 4-D ``(B, N, S, D)``):

* scores ``matmul(q, kT)``; scalar-constant scales on ``q`` and/or ``kT`` (the torch dynamo SDPA
  decomposition scales both by ``sqrt(scale)``), and/or one ``multiply``/``divide`` of the scores
  by a scalar constant (TorchScript: ``/ sqrt(d)``);
* then up to two mask stages, in any order: ``add`` of a bias that broadcasts to the scores
  (HF BERT/RoBERTa/DistilBERT's extended mask ``(1 - mask) * finfo.min``, T5's position bias,
  constant masks), and ``where(causal, scores, fill)`` / ``where(~causal, fill, scores)`` with a
  constant lower-triangular condition (GPT-2's ``bias`` buffer) and a constant fill ``<= -1e4``;
  an additive constant that is 0 on and below the diagonal and ``<= -1e4`` above counts as causal;
* ``softmax`` over the last axis, then ``matmul(probs, v)``, optionally followed by the
  ``permute_dims`` that merges the heads back.

Transposes around the block are absorbed: ``q``, ``k`` and ``v`` are taken from before the
exporter's head-split ``permute_dims`` when those compose to BSNH, and the output transpose
cancels against the op's BSNH result; where they do not compose, a ``permute_dims`` is emitted.
Relax's own ``R.nn.attention`` is already one op and is left as it is.

Causal semantics: masked positions are *excluded* (weight 0), which is what ``where`` with a fill
``<= -1e4`` computes in float32 (``exp(fill - rowmax)`` underflows to 0; the diagonal is always
kept, so no row is empty). A row that a bias masks completely behaves as in ONNX Runtime:
uniform weights when the masked scores are equal (``finfo.min``), NaN when they are ``-inf``.

Blocks are declined, with the reason recorded for ``explain()``, when: the dtype is not
float32, a shape is symbolic (kernels are specialised on static shapes), softmax runs over
another axis, an intermediate (scores, probabilities) has another consumer (e.g.
``output_attentions``), a scale is not a scalar constant or comes after the mask, a bias does not
broadcast to the scores, or a ``where`` condition is not a constant causal triangle.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ..policy import FusionPolicy
from ..schedules import attention as _lowering  # noqa: F401  (registers the op's fused kernel)

ATTR_KEY = "tvm_fusion.fuse_attention"
MASK_STAGES = 2  # bias adds / causal wheres between the scale and the softmax
LARGE_NEGATIVE = -1.0e4  # a fill at most this is an exclusion: exp(fill - rowmax) == 0 in float32
ATTENTION_OPS = ("relax.nn.attention", "relax.nn.attention_bias")


@dataclasses.dataclass
class AttentionDecision:
    """What FuseAttention made of one attention block (named by its softmax's variable)."""

    function: str
    block: str
    fused: bool
    reason: str

    def __str__(self) -> str:
        verdict = "fused" if self.fused else "not fused"
        return f"attention {self.block}: {verdict} ({self.reason})"


class _Pattern:
    """The dpl pattern of one attention block with ``stages`` mask stages, and its parts."""

    def __init__(self, stages: int, merge_heads: bool):
        self.q, self.k, self.v = wildcard(), wildcard(), wildcard()
        self.scores = is_op("relax.matmul")(self.q, self.k)
        self.scale = is_const()
        self.scale_mul = is_op("relax.multiply")(self.scores, self.scale)
        self.scale_rmul = is_op("relax.multiply")(self.scale, self.scores)
        self.scale_div = is_op("relax.divide")(self.scores, self.scale)
        x = self.scores | self.scale_mul | self.scale_rmul | self.scale_div
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
        self.masked = x
        self.softmax = is_op("relax.nn.softmax")(x)
        self.context = is_op("relax.matmul")(self.softmax, self.v)
        self.root = is_op("relax.permute_dims")(self.context) if merge_heads else self.context


@dataclasses.dataclass
class _Block:
    """A matched block, in the terms the rewrite needs."""

    q: relax.Expr
    k_t: relax.Expr
    v: relax.Expr
    scores: relax.Call
    softmax: relax.Call
    context: relax.Call
    root: relax.Call
    stages: list  # [(kind, stage call, other operand, condition)], scores side first
    scale_call: relax.Call | None


class _Analysis:
    """Matching, checking and rewriting of the blocks of one function."""

    def __init__(self, name: str, func: relax.Function):
        self.name = name
        self.func = func
        self.var2val = relax.analysis.get_var2val(func)
        self.var_of = {}
        for var, value in self.var2val.items():
            self.var_of[value] = var
        self.uses = _count_uses(func)
        self.decisions: dict[str, AttentionDecision] = {}

    # -- matching -------------------------------------------------------------------------
    def run(self, rewrite: bool) -> relax.Function:
        func = self.func
        for stages in range(MASK_STAGES, -1, -1):
            for merge_heads in (True, False):
                pattern = _Pattern(stages, merge_heads)
                rewritten = rewrite_call(pattern.root, self._rewriter(pattern, rewrite), func)
                func = rewritten if rewrite else func
        return func

    def _rewriter(self, pattern: _Pattern, rewrite: bool):
        def rewriter(orig, matchings):
            block = self._block(pattern, matchings, orig)
            name = self._name(block.softmax)
            if name in self.decisions:  # matched before (a longer pattern declined it)
                return orig
            result = self._build(block)
            if isinstance(result, str):
                self.decisions[name] = AttentionDecision(self.name, name, False, result)
                return orig
            expr, summary = result
            self.decisions[name] = AttentionDecision(self.name, name, True, summary)
            return expr if rewrite else orig

        return rewriter

    def _block(self, p: _Pattern, m, orig) -> _Block:
        stages = []
        for stage, other, cond in reversed(p.stages):
            for kind, pat in stage.items():
                if pat in m:
                    stages.append((kind, m[pat], m[other], m.get(cond)))
                    break
        scale_call = next((m[s] for s in (p.scale_mul, p.scale_rmul, p.scale_div) if s in m), None)
        return _Block(
            m[p.q], m[p.k], m[p.v], m[p.scores], m[p.softmax], m[p.context], orig, stages, scale_call
        )

    def _name(self, call) -> str:
        var = self.var_of.get(call)
        return var.name if var is not None else "softmax"

    # -- checks and rewrite ----------------------------------------------------------------
    def _build(self, blk: _Block):
        """(replacement expr, summary) or the reason the block is declined."""
        scores_ty = blk.scores.ty
        if str(scores_ty.dtype) != "float32":
            return f"dtype {scores_ty.dtype}: the fused kernel is float32"
        shapes = {"q": _shape(blk.q), "k^T": _shape(blk.k_t), "v": _shape(blk.v)}
        for role, shape in shapes.items():
            if shape is None:
                return f"{role} has a symbolic shape; the fused kernel is specialised on static shapes"
        q_shape, k_shape, v_shape = shapes["q"], shapes["k^T"], shapes["v"]
        rank = len(q_shape)
        if rank not in (3, 4) or len(k_shape) != rank or len(v_shape) != rank:
            return f"matmul operands of rank {rank}: expected (B*N, S, D) or (B, N, S, D)"
        if q_shape[:-2] != k_shape[:-2] or q_shape[:-2] != v_shape[:-2]:
            return f"q, k, v batch dims differ ({q_shape}, {k_shape}, {v_shape}); no broadcast heads"
        seq_q, head_dim, seq_kv, head_dim_v = q_shape[-2], q_shape[-1], k_shape[-1], v_shape[-1]
        if k_shape[-2] != head_dim or v_shape[-2] != seq_kv:
            return "q.k^T.v shapes do not chain"
        axis = int(blk.softmax.attrs.axis)
        if axis not in (-1, rank - 1):
            return f"softmax over axis {axis}, not the key axis ({rank - 1})"
        inner = [blk.scores, *(s[1] for s in blk.stages), blk.softmax]
        if blk.scale_call is not None:
            inner.insert(1, blk.scale_call)
        if blk.root is not blk.context:
            inner.append(blk.context)
        for call in inner:
            var = self.var_of.get(call)
            if var is not None and self.uses.get(var, 0) > 1:
                return f"{var.name} ({call.op.name.removeprefix('relax.')}) has other consumers"
        scale = 1.0
        if blk.scale_call is not None:
            const = next(a for a in blk.scale_call.args if isinstance(a, tvm.ir.GenericConst))
            value = _scalar_value(const)
            if value is None:
                return "the score scale is not a scalar constant"
            scale = 1.0 / value if blk.scale_call.op.name == "relax.divide" else value
        q, q_scale = self._strip_scale(blk.q)
        k_t, k_scale = self._strip_scale(blk.k_t)
        scale *= q_scale * k_scale
        if not math.isfinite(scale) or scale == 0.0:
            return f"score scale {scale}"
        scores_shape = q_shape[:-1] + [seq_kv]
        biases, causal = [], None
        for kind, _call, other, cond in blk.stages:
            if kind in ("add", "radd"):
                found = self._causal_additive(other, seq_q, seq_kv)
                if found is not None:
                    if causal is not None:
                        return "two causal masks"
                    causal = found
                    continue
                bias_shape = _shape(other)
                if bias_shape is None or str(other.ty.dtype) != "float32":
                    return "the additive mask is not a static float32 tensor"
                if not _broadcasts(bias_shape, scores_shape):
                    return f"the additive mask of shape {bias_shape} is not per-key ({scores_shape})"
                biases.append(other)
                continue
            found = self._causal_where(kind, cond, other, seq_q, seq_kv)
            if isinstance(found, str):
                return found
            if causal is not None:
                return "two causal masks"
            causal = found
        causal_mask = None
        if causal is not None:
            if causal == 0:
                causal_mask = "TopLeft"
            elif causal == abs(seq_q - seq_kv):
                causal_mask = "BottomRight"
            else:
                return f"causal diagonal offset {causal} is neither top-left nor bottom-right aligned"
        return self._emit(blk, rank, q, k_t, biases, scale, causal_mask, q_shape, seq_kv, head_dim_v)

    def _emit(self, blk, rank, q, k_t, biases, scale, causal_mask, q_shape, seq_kv, head_dim_v):
        if rank == 4:
            batch, heads = q_shape[0], q_shape[1]
            q4 = self._to_bsnh(q, [0, 2, 1, 3])
            k4 = self._to_bsnh(k_t, [0, 3, 1, 2])
            v4 = self._to_bsnh(blk.v, [0, 2, 1, 3])
        else:  # (B*N, S, D): one head per batch row
            batch, heads = q_shape[0], 1
            q4 = relax.op.reshape(q, [batch, q_shape[1], 1, q_shape[2]])
            k4 = relax.op.reshape(self._to_bsnh(k_t, [0, 2, 1]), [batch, seq_kv, 1, q_shape[2]])
            v4 = relax.op.reshape(blk.v, [batch, seq_kv, 1, head_dim_v])
        bias = None
        for extra in biases:
            extra = _rank4_bias(extra, rank)
            bias = extra if bias is None else relax.op.add(bias, extra)
        attn = relax.op.nn.attention(
            q4, k4, v4, bias, scale=tirx.FloatImm("float32", scale), causal_mask=causal_mask
        )
        # attn is (B, S_q, N, Dv); the block's result is the context (B, N, S_q, Dv), or its
        # permutation when the head-merge transpose was matched too
        if rank == 4:
            perm = [0, 2, 1, 3]
            if blk.root is not blk.context:
                perm = [perm[a] for a in _axes(blk.root, 4)]
            out = attn if perm == [0, 1, 2, 3] else relax.op.permute_dims(attn, perm)
        else:
            out = relax.op.reshape(attn, [batch, q_shape[1], head_dim_v])
            if blk.root is not blk.context:
                out = relax.op.permute_dims(out, _axes(blk.root, 3))
        parts = [f"scale {scale:.6g}"]
        if biases:
            parts.append("additive mask")
        if causal_mask:
            parts.append(f"causal {causal_mask}")
        parts.append(f"{batch}x{heads} heads, S {q_shape[-2]}x{seq_kv}")
        return out, "R.nn.attention: " + ", ".join(parts)

    # -- helpers --------------------------------------------------------------------------
    def _value(self, expr):
        return self.var2val.get(expr) if isinstance(expr, relax.Var) else expr

    def _call_of(self, expr, name):
        value = self._value(expr)
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name:
            return value
        return None

    def _strip_scale(self, expr):
        """(operand, scale): look through scalar-constant multiplies and transposes of a matmul
        operand, so ``(q * a).(k^T * b)`` becomes scale ``a * b`` on the scores."""
        scale, perm_chain = 1.0, []
        current = expr
        for _ in range(8):
            mul = self._call_of(current, "relax.multiply")
            if mul is not None:
                consts = [a for a in mul.args if isinstance(a, tvm.ir.GenericConst)]
                value = _scalar_value(consts[0]) if len(consts) == 1 else None
                if value is not None:
                    scale *= value
                    current = next(a for a in mul.args if not isinstance(a, tvm.ir.GenericConst))
                    continue
            perm = self._call_of(current, "relax.permute_dims")
            if perm is not None and scale == 1.0:
                perm_chain.append(perm)
                current = perm.args[0]
                continue
            break
        if scale == 1.0:
            return expr, 1.0
        for perm in reversed(perm_chain):  # re-apply transposes met above the scale
            current = relax.op.permute_dims(current, perm.attrs.axes)
        return current, scale

    def _to_bsnh(self, expr, perm: list[int]):
        """``permute_dims(expr, perm)``, composed with the permutes that produced ``expr``:
        an exporter's head-split transpose cancels and the tensor before it is used."""
        for _ in range(8):
            if perm == list(range(len(perm))):
                return expr
            call = self._call_of(expr, "relax.permute_dims")
            if call is None:
                break
            axes = _axes(call, len(perm))
            perm = [axes[p] for p in perm]
            expr = call.args[0]
        return expr if perm == list(range(len(perm))) else relax.op.permute_dims(expr, perm)

    def _causal_where(self, kind, cond, fill, seq_q, seq_kv):
        """The causal offset of ``where(keep, x, fill)`` / ``where(drop, fill, x)``, or why not."""
        cond_value = _const_array(cond, self.var2val)
        if cond_value is None or cond_value.dtype != np.bool_:
            return "where with a condition that is not a constant boolean (not a causal mask)"
        fill_value = _scalar_value(_const_of(fill, self.var2val))
        if fill_value is None or fill_value > LARGE_NEGATIVE:
            return f"where fills {fill_value}, not a large negative constant (<= {LARGE_NEGATIVE:g})"
        keep = cond_value if kind == "keep" else ~cond_value
        offset = _tril_offset(keep, seq_q, seq_kv)
        if offset is None:
            return "where with a constant condition that is not a causal (lower-triangular) mask"
        return offset

    def _causal_additive(self, other, seq_q, seq_kv):
        value = _const_array(other, self.var2val)
        if value is None or value.dtype.kind != "f" or value.ndim < 2 or value.shape[-2:] != (seq_q, seq_kv):
            return None
        keep = value == 0
        if not np.all(keep | (value <= LARGE_NEGATIVE)):
            return None
        return _tril_offset(keep, seq_q, seq_kv)


# -- small IR helpers ---------------------------------------------------------------------------
def _count_uses(func: relax.Function) -> dict[relax.Var, int]:
    uses: dict[relax.Var, int] = {}
    exprs = [b.value for block in func.body.blocks for b in block.bindings] + [func.body.body]
    for expr in exprs:
        for var in relax.analysis.free_vars(expr):
            uses[var] = uses.get(var, 0) + 1
    return uses


def _shape(expr) -> list[int] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = []
    for dim in ty.shape.values:
        if not isinstance(dim, tirx.IntImm):
            return None
        dims.append(int(dim))
    return dims


def _axes(call: relax.Call, rank: int) -> list[int]:
    axes = call.attrs.axes
    return list(range(rank))[::-1] if axes is None else [int(a) % rank for a in axes]


def _broadcasts(shape: list[int], target: list[int]) -> bool:
    """``shape`` broadcasts to ``target`` with every dim 1 or equal, and varies over keys only
    where the target does (the last dims line up)."""
    if len(shape) > len(target):
        return False
    padded = [1] * (len(target) - len(shape)) + list(shape)
    return all(s in (1, t) for s, t in zip(padded, target))


def _rank4_bias(bias, rank: int):
    shape = _shape(bias)
    if rank == 3:  # (B*N | 1, S_q | 1, S_kv): the heads are the batch rows
        padded = [1] * (3 - len(shape)) + shape
        return relax.op.reshape(bias, [padded[0], 1, padded[1], padded[2]])
    if len(shape) == 4:
        return bias
    return relax.op.reshape(bias, [1] * (4 - len(shape)) + shape)


def _const_of(expr, var2val):
    value = var2val.get(expr, expr) if isinstance(expr, relax.Var) else expr
    return value if isinstance(value, tvm.ir.GenericConst) else None


def _const_array(expr, var2val) -> np.ndarray | None:
    const = _const_of(expr, var2val)
    if const is None:
        return None
    try:
        return const.value.numpy()
    except Exception:  # dtypes numpy cannot hold
        return None


def _scalar_value(const) -> float | None:
    if const is None:
        return None
    try:
        data = const.value.numpy()
    except Exception:
        return None
    return float(data.reshape(())) if data.size == 1 and data.dtype.kind == "f" else None


def _tril_offset(keep: np.ndarray, seq_q: int, seq_kv: int) -> int | None:
    """``offset`` when ``keep`` (broadcast to (.., seq_q, seq_kv)) is ``j <= i + offset`` everywhere."""
    if keep.ndim < 2 or keep.shape[-2:] != (seq_q, seq_kv) or any(d != 1 for d in keep.shape[:-2]):
        return None
    keep = keep.reshape(seq_q, seq_kv)
    offset = int(np.count_nonzero(keep[0])) - 1
    rows = np.arange(seq_q)[:, None]
    cols = np.arange(seq_kv)[None, :]
    if offset < 0 or not np.array_equal(keep, cols <= rows + offset):
        return None
    return offset


# -- unmatched candidates, for explain() --------------------------------------------------------
_SCALE_OPS = ("relax.multiply", "relax.divide")
_STAGE_OPS = ("relax.add", "relax.where")


def _unmatched_reason(analysis: _Analysis, softmax: relax.Call) -> str | None:
    """Why the pattern did not match at a softmax that looks like attention (its input comes
    from a matmul through elementwise ops and its result feeds a matmul), or None if it does not."""
    steps, expr = [], softmax.args[0]
    for _ in range(8):
        value = analysis._value(expr)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        name = value.op.name
        if name == "relax.matmul":
            break
        steps.append(name)
        tensors = [a for a in value.args if not isinstance(a, tvm.ir.GenericConst)]
        scored = [a for a in tensors if _traces_to_matmul(analysis, a)]
        if not scored:
            return None
        expr = scored[0]
    else:
        return None
    steps.reverse()  # from the scores to the softmax
    for i, name in enumerate(steps):
        if name in _SCALE_OPS and i == 0:
            continue
        if name in _STAGE_OPS:
            continue
        if name in _SCALE_OPS:
            return f"the scores are scaled ({name.removeprefix('relax.')}) after the mask"
        return f"the scores pass through {name.removeprefix('relax.')}, which the pattern does not accept"
    if len([s for s in steps if s in _STAGE_OPS]) > MASK_STAGES:
        return f"more than {MASK_STAGES} mask stages between the scores and the softmax"
    return "the block does not match the attention pattern (see FuseAttention's docstring)"


def _traces_to_matmul(analysis: _Analysis, expr, depth: int = 8) -> bool:
    for _ in range(depth):
        value = analysis._value(expr)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return False
        if value.op.name == "relax.matmul":
            return True
        tensors = [a for a in value.args if not isinstance(a, tvm.ir.GenericConst)]
        if not tensors:
            return False
        expr = (
            tensors[0]
            if len(tensors) == 1
            else next((a for a in tensors if _traces_to_matmul(analysis, a, depth - 1)), tensors[0])
        )
    return False


def _softmax_feeding_matmul(analysis: _Analysis):
    consumers: dict = {}
    for var, value in analysis.var2val.items():
        if (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.matmul"
        ):
            arg = value.args[0]
            if isinstance(arg, relax.Var):
                consumers[arg] = var
    for var, value in analysis.var2val.items():
        if (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.nn.softmax"
            and var in consumers
        ):
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
            if (
                isinstance(value, relax.Call)
                and isinstance(value.op, tvm.ir.Op)
                and value.op.name in ATTENTION_OPS
            ):
                decisions.append(
                    AttentionDecision(gvar.name_hint, var.name, True, f"one op already ({value.op.name})")
                )
        analysis.run(rewrite=False)
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


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Rewrite each scaled-dot-product attention block into one ``R.nn.attention(_bias)`` call.

    Run it after ``FoldConstant`` (scales, masks and causal triangles must be constants) and
    before ``LegalizeOps``; ``tvm_fusion.schedules`` lowers the op to one fused kernel on LLVM
    and CUDA (TVM's own legalization elsewhere). Blocks it declines keep their ops; the reasons
    are in ``self.decisions`` and in :func:`tvm_fusion.explain`. The module attribute
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
        updates = {}
        for gvar, func in _functions(mod):
            analysis = _Analysis(gvar.name_hint, func)
            new_func = analysis.run(rewrite=True)
            self.decisions += analysis.decisions.values()
            if any(d.fused for d in analysis.decisions.values()):
                updates[gvar] = new_func
        if not updates:
            return mod
        mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)  # never edit the caller's module
        for gvar, func in updates.items():
            mod[gvar] = func
        fused = sum(d.fused for d in self.decisions)
        previous = int(mod.attrs[ATTR_KEY]) if mod.attrs is not None and ATTR_KEY in mod.attrs else 0
        mod = mod.with_attr(ATTR_KEY, previous + fused)
        return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(mod))


def count_fused_attention(mod: tvm.IRModule) -> int:
    """Attention ops in ``mod``'s (non-primitive) functions."""
    count = 0
    for _, func in _functions(mod):
        for value in relax.analysis.get_var2val(func).values():
            if (
                isinstance(value, relax.Call)
                and isinstance(value.op, tvm.ir.Op)
                and value.op.name in ATTENTION_OPS
            ):
                count += 1
    return count
