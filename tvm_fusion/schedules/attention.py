"""Fused attention kernels (FlashAttention-style) for ``R.nn.attention`` / ``R.nn.attention_bias``.

TVM legalizes ``R.nn.attention`` into one TE kernel that still materialises the scores twice
(``batch x heads x S_q x S_kv`` for ``Q.K^T`` and again for the softmax). The kernels here never
do: each task owns a tile of query rows of one head and walks the keys/values in tiles, keeping
a running row max ``m``, a running sum ``l`` and the output accumulator (rescaled by
``exp(m_old - m_new)`` whenever the max grows), the *online softmax* of FlashAttention. The
largest buffer a task touches is its ``q_tile x kv_tile`` score tile.

CPU (:func:`cpu_attention_kernel`): parallel over ``batch x heads x query tiles``; ``Q.K^T`` is a
register tile (rows x SIMD vectors over keys, the reduction over the head dim inside) on a
transposed copy of K packed once per head; ``P.V`` a register tile over the head dim; the
exponential is a vectorizable polynomial (``exp`` is a scalar libm call per lane in LLVM).
Tile sizes come from the target's vector width and register count (:func:`cpu_tiles`).

CUDA (:func:`cuda_attention_kernel`): one thread block per query tile of one head; K/V tiles,
scores, the accumulator and the softmax state in shared memory.

Both kernels are complete schedules and carry ``tirx.is_scheduled``, so the default schedule
rules (and Meta-Schedule task extraction) leave them alone.

Semantics, identical to TVM's own legalization and to the ONNX graphs FuseAttention matches:
``softmax(Q.K^T * scale + bias)`` over the keys, causal positions (``j > i + offset``) excluded.
A row whose scores are all equal gets uniform weights (so a padding mask of ``finfo.min``
gives the mean of V, as ONNX Runtime computes it); a row whose scores are all ``-inf`` gives
NaN (0 / 0), as softmax over ``-inf`` does in ONNX Runtime.

Importing this module registers the legalization (:func:`legalize_attention`) in front of
TVM's: float32, static shapes, LLVM or CUDA target in scope; anything else keeps TVM's.
"""

from __future__ import annotations

import dataclasses
import math

from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.target import Target

from ..legalize import override_legalization
from ._util import num_cores, num_vector_registers, vector_lanes

KERNEL_ATTR = "tvm_fusion.kernel"
KERNEL_NAME = "flash_attention"
FLOAT32_LOWEST = -3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Everything a kernel is specialised on (R.nn.attention's BSNH layout)."""

    batch: int
    heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    scale: float
    causal_offset: int | None = None  # key j is kept for query i when j <= i + causal_offset
    bias_shape: tuple[int, ...] | None = None  # 4-D, broadcast to (batch, heads, seq_q, seq_kv)
    dtype: str = "float32"

    @classmethod
    def from_call(cls, call: relax.Call) -> AttentionShape | None:
        """The shape of an ``R.nn.attention(_bias)`` call, or None when it is not static 4-D."""
        args = list(call.args)
        shapes = [_static_shape(a) for a in args]
        if any(s is None for s in shapes) or any(len(s) != 4 for s in shapes):
            return None
        (b, sq, n, d), (bk, skv, nk, dk), (bv, sv, nv, dv) = shapes[:3]
        if (bk, nk, dk) != (b, n, d) or (bv, sv, nv) != (b, skv, n):
            return None
        dtypes = {str(a.ty.dtype) for a in args}
        if len(dtypes) != 1:
            return None
        attrs = call.attrs
        if getattr(attrs, "window_size", None) is not None:
            return None
        scale = attrs.scale
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale.value)
        causal = attrs.causal_mask
        offset = None
        if causal == "TopLeft":
            offset = 0
        elif causal == "BottomRight":
            offset = abs(sq - skv)  # as TVM's legalization defines it
        elif causal is not None:
            return None
        bias_shape = None
        if len(args) == 4:
            bias_shape = tuple(shapes[3])
            want = (b, n, sq, skv)
            if bias_shape[-1] != skv or any(x not in (1, w) for x, w in zip(bias_shape, want)):
                return None
        return cls(b, n, sq, skv, d, dv, scale, offset, bias_shape, dtypes.pop())

    @property
    def score_elements(self) -> int:
        """Elements of the score tensor the unfused computation materialises."""
        return self.batch * self.heads * self.seq_q * self.seq_kv


