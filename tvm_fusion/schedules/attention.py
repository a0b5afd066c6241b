"""Fused attention kernels (FlashAttention-style) and ``LowerAttention``, the pass that uses them.

Run op by op, attention writes the scores (``batch x heads x S_q x S_kv``) to memory and reads
them back twice. The kernels here never materialise them: each task owns a tile of queries of
one head and walks the keys/values in tiles, keeping a running row max ``m``, a running sum
``l`` and the output accumulator, rescaled by ``exp(m_old - m_new)`` when the max grows (the
*online softmax* of FlashAttention). The largest buffer a task touches is its score tile.

CPU (:func:`cpu_attention_kernel`): parallel over ``batch x heads x query tiles``. Scores are
kept transposed (``[keys, queries]``) so the softmax statistics are SIMD over queries with no
horizontal reductions; ``K.Q^T`` is a register tile (keys x query vectors) on Q^T packed once per
head, ``P.V`` a register tile over the head dim; ``exp`` is a vectorizable polynomial (LLVM
calls scalar ``expf`` per lane otherwise). Tiles come from the target's vector width and
register count (:func:`cpu_tiles`). Causal tiles above the diagonal are skipped when that is
exact (see ``AttentionSpec``).

CUDA (:func:`cuda_attention_kernel`): one thread block per query tile of one head; Q, K/V tiles,
scores, accumulator and softmax state in shared memory. It is written so that binding the
threads to serial loops gives the same computation on the CPU (``emulate=True``, for tests).

Both are complete schedules marked ``tirx.is_scheduled``: the default rules and Meta-Schedule
task extraction leave them alone.

:class:`LowerAttention` replaces, for an LLVM or CUDA target, every call of a ``fused_attention``
function (made by ``FuseAttention``, carrying an ``AttentionSpec``) and every
``R.nn.attention`` / ``R.nn.attention_bias`` call with a ``call_tir`` of the kernel.
"""

from __future__ import annotations

import dataclasses
import json
import math

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.target import Target

from ..ir import static_shape, with_bindings
from ._util import num_cores, num_vector_registers, vector_lanes
from .attention_inputs import PackedInputs

SPEC_ATTR = "tvm_fusion.attention"
KERNEL_NAME = "flash_attention"
FLOAT32_LOWEST = -3.4028234663852886e38
EXP_ZERO_BELOW = -87.0  # _fast_exp(x) is exactly 0 for x below this
MAX_BIASES = 2
# CPU tiling (cpu_tiles)
MAX_QUERY_STEP = 96  # the query granularity the register tiles impose
MAX_QUERY_TILE = 128
SCORE_TILE_FLOATS = 8192  # a task's score tile (keys x queries): 32 KiB of float32
RESCALE_KEYS = 8  # one key tile's accumulator rescale and softmax passes cost about this many keys


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What a fused attention kernel computes (inputs in BSNH layout, as ``R.nn.attention``)::

        score = Q.K^T * scale
        score += bias_i                              for the biases before the causal mask
        score = j <= i + causal_offset ? score : causal_fill          (if causal)
        score += bias_i                              for the biases after it
        out = softmax(score, keys) . V               (NaN rows -> 0 with nan_to_zero)

    ``causal_fill = -inf`` excludes masked keys. Key tiles wholly above the diagonal are
    skipped when their weights are exactly 0: always for ``-inf``, otherwise once every row of
    the query tile has a max above ``causal_fill + max(biases after) - EXP_ZERO_BELOW``; a row
    whose scores are all equal to the fill (fully masked) still sees every key, so its
    (uniform) weights are what the unfused graph computes.
    """

    batch: int
    heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    scale: float
    bias_shapes: tuple = ()  # 4-D shapes broadcast to (batch, heads, seq_q, seq_kv)
    causal_offset: int | None = None
    causal_fill: float = -math.inf
    biases_before_causal: int = 0
    nan_to_zero: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        want = (self.batch, self.heads, self.seq_q, self.seq_kv)
        for shape in self.bias_shapes:
            if (
                len(shape) != 4
                or shape[-1] != self.seq_kv
                or any(s not in (1, w) for s, w in zip(shape, want))
            ):
                raise ValueError(f"bias shape {shape} does not broadcast per key to {want}")

    # -- (de)serialisation: a fused_attention function carries its spec as a JSON attribute
    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["bias_shapes"] = [list(s) for s in self.bias_shapes]
        data["causal_fill"] = repr(float(self.causal_fill))
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AttentionSpec:
        data = json.loads(text)
        data["bias_shapes"] = tuple(tuple(s) for s in data["bias_shapes"])
        data["causal_fill"] = float(data["causal_fill"])
        return cls(**data)

    @property
    def input_shapes(self) -> list[tuple[int, int, int, int]]:
        """Q, K and V's BSNH shapes."""
        B, N, D = self.batch, self.heads, self.head_dim
        return [(B, self.seq_q, N, D), (B, self.seq_kv, N, D), (B, self.seq_kv, N, self.head_dim_v)]

    def describe(self) -> str:
        parts = [f"scale {self.scale:.6g}"]
        if self.bias_shapes:
            parts.append("additive mask " + ", ".join("x".join(map(str, s)) for s in self.bias_shapes))
        if self.causal_offset is not None:
            parts.append(f"causal (offset {self.causal_offset}, masked = {self.causal_fill:g})")
        if self.nan_to_zero:
            parts.append("NaN rows -> 0")
        parts.append(f"{self.batch}x{self.heads} heads, S {self.seq_q}x{self.seq_kv}, d {self.head_dim}")
        return ", ".join(parts)

    @classmethod
    def from_attention_op(cls, call: relax.Call) -> AttentionSpec | None:
        """The spec of an ``R.nn.attention(_bias)`` call (causal keys excluded, as TVM's own
        legalization does), or None when it is not static 4-D."""
        args = list(call.args)
        shapes = [_static_shape(a) for a in args]
        if any(s is None or len(s) != 4 for s in shapes):
            return None
        (b, sq, n, d), (bk, skv, nk, dk), (bv, sv, nv, dv) = shapes[:3]
        if (bk, nk, dk) != (b, n, d) or (bv, sv, nv) != (b, skv, n):
            return None
        dtypes = {str(a.ty.dtype) for a in args}
        attrs = call.attrs
        if len(dtypes) != 1 or getattr(attrs, "window_size", None) is not None:
            return None
        scale = 1.0 / math.sqrt(d) if attrs.scale is None else float(attrs.scale.value)
        offsets = {None: None, "TopLeft": 0, "BottomRight": abs(sq - skv)}  # as TVM defines them
        if attrs.causal_mask not in offsets:
            return None
        try:
            return cls(b, n, sq, skv, d, dv, scale, tuple(tuple(s) for s in shapes[3:]),
                       offsets[attrs.causal_mask], dtype=dtypes.pop())  # fmt: skip
        except ValueError:
            return None