def _static_shape(expr) -> list[int] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = []
    for dim in ty.shape.values:
        if not isinstance(dim, tirx.IntImm):
            return None
        dims.append(int(dim))
    return dims


# -- CPU -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CpuTiles:
    """Tiling of the CPU kernel. Scores are kept transposed, ``[keys, queries]``, so the softmax
    statistics of a tile are vertical (SIMD over queries) and no row needs a horizontal reduce."""

    q_tile: int  # queries per parallel task (a multiple of qk_cols and pv_rows)
    kv_tile: int  # keys per online-softmax step (a multiple of qk_rows)
    qk_rows: int  # register tile of S^T = K.Q^T: keys (broadcast) ...
    qk_cols: int  # ... x queries (SIMD vectors)
    pv_rows: int  # register tile of O += P.V: queries (broadcast) ...
    pv_cols: int  # ... x head-dim columns (SIMD vectors)
    lanes: int


def _register_tile(regs: int, lanes: int, width_ok) -> tuple[int, int]:
    """(rows, vectors) with the most FMAs per load whose ``rows * vectors`` accumulators, one
    broadcast and ``vectors`` loaded operands fit in the register file."""
    best = (1, 1, -1.0)
    for vectors in range(1, 9):
        if not width_ok(vectors * lanes):
            continue
        rows = min((regs - vectors - 1) // vectors, 8)
        if rows < 1:
            continue
        score = rows * vectors / (rows + vectors)
        if score > best[2] + 1e-9:
            best = (rows, vectors, score)
    return best[0], best[1]


def cpu_tiles(shape: AttentionShape, target: Target) -> CpuTiles:
    """Tile sizes from the target's SIMD width and register count (no machine constants):
    register tiles as large as the register file allows, tiles of about 64 queries/keys (the
    score, accumulator and K/V tiles then stay in L1)."""
    lanes = vector_lanes(target, shape.dtype)
    regs = num_vector_registers(target)
    qk_rows, qk_vectors = _register_tile(regs, lanes, lambda w: w <= 64)
    qk_cols = qk_vectors * lanes
    dv = shape.head_dim_v
    pv_rows, pv_vectors = _register_tile(regs, lanes, lambda w: dv % w == 0)
    pv_cols = pv_vectors * lanes
    if dv % pv_cols:  # head dim not a multiple of the lanes: one vector loop over all of it
        pv_cols, pv_rows = dv, max(1, min(8, (regs - 2) * lanes // max(dv, 1)))
    step = math.lcm(qk_cols, pv_rows)
    q_tile = step * max(1, round(64 / step))
    # enough tasks for every core: smaller query tiles on small problems
    while q_tile > step and _tasks(shape, q_tile) < 4 * num_cores(target):
        q_tile -= step
    kv_tile = qk_rows * max(1, round(64 / qk_rows))
    return CpuTiles(q_tile, kv_tile, qk_rows, qk_cols, pv_rows, pv_cols, lanes)


def _tasks(shape: AttentionShape, q_tile: int) -> int:
    return shape.batch * shape.heads * -(-shape.seq_q // q_tile)


def _fast_exp(x):
    """exp(x) for float32 x <= 0 as a polynomial (Cephes, as ``topi.fast_exp``; relative error
    ~1e-7), vectorizable (LLVM calls scalar ``expf`` per lane for ``exp``); exactly 0 below -87,
    so ``exp(-inf) = 0`` and a row of ``-inf`` sums to 0."""
    f32 = "float32"
    clamped = T.max(x, tirx.const(-87.0, f32))
    n = T.floor(clamped * tirx.const(1.44269504088896341, f32) + tirx.const(0.5, f32))
    r = clamped - n * tirx.const(0.6931471805599453, f32)
    poly = tirx.const(1.9875691500e-4, f32)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        poly = poly * r + tirx.const(coef, f32)
    poly = poly * r * r + r + tirx.const(1.0, f32)
    two_n = T.reinterpret(f32, T.shift_left(T.Cast("int32", n + tirx.const(127.0, f32)), 23))
    return T.Select(x < tirx.const(-87.0, f32), tirx.const(0.0, f32), two_n * poly)


def cpu_attention_kernel(shape: AttentionShape, target: Target, tiles: CpuTiles | None = None):
    """The scheduled CPU PrimFunc ``(q, k, v[, bias], out)`` for ``shape``."""
    tiles = tiles or cpu_tiles(shape, target)
    B, N, Sq, Skv = shape.batch, shape.heads, shape.seq_q, shape.seq_kv
    D, Dv, dtype = shape.head_dim, shape.head_dim_v, shape.dtype
    Tq, Tk, L = tiles.q_tile, tiles.kv_tile, tiles.lanes
    R1, W1, R2, W2 = tiles.qk_rows, tiles.qk_cols, tiles.pv_rows, tiles.pv_cols
    QT, KT = -(-Sq // Tq), -(-Skv // Tk)
    Sq_pad, Skv_pad = QT * Tq, KT * Tk
    ragged_q, ragged_kv = Sq % Tq != 0, Skv % Tk != 0
    has_bias = shape.bias_shape is not None
    Bb, Nb, Sb, _ = shape.bias_shape or (1, 1, 1, 1)
    # a bias that varies over queries is read transposed ([key, query]), one that does not is
    # read per key; either is repacked when keys are padded (-inf past the last key)
    bias_t_shape = (Bb, Nb, Skv_pad, Sq_pad if Sb > 1 else 1)
    pack_bias = has_bias and (Sb > 1 or ragged_kv)
    causal = shape.causal_offset is not None
    off = shape.causal_offset or 0
    scale = tirx.const(shape.scale, dtype)
    neg_inf = tirx.const(-math.inf, dtype)
    lowest = tirx.const(FLOAT32_LOWEST, dtype)
    zero = tirx.const(0.0, dtype)
    NV = Tq // L  # query vectors per tile (softmax statistics)
    # P.V columns as whole SIMD vectors where the head dim allows (LLVM splits odd-width vectors badly)
    VW2 = L if W2 % L == 0 else W2
    NW2 = W2 // VW2

    def n_kv_tiles(q0):
        if not causal:
            return KT
        last = T.min(q0 + Tq, Sq) - 1 if ragged_q else q0 + Tq - 1
        return T.min(T.max((last + off) // Tk + 1, 1), KT)

    def bias_at(bias, bias_t, b, n, i, j):
        bb, nb = (b if Bb > 1 else 0), (n if Nb > 1 else 0)
        if pack_bias:
            return bias_t[bb, nb, j, i if Sb > 1 else 0]
        return bias[bb, nb, 0, j]

    def finish_score(acc, bias, bias_t, b, n, i, j):
        """acc * scale (+ bias), masked: what softmax sees for query i, key j."""
        val = acc * scale
        if has_bias:
            val = val + bias_at(bias, bias_t, b, n, i, j)
        if causal:
            val = T.Select(j <= i + off, val, neg_inf)
        if ragged_kv and not pack_bias:  # (a packed bias carries -inf past the last key)
            val = T.Select(j < Skv, val, neg_inf)
        return val

    @T.macro
    def body(q, k, v, bias, out):
        # Q^T (per query tile), K and V repacked once per head: contiguous tiles (BSNH rows of
        # one head are heads apart), zero past the last query/key so no tile needs a bound
        q_t = T.sblock_alloc_buffer((B, N, QT, D, Tq), dtype)
        k_p = T.sblock_alloc_buffer((B, N, Skv_pad, D), dtype)
        v_p = T.sblock_alloc_buffer((B, N, Skv_pad, Dv), dtype)
        for bn in T.parallel(B * N):
            with T.sblock("pack"):
                T.reads()
                T.writes()
                for i, d in T.grid(Sq, D):
                    q_t[bn // N, bn % N, i // Tq, d, i % Tq] = q[bn // N, i, bn % N, d]
                for i, d in T.grid(Sq_pad - Sq, D):
                    q_t[bn // N, bn % N, (Sq + i) // Tq, d, (Sq + i) % Tq] = zero
                for j in range(Skv):
                    for d in T.vectorized(D):
                        k_p[bn // N, bn % N, j, d] = k[bn // N, j, bn % N, d]
                    for d in T.vectorized(Dv):
                        v_p[bn // N, bn % N, j, d] = v[bn // N, j, bn % N, d]
                for j in range(Skv_pad - Skv):
                    for d in T.vectorized(D):
                        k_p[bn // N, bn % N, Skv + j, d] = zero
                    for d in T.vectorized(Dv):
                        v_p[bn // N, bn % N, Skv + j, d] = zero
        bias_t = T.sblock_alloc_buffer(bias_t_shape if pack_bias else (1,), dtype)
        if pack_bias:
            for bn in T.parallel(Bb * Nb):
                with T.sblock("pack_bias"):
                    T.reads()
                    T.writes()
                    for j, i in T.grid(Skv_pad, bias_t_shape[3]):
                        bias_t[bn // Nb, bn % Nb, j, i] = T.if_then_else(
                            j < Skv,
                            bias[bn // Nb, bn % Nb, T.min(i, Sb - 1), T.min(j, Skv - 1)],
                            neg_inf,
                        )
        for task in T.parallel(B * N * QT):
            with T.sblock("task"):
                T.reads()
                T.writes()
                m = T.sblock_alloc_buffer((Tq,), dtype, scope="local")
                l_sum = T.sblock_alloc_buffer((Tq,), dtype, scope="local")
                alpha = T.sblock_alloc_buffer((Tq,), dtype, scope="local")
                stat = T.sblock_alloc_buffer((NV, L), dtype, scope="local")
                acc = T.sblock_alloc_buffer((Tq, Dv), dtype, scope="local")
                s_t = T.sblock_alloc_buffer((Tk, Tq), dtype, scope="local")
                s_reg = T.sblock_alloc_buffer((R1, W1), dtype, scope="local")
                o_reg = T.sblock_alloc_buffer((R2, W2), dtype, scope="local")
                b = task // (N * QT)
                n = task // QT % N
                qt = task % QT
                q0 = qt * Tq
                for i in T.vectorized(Tq):
                    m[i] = lowest
                    l_sum[i] = zero
                for i in range(Tq):
                    for d in T.vectorized(Dv):
                        acc[i, d] = zero
                for kv in range(n_kv_tiles(q0)):
                    k0 = kv * Tk
                    # S^T = K.Q^T: register tiles of (keys x query vectors), reduction inside
                    for jo, io in T.grid(Tk // R1, Tq // W1):
                        for jj in T.unroll(R1):
                            for iv in T.unroll(W1 // L):
                                for il in T.vectorized(L):
                                    s_reg[jj, iv * L + il] = zero
                        for d in range(D):
                            for jj in T.unroll(R1):
                                for iv in T.unroll(W1 // L):
                                    for il in T.vectorized(L):
                                        s_reg[jj, iv * L + il] = (
                                            s_reg[jj, iv * L + il]
                                            + k_p[b, n, k0 + jo * R1 + jj, d]
                                            * q_t[b, n, qt, d, io * W1 + iv * L + il]
                                        )
                        for jj in T.unroll(R1):
                            for iv in T.unroll(W1 // L):
                                for il in T.vectorized(L):
                                    s_t[jo * R1 + jj, io * W1 + iv * L + il] = finish_score(
                                        s_reg[jj, iv * L + il],
                                        bias,
                                        bias_t,
                                        b,
                                        n,
                                        q0 + io * W1 + iv * L + il,
                                        k0 + jo * R1 + jj,
                                    )
                    # online softmax, SIMD over queries: new max, rescale factor, exp, running sum
                    for iv in T.unroll(NV):
                        for il in T.vectorized(L):
                            stat[iv, il] = m[iv * L + il]
                    for j in range(Tk):
                        for iv in T.unroll(NV):
                            for il in T.vectorized(L):
                                stat[iv, il] = T.max(stat[iv, il], s_t[j, iv * L + il])
                    for iv in T.unroll(NV):
                        for il in T.vectorized(L):
                            alpha[iv * L + il] = _fast_exp(m[iv * L + il] - stat[iv, il])
                            m[iv * L + il] = stat[iv, il]
                            stat[iv, il] = zero
                    for j in range(Tk):
                        for iv in T.unroll(NV):
                            for il in T.vectorized(L):
                                s_t[j, iv * L + il] = _fast_exp(s_t[j, iv * L + il] - m[iv * L + il])
                                stat[iv, il] = stat[iv, il] + s_t[j, iv * L + il]
                    for iv in T.unroll(NV):
                        for il in T.vectorized(L):
                            l_sum[iv * L + il] = l_sum[iv * L + il] * alpha[iv * L + il] + stat[iv, il]
                    # acc = acc * alpha + P.V: register tiles of (queries x head-dim vectors)
                    for io, dc in T.grid(Tq // R2, Dv // W2):
                        for ii in T.unroll(R2):
                            for dv in T.unroll(NW2):
                                for dd in T.vectorized(VW2):
                                    o_reg[ii, dv * VW2 + dd] = (
                                        acc[io * R2 + ii, dc * W2 + dv * VW2 + dd] * alpha[io * R2 + ii]
                                    )
                        for j in range(Tk):
                            for ii in T.unroll(R2):
                                for dv in T.unroll(NW2):
                                    for dd in T.vectorized(VW2):
                                        o_reg[ii, dv * VW2 + dd] = (
                                            o_reg[ii, dv * VW2 + dd]
                                            + s_t[j, io * R2 + ii]
                                            * v_p[b, n, k0 + j, dc * W2 + dv * VW2 + dd]
                                        )
                        for ii in T.unroll(R2):
                            for dv in T.unroll(NW2):
                                for dd in T.vectorized(VW2):
                                    acc[io * R2 + ii, dc * W2 + dv * VW2 + dd] = o_reg[ii, dv * VW2 + dd]
                for i in range(Tq):
                    if not ragged_q or q0 + i < Sq:
                        for d in T.vectorized(Dv):
                            out[b, q0 + i, n, d] = acc[i, d] / l_sum[i]

    q_shape, k_shape, v_shape, o_shape = (B, Sq, N, D), (B, Skv, N, D), (B, Skv, N, Dv), (B, Sq, N, Dv)
    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True, KERNEL_ATTR: KERNEL_NAME}
    if has_bias:

        @T.prim_func(private=True, s_tir=True)
        def attention_bias(
            q: T.Buffer(q_shape, dtype),
            k: T.Buffer(k_shape, dtype),
            v: T.Buffer(v_shape, dtype),
            bias: T.Buffer(shape.bias_shape, dtype),
            out: T.Buffer(o_shape, dtype),
        ):
            T.func_attr(attrs)
            body(q, k, v, bias, out)

        return attention_bias

    @T.prim_func(private=True, s_tir=True)
    def attention(
        q: T.Buffer(q_shape, dtype),
        k: T.Buffer(k_shape, dtype),
        v: T.Buffer(v_shape, dtype),
        out: T.Buffer(o_shape, dtype),
    ):
        T.func_attr(attrs)
        body(q, k, v, None, out)

    return attention


def cuda_attention_kernel(shape: AttentionShape, target: Target):
    return None


# -- legalization -------------------------------------------------------------------------------
def attention_kernel(shape: AttentionShape, target: Target):
    """The fused kernel for ``shape`` on ``target``, or None when there is none (TVM's
    legalization is used then)."""
    if shape.dtype != "float32":
        return None
    kind = target.kind.name
    if kind == "llvm":
        return cpu_attention_kernel(shape, target)
    if kind == "cuda":
        return cuda_attention_kernel(shape, target)
    return None


def legalize_attention(bb: relax.BlockBuilder, call: relax.Call):
    """``call_tir`` of the fused kernel for an ``R.nn.attention(_bias)`` call; None (TVM's
    legalization) without a target in scope, for symbolic shapes or other dtypes."""
    target = Target.current(allow_none=True)
    shape = AttentionShape.from_call(call)
    if target is None or shape is None:
        return None
    func = attention_kernel(shape, target)
    if func is None:
        return None
    gvar = bb.add_func(func, KERNEL_NAME)
    return relax.op.call_tir(gvar, relax.Tuple(list(call.args)), call.ty)


override_legalization("relax.nn.attention", legalize_attention)
override_legalization("relax.nn.attention_bias", legalize_attention)