def _static_shape(expr) -> list[int] | None:
    dims = static_shape(expr)
    return None if dims is None else list(dims)


def _f32(value: float):
    return tirx.const(value, "float32")


def _n_diag_tiles(spec: AttentionSpec, q0, q_tile: int, kv_tile: int, ragged_q: bool):
    """Key tiles holding a key some query of the tile [q0, q0 + q_tile) keeps."""
    last = T.min(q0 + q_tile, spec.seq_q) - 1 if ragged_q else q0 + q_tile - 1
    n_tiles = -(-spec.seq_kv // kv_tile)
    return T.min(T.max((last + spec.causal_offset) // kv_tile + 1, 1), n_tiles)


def _skips_exactly(spec: AttentionSpec) -> bool:
    return spec.causal_offset is not None and spec.causal_fill == -math.inf


# -- CPU ------------------------------------------------------------------------------------------
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


def _register_tiles(regs: int, lanes: int, width_ok) -> list[tuple[int, int, float]]:
    """(rows, vectors, FMAs per load) of register tiles whose ``rows * vectors`` accumulators,
    one broadcast and ``vectors`` loaded operands fit in the register file."""
    tiles = []
    for vectors in range(1, 9):
        rows = min((regs - vectors - 1) // vectors, 8)
        if rows >= 1 and width_ok(vectors * lanes):
            tiles.append((rows, vectors, rows * vectors / (rows + vectors)))
    return tiles


def pv_vector_width(columns: int, lanes: int) -> int:
    """SIMD width of the P.V accumulators over ``columns`` head-dim columns: whole vectors where
    the columns allow, else the widest divisor of them that fits one register. One <36 x float>
    accumulator per row (MobileViT's head dim 36) made the kernel 8x slower than three 12-lane
    ones (B4 x H4, S 256: 7.9 -> 0.99 ms; head dims 20, 24, 40, 72 alike)."""
    return lanes if columns % lanes == 0 else max(w for w in range(1, lanes + 1) if columns % w == 0)


def cpu_tiles(spec: AttentionSpec, target: Target) -> CpuTiles:
    """Tile sizes from the target's SIMD width and register count (no machine constants).

    Register tiles (``K.Q^T`` and ``P.V``) come from the register file; the query and key tiles
    are then chosen for the least work, padding and skipped causal tiles counted: a kernel
    computes whole tiles, so ViT's 197 tokens in query tiles of 48 and key tiles of 64 computed
    240 x 256 scores, 1.58x the real ones (1.03 ms; 0.73 ms with tiles of 16 x 200). Each key
    tile also rescales the accumulator (``RESCALE_KEYS``); the score tile stays within
    ``SCORE_TILE_FLOATS``; ties go to the register tiles with the most FMAs per load."""
    lanes = vector_lanes(target, spec.dtype)
    regs = num_vector_registers(target)
    cores = num_cores(target)
    dv = spec.head_dim_v
    qk = _register_tiles(regs, lanes, lambda w: w <= 64)
    # no multiple of the SIMD width divides the head dim: one row is dv / width narrower vectors,
    # each in its own register (see pv_vector_width). Rows: the most, a power of two (query tiles
    # are multiples of it), whose accumulators fit the registers. B4 x H4, AVX-512, 2 threads:
    # d 72 in 4 rows 1.84 ms (6, the rule before: 2.32; 5: 3.1 with its odd query tiles); d 40 and
    # 60 in 8 rows of 4 vectors 1.21 / 0.12 ms (6 rows, leaving registers for the loads: 1.40 /
    # 0.18). A prime head dim still gets one-lane vectors (and spills).
    vectors = dv // pv_vector_width(dv, lanes)
    rows = 1 << (max(1, min(8, regs // vectors)).bit_length() - 1)
    pv = _register_tiles(regs, lanes, lambda w: dv % w == 0) or [(rows, 0, 0.0)]
    pairs = [(math.lcm(c1 * lanes, r2), (r1, c1, e1), (r2, c2, e2)) for r1, c1, e1 in qk for r2, c2, e2 in pv]
    min_step = min(step for step, _, _ in pairs)
    max_step = MAX_QUERY_STEP if min_step <= MAX_QUERY_STEP else min_step  # e.g. 7-row P.V tiles
    best = None
    for step, (r1, c1, e1), (r2, c2, e2) in pairs:
        if step > max_step:
            continue
        for q_tile in range(step, max(step, MAX_QUERY_TILE) + 1, step):
            tasks = spec.batch * spec.heads * -(-spec.seq_q // q_tile)
            slots = -(-tasks // cores) * cores  # tasks rounded up to whole rounds over the cores
            for kv_tile in _tight_tiles(spec.seq_kv, r1):
                if q_tile * kv_tile > SCORE_TILE_FLOATS and kv_tile > r1:
                    continue
                key = (tile_work(spec, q_tile, kv_tile) * slots / tasks, -(e1 + e2), abs(q_tile - 64))
                if best is None or key < best[0]:
                    best = (
                        key,
                        CpuTiles(q_tile, kv_tile, r1, c1 * lanes, r2, c2 * lanes if c2 else dv, lanes),
                    )
    return best[1]


def _tight_tiles(extent: int, multiple: int) -> list[int]:
    """Tile sizes (multiples of ``multiple``) that cover ``extent`` in n tiles with the least padding."""
    rows = -(-extent // multiple)
    return sorted({multiple * -(-rows // n) for n in range(1, rows + 1)})


def tile_work(spec: AttentionSpec, q_tile: int, kv_tile: int) -> int:
    """Score entries the kernel computes with these tiles (padding and causal skips included),
    plus ``RESCALE_KEYS`` keys' worth per key tile a query tile visits."""
    n_kv = -(-spec.seq_kv // kv_tile)
    visits = 0
    for q0 in range(0, spec.seq_q, q_tile):
        if spec.causal_offset is None:
            visits += n_kv
        else:
            last = min(q0 + q_tile, spec.seq_q) - 1
            visits += min(max((last + spec.causal_offset) // kv_tile + 1, 1), n_kv)
    return q_tile * (kv_tile + RESCALE_KEYS) * visits


def _fast_exp(x):
    """exp(x) for float32 x <= 0 as a polynomial (Cephes, as ``topi.fast_exp``; relative error
    ~1e-7), vectorizable; exactly 0 below -87, so ``exp(-inf) = 0`` and a row of ``-inf`` sums
    to 0 (softmax then gives 0 / 0 = NaN, as it does unfused)."""
    clamped = T.max(x, _f32(EXP_ZERO_BELOW))
    n = T.floor(clamped * _f32(1.44269504088896341) + _f32(0.5))
    r = clamped - n * _f32(0.6931471805599453)
    poly = _f32(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        poly = poly * r + _f32(coef)
    poly = poly * r * r + r + _f32(1.0)
    two_n = T.reinterpret("float32", T.shift_left(T.Cast("int32", n + _f32(127.0)), 23))
    return T.Select(x < _f32(EXP_ZERO_BELOW), _f32(0.0), two_n * poly)


def _bias_index(shape, b, n, i, j):
    return (b if shape[0] > 1 else 0, n if shape[1] > 1 else 0, i if shape[2] > 1 else 0, j)


def cpu_attention_kernel(
    spec: AttentionSpec, target: Target, tiles: CpuTiles | None = None, views: tuple = (None, None, None)
):
    """The scheduled CPU PrimFunc ``(q, k, v, *biases, out)`` computing ``spec``; an input with a
    :class:`ColumnView` in ``views`` is the packed projection it is a columns slice of."""
    tiles = tiles or cpu_tiles(spec, target)
    B, N, Sq, Skv = spec.batch, spec.heads, spec.seq_q, spec.seq_kv
    D, Dv, dtype = spec.head_dim, spec.head_dim_v, spec.dtype
    Tq, Tk, L = tiles.q_tile, tiles.kv_tile, tiles.lanes
    R1, W1, R2, W2 = tiles.qk_rows, tiles.qk_cols, tiles.pv_rows, tiles.pv_cols
    QT, KT = -(-Sq // Tq), -(-Skv // Tk)
    Sq_pad, Skv_pad = QT * Tq, KT * Tk
    ragged_q, ragged_kv = Sq % Tq != 0, Skv % Tk != 0
    NV = Tq // L  # query vectors per tile (softmax statistics)
    VW2 = pv_vector_width(W2, L)  # P.V columns per SIMD vector
    NW2 = W2 // VW2
    causal = spec.causal_offset is not None
    off = spec.causal_offset or 0
    n_before = spec.biases_before_causal if causal else len(spec.bias_shapes)
    # a bias that varies over queries is read transposed ([key, query], repacked once); one that
    # does not is read per key (repacked only when the keys are padded)
    packed = [s[2] > 1 or ragged_kv for s in spec.bias_shapes]
    packed_shapes = [(s[0], s[1], Skv_pad, Sq_pad if s[2] > 1 else 1) for s in spec.bias_shapes]
    # exact tile skipping with a finite fill needs the largest bias added after the mask
    dynamic_skip = causal and not _skips_exactly(spec)
    n_bias = len(spec.bias_shapes)
    n_after = n_bias - n_before

    def pack_shape(k):
        return packed_shapes[k] if k < n_bias and packed[k] else (1,)

    # the bias repacking's tasks (batch x heads x key tiles): a loop of one task stays serial
    pack_tasks = [s[0] * s[1] * KT for s in packed_shapes]
    pack_loops = [T.parallel if n > 1 else T.serial for n in pack_tasks]

    def read_input(buf, which, b, s, n, d):
        """Q, K or V at (batch, seq, head, dim): BSNH, or columns of a packed projection."""
        view = views[which]
        if view is None:
            return buf[b, s, n, d]
        _, seq, _, dim = spec.input_shapes[which]
        return buf[tuple(view.index(b * seq + s, n * dim + d))]

    scale, neg_inf, lowest, zero = _f32(spec.scale), _f32(-math.inf), _f32(FLOAT32_LOWEST), _f32(0.0)

    def read_bias(biases, packs, k, b, n, i, j):
        shape = spec.bias_shapes[k]
        if packed[k]:
            return packs[k][b if shape[0] > 1 else 0, n if shape[1] > 1 else 0, j, i if shape[2] > 1 else 0]
        return biases[k][_bias_index(shape, b, n, i, j)]

    def score(acc, biases, packs, b, n, i, j):
        """What softmax sees for query i, key j (acc = q_i . k_j)."""
        val = acc * scale
        for k in range(n_before):
            val = val + read_bias(biases, packs, k, b, n, i, j)
        if causal:
            val = T.Select(j <= i + off, val, _f32(spec.causal_fill))
        for k in range(n_before, len(spec.bias_shapes)):
            val = val + read_bias(biases, packs, k, b, n, i, j)
        if ragged_kv:
            val = T.Select(j < Skv, val, neg_inf)
        return val

    def finish(val):
        return T.Select(T.isnan(val), zero, val) if spec.nan_to_zero else val

    def skip_threshold(bias_max):
        return _f32(spec.causal_fill) + bias_max[0] - _f32(EXP_ZERO_BELOW)

    def n_tiles(q0):
        if causal and not dynamic_skip:
            return _n_diag_tiles(spec, q0, Tq, Tk, ragged_q)
        return KT

    def tile_needed(kv, q0, skip):
        if not dynamic_skip:
            return True
        return tirx.Or(kv < _n_diag_tiles(spec, q0, Tq, Tk, ragged_q), skip[0] == 0)

    @T.macro
    def kv_step(
        q_t, k_p, v_p, biases, packs, m, l_sum, alpha, stat, acc, s_t, s_reg, o_reg, b, n, qt, q0, kv
    ):
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
                                + k_p[b, n, k0 + jo * R1 + jj, d] * q_t[b, n, qt, d, io * W1 + iv * L + il]
                            )
            for jj in T.unroll(R1):
                for iv in T.unroll(W1 // L):
                    for il in T.vectorized(L):
                        s_t[jo * R1 + jj, io * W1 + iv * L + il] = score(
                            s_reg[jj, iv * L + il],
                            biases,
                            packs,
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
                                + s_t[j, io * R2 + ii] * v_p[b, n, k0 + j, dc * W2 + dv * VW2 + dd]
                            )
            for ii in T.unroll(R2):
                for dv in T.unroll(NW2):
                    for dd in T.vectorized(VW2):
                        acc[io * R2 + ii, dc * W2 + dv * VW2 + dd] = o_reg[ii, dv * VW2 + dd]

    @T.macro
    def bias_pack(bias, pack, shape, pshape, task):
        # one key tile of one (batch, head) slice in the [key, query] (or [key]) layout, zeros
        # past the last key (the score masks those keys); the tiles in parallel (T5's 8 x 128 x
        # 128 position bias, packed serially, was about a third of its attention kernel's time)
        bb = task // (pshape[1] * KT)
        nb = task // KT % pshape[1]
        for jj, i in T.grid(Tk, pshape[3]):
            j = task % KT * Tk + jj
            pack[bb, nb, j, i] = T.if_then_else(
                j < Skv, bias[bb, nb, T.min(i, shape[2] - 1), T.min(j, Skv - 1)], zero
            )

    @T.macro
    def reduce_max(bias, shape, bias_max):
        for bb, nb, i, j in T.grid(shape[0], shape[1], shape[2], shape[3]):
            bias_max[0] = T.max(bias_max[0], bias[bb, nb, i, j])

    @T.macro
    def body(q, k, v, biases, out):
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
                    q_t[bn // N, bn % N, i // Tq, d, i % Tq] = read_input(q, 0, bn // N, i, bn % N, d)
                for i, d in T.grid(Sq_pad - Sq, D):
                    q_t[bn // N, bn % N, (Sq + i) // Tq, d, (Sq + i) % Tq] = zero
                for j in range(Skv):
                    for d in T.vectorized(D):
                        k_p[bn // N, bn % N, j, d] = read_input(k, 1, bn // N, j, bn % N, d)
                    for d in T.vectorized(Dv):
                        v_p[bn // N, bn % N, j, d] = read_input(v, 2, bn // N, j, bn % N, d)
                for j in range(Skv_pad - Skv):
                    for d in T.vectorized(D):
                        k_p[bn // N, bn % N, Skv + j, d] = zero
                    for d in T.vectorized(Dv):
                        v_p[bn // N, bn % N, Skv + j, d] = zero
        pack0 = T.sblock_alloc_buffer(pack_shape(0), dtype)
        pack1 = T.sblock_alloc_buffer(pack_shape(1), dtype)
        packs = [pack0, pack1]
        if n_bias > 0 and packed[0]:
            for task in pack_loops[0](pack_tasks[0]):
                with T.sblock("pack_bias0"):
                    T.reads()
                    T.writes()
                    bias_pack(biases[0], pack0, spec.bias_shapes[0], packed_shapes[0], task)
        if n_bias > 1 and packed[1]:
            for task in pack_loops[1](pack_tasks[1]):
                with T.sblock("pack_bias1"):
                    T.reads()
                    T.writes()
                    bias_pack(biases[1], pack1, spec.bias_shapes[1], packed_shapes[1], task)
        bias_max = T.sblock_alloc_buffer((1,), dtype)
        with T.sblock("bias_max"):
            T.reads()
            T.writes()
            bias_max[0] = zero
            if dynamic_skip and n_after > 0:
                bias_max[0] = lowest
                if n_before == 0:
                    reduce_max(biases[0], spec.bias_shapes[0], bias_max)
                if n_bias > 1:
                    reduce_max(biases[1], spec.bias_shapes[1], bias_max)
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
                skip = T.sblock_alloc_buffer((1,), "int32", scope="local")
                b = task // (N * QT)
                n = task // QT % N
                qt = task % QT
                q0 = qt * Tq
                skip[0] = 0
                for i in T.vectorized(Tq):
                    m[i] = lowest
                    l_sum[i] = zero
                for i in range(Tq):
                    for d in T.vectorized(Dv):
                        acc[i, d] = zero
                for kv in range(n_tiles(q0)):
                    if tile_needed(kv, q0, skip):
                        kv_step(q_t, k_p, v_p, biases, packs, m, l_sum, alpha, stat, acc, s_t, s_reg, o_reg,
                                b, n, qt, q0, kv)  # fmt: skip
                    if dynamic_skip:
                        if kv == _n_diag_tiles(spec, q0, Tq, Tk, ragged_q) - 1:
                            skip[0] = 1
                            for i in range(Tq):
                                if m[i] <= skip_threshold(bias_max):
                                    skip[0] = 0
                for i in range(Tq):
                    if not ragged_q or q0 + i < Sq:
                        for d in T.vectorized(Dv):
                            out[b, q0 + i, n, d] = finish(acc[i, d] / l_sum[i])

    return _wrap(spec, body, "cpu", views)


def _wrap(spec: AttentionSpec, body, kind: str, views: tuple = (None, None, None)):
    """The PrimFunc around ``body`` with one parameter per bias (TVMScript signatures are fixed)."""
    q_shape, k_shape, v_shape = (
        s if view is None else view.shape for s, view in zip(spec.input_shapes, views)
    )
    o_shape, dtype = (spec.batch, spec.seq_q, spec.heads, spec.head_dim_v), spec.dtype
    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True, SPEC_ATTR: spec.to_json()}
    bias_shapes = spec.bias_shapes
    if len(bias_shapes) == 0:

        @T.prim_func(private=True, s_tir=True)
        def flash_attention(
            q: T.Buffer(q_shape, dtype),
            k: T.Buffer(k_shape, dtype),
            v: T.Buffer(v_shape, dtype),
            out: T.Buffer(o_shape, dtype),
        ):
            T.func_attr(attrs)
            body(q, k, v, [], out)

    elif len(bias_shapes) == 1:

        @T.prim_func(private=True, s_tir=True)
        def flash_attention(
            q: T.Buffer(q_shape, dtype),
            k: T.Buffer(k_shape, dtype),
            v: T.Buffer(v_shape, dtype),
            bias0: T.Buffer(bias_shapes[0], dtype),
            out: T.Buffer(o_shape, dtype),
        ):
            T.func_attr(attrs)
            body(q, k, v, [bias0], out)

    elif len(bias_shapes) == 2:

        @T.prim_func(private=True, s_tir=True)
        def flash_attention(
            q: T.Buffer(q_shape, dtype),
            k: T.Buffer(k_shape, dtype),
            v: T.Buffer(v_shape, dtype),
            bias0: T.Buffer(bias_shapes[0], dtype),
            bias1: T.Buffer(bias_shapes[1], dtype),
            out: T.Buffer(o_shape, dtype),
        ):
            T.func_attr(attrs)
            body(q, k, v, [bias0, bias1], out)

    else:
        raise ValueError(f"at most {MAX_BIASES} biases, got {len(bias_shapes)}")
    return flash_attention


# -- CUDA -----------------------------------------------------------------------------------------
def cuda_attention_kernel(spec: AttentionSpec, target: Target | None = None, emulate: bool = False):
    """The CUDA PrimFunc ``(q, k, v, *biases, out)`` computing ``spec``: one thread block per
    query tile of one head, 128 threads, tiles in shared memory (under 48 KiB). With
    ``emulate=True`` blocks and threads are serial loops and shared memory is global: the same
    computation, runnable on the CPU (tests check the kernel's indexing there)."""
    B, N, Sq, Skv = spec.batch, spec.heads, spec.seq_q, spec.seq_kv
    D, Dv, dtype = spec.head_dim, spec.head_dim_v, spec.dtype
    NT = 128
    Tq = Tk = 32
    while Tq > 8 and 4 * (Tq * D + Tk * D + Tk * Dv + 2 * Tq * Tk + Tq * Dv + 3 * Tq) > 48 * 1024:
        Tq, Tk = Tq // 2, Tk // 2
    QT, KT = -(-Sq // Tq), -(-Skv // Tk)
    ragged_q = Sq % Tq != 0
    causal = spec.causal_offset is not None
    off = spec.causal_offset or 0
    n_before = spec.biases_before_causal if causal else len(spec.bias_shapes)
    shared = "global" if emulate else "shared"
    neg_inf, lowest, zero = _f32(-math.inf), _f32(FLOAT32_LOWEST), _f32(0.0)

    def blocks(extent):
        return T.serial(extent) if emulate else T.thread_binding(extent, thread="blockIdx.x")

    def threads():
        return T.serial(NT) if emulate else T.thread_binding(NT, thread="threadIdx.x")

    def score(acc, biases, b, n, i, j):
        val = acc * _f32(spec.scale)
        for kb in range(n_before):
            val = val + biases[kb][_bias_index(spec.bias_shapes[kb], b, n, i, j)]
        if causal:
            val = T.Select(j <= i + off, val, _f32(spec.causal_fill))
        for kb in range(n_before, len(spec.bias_shapes)):
            val = val + biases[kb][_bias_index(spec.bias_shapes[kb], b, n, i, j)]
        return val

    def finish(val):
        return T.Select(T.isnan(val), zero, val) if spec.nan_to_zero else val

    def n_tiles(q0):
        return _n_diag_tiles(spec, q0, Tq, Tk, ragged_q) if _skips_exactly(spec) else KT

    def steps(total):
        return -(-total // NT)

    def inside(e, total):
        return True if total % NT == 0 else e < total

    @T.macro
    def body(q, k, v, biases, out):
        for task in blocks(B * N * QT):
            with T.sblock("tile"):
                T.reads()
                T.writes()
                q_s = T.sblock_alloc_buffer((Tq, D), dtype, scope=shared)
                k_s = T.sblock_alloc_buffer((Tk, D), dtype, scope=shared)
                v_s = T.sblock_alloc_buffer((Tk, Dv), dtype, scope=shared)
                s_s = T.sblock_alloc_buffer((Tq, Tk), dtype, scope=shared)
                p_s = T.sblock_alloc_buffer((Tq, Tk), dtype, scope=shared)
                acc = T.sblock_alloc_buffer((Tq, Dv), dtype, scope=shared)
                m = T.sblock_alloc_buffer((Tq,), dtype, scope=shared)
                l_sum = T.sblock_alloc_buffer((Tq,), dtype, scope=shared)
                alpha = T.sblock_alloc_buffer((Tq,), dtype, scope=shared)
                reg = T.sblock_alloc_buffer((2,), dtype, scope="local")  # per thread
                b = task // (N * QT)
                n = task // QT % N
                q0 = task % QT * Tq
                for t in threads():
                    for e0 in range(steps(Tq * D)):
                        if inside(e0 * NT + t, Tq * D):
                            q_s[(e0 * NT + t) // D, (e0 * NT + t) % D] = T.if_then_else(
                                q0 + (e0 * NT + t) // D < Sq,
                                q[b, T.min(q0 + (e0 * NT + t) // D, Sq - 1), n, (e0 * NT + t) % D],
                                zero,
                            )
                    for e0 in range(steps(Tq * Dv)):
                        if inside(e0 * NT + t, Tq * Dv):
                            acc[(e0 * NT + t) // Dv, (e0 * NT + t) % Dv] = zero
                    for e0 in range(steps(Tq)):
                        if inside(e0 * NT + t, Tq):
                            m[e0 * NT + t] = lowest
                            l_sum[e0 * NT + t] = zero
                for kv in range(n_tiles(q0)):
                    for t in threads():
                        for e0 in range(steps(Tk * D)):
                            if inside(e0 * NT + t, Tk * D):
                                k_s[(e0 * NT + t) // D, (e0 * NT + t) % D] = T.if_then_else(
                                    kv * Tk + (e0 * NT + t) // D < Skv,
                                    k[b, T.min(kv * Tk + (e0 * NT + t) // D, Skv - 1), n, (e0 * NT + t) % D],
                                    zero,
                                )
                        for e0 in range(steps(Tk * Dv)):
                            if inside(e0 * NT + t, Tk * Dv):
                                v_s[(e0 * NT + t) // Dv, (e0 * NT + t) % Dv] = T.if_then_else(
                                    kv * Tk + (e0 * NT + t) // Dv < Skv,
                                    v[
                                        b,
                                        T.min(kv * Tk + (e0 * NT + t) // Dv, Skv - 1),
                                        n,
                                        (e0 * NT + t) % Dv,
                                    ],
                                    zero,
                                )
                    for t in threads():
                        for e0 in range(steps(Tq * Tk)):
                            if inside(e0 * NT + t, Tq * Tk):
                                reg[0] = zero
                                for d in range(D):
                                    reg[0] = reg[0] + q_s[(e0 * NT + t) // Tk, d] * k_s[(e0 * NT + t) % Tk, d]
                                s_s[(e0 * NT + t) // Tk, (e0 * NT + t) % Tk] = T.if_then_else(
                                    kv * Tk + (e0 * NT + t) % Tk < Skv,
                                    score(
                                        reg[0],
                                        biases,
                                        b,
                                        n,
                                        T.min(q0 + (e0 * NT + t) // Tk, Sq - 1),
                                        T.min(kv * Tk + (e0 * NT + t) % Tk, Skv - 1),
                                    ),
                                    neg_inf,
                                )
                    for t in threads():
                        for e0 in range(steps(Tq)):
                            if inside(e0 * NT + t, Tq):
                                reg[0] = m[e0 * NT + t]  # the new row max
                                for j in range(Tk):
                                    reg[0] = T.max(reg[0], s_s[e0 * NT + t, j])
                                reg[1] = l_sum[e0 * NT + t] * T.exp(m[e0 * NT + t] - reg[0])  # the new sum
                                for j in range(Tk):
                                    p_s[e0 * NT + t, j] = T.exp(s_s[e0 * NT + t, j] - reg[0])
                                    reg[1] = reg[1] + p_s[e0 * NT + t, j]
                                alpha[e0 * NT + t] = T.exp(m[e0 * NT + t] - reg[0])
                                m[e0 * NT + t] = reg[0]
                                l_sum[e0 * NT + t] = reg[1]
                    for t in threads():
                        for e0 in range(steps(Tq * Dv)):
                            if inside(e0 * NT + t, Tq * Dv):
                                reg[0] = (
                                    acc[(e0 * NT + t) // Dv, (e0 * NT + t) % Dv] * alpha[(e0 * NT + t) // Dv]
                                )
                                for j in range(Tk):
                                    reg[0] = (
                                        reg[0]
                                        + T.exp(s_s[(e0 * NT + t) // Dv, j] - m[(e0 * NT + t) // Dv])
                                        * v_s[j, (e0 * NT + t) % Dv]
                                    )
                                acc[(e0 * NT + t) // Dv, (e0 * NT + t) % Dv] = reg[0]
                for t in threads():
                    for e0 in range(steps(Tq * Dv)):
                        if inside(e0 * NT + t, Tq * Dv):
                            if q0 + (e0 * NT + t) // Dv < Sq:
                                out[b, q0 + (e0 * NT + t) // Dv, n, (e0 * NT + t) % Dv] = finish(
                                    acc[(e0 * NT + t) // Dv, (e0 * NT + t) % Dv] / l_sum[(e0 * NT + t) // Dv]
                                )

    return _wrap(spec, body, "cuda")


def attention_kernel(spec: AttentionSpec, target: Target, views: tuple = (None, None, None)):
    """The fused kernel for ``spec`` on ``target``, or None when there is none. ``views``: the
    inputs read from packed projections (CPU only; see ``attention_inputs``)."""
    if spec.dtype != "float32" or len(spec.bias_shapes) > MAX_BIASES:
        return None
    kind = target.kind.name
    if kind == "llvm":
        return cpu_attention_kernel(spec, target, views=views)
    if any(views):
        raise ValueError(f"packed attention inputs are read by the CPU kernel only, not on {kind}")
    if kind == "cuda":
        return cuda_attention_kernel(spec, target)
    return None


# -- the lowering pass -----------------------------------------------------------------------------
ATTENTION_OPS = ("relax.nn.attention", "relax.nn.attention_bias")


def fused_attention_spec(func) -> AttentionSpec | None:
    """The spec a ``fused_attention`` Relax function (made by FuseAttention) carries."""
    if not isinstance(func, relax.Function) or func.attrs is None or SPEC_ATTR not in func.attrs.keys():
        return None
    return AttentionSpec.from_json(str(func.attrs[SPEC_ATTR]))


@tvm.transform.module_pass(opt_level=0, name="LowerAttention")
class LowerAttention:
    """Replace fused attention (``fused_attention`` functions and ``R.nn.attention(_bias)``) by
    ``call_tir`` of the scheduled kernel for ``target``; anything without a kernel (other targets,
    symbolic shapes, other dtypes) is left for ``LegalizeOps`` (one fused kernel per
    ``fused_attention`` after FuseTIR, TVM's own legalization for the ops).

    Parameters
    ----------
    target : Target | str | dict | None
        None: the target in scope (``with target:``).
    """

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target
        if target is not None and not isinstance(target, Target):
            from ..targets import parse_target

            target = parse_target(target)
        target = target or Target.current(allow_none=True)
        if target is None:
            return mod
        builder = relax.BlockBuilder(mod)
        updates = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            new_func = _lower_calls(func, mod, builder, target)
            if new_func is not None:
                updates[gvar] = new_func
        if not updates:
            return mod
        new_mod = builder.get()
        for gvar, func in updates.items():
            new_mod[gvar] = func
        return relax.transform.DeadCodeElimination()(new_mod)


def _lower_calls(func, mod, builder, target):
    replace = {}
    for block in func.body.blocks:
        packed = PackedInputs(mod, block) if target.kind.name == "llvm" else None
        for binding in block.bindings:
            lowered = (
                _lower(binding, mod, builder, target, packed)
                if isinstance(binding, relax.VarBinding)
                else None
            )
            if lowered is not None:
                replace[binding.var] = lowered
    return with_bindings(func, replace) if replace else None


def _lower(binding, mod, builder, target, packed):
    call = binding.value
    if not isinstance(call, relax.Call):
        return None
    args = list(call.args)
    if isinstance(call.op, tvm.ir.Op) and call.op.name in ATTENTION_OPS:
        spec = AttentionSpec.from_attention_op(call)
    elif isinstance(call.op, relax.GlobalVar) and call.op in mod.functions:
        spec = fused_attention_spec(mod[call.op])
        if spec is not None:
            args = args[: 3 + len(spec.bias_shapes)]  # the trailing causal mask is the reference's
    else:
        return None
    if spec is None:
        return None
    views = [None, None, None]
    if packed is not None:  # Q, K, V read from the projections they were cut from (no copies)
        for i, shape in enumerate(spec.input_shapes):
            found = packed.column_view(args[i], shape)
            if found is not None:
                args[i], views[i] = found
    kernel = attention_kernel(spec, target, tuple(views))
    if kernel is None:
        return None
    gvar = builder.add_func(kernel, KERNEL_NAME)
    return relax.op.call_tir(gvar, relax.Tuple(args), binding.var.ty)
