"""Winograd F(m×m, 3×3) legalization of 3×3 stride-1 NCHW conv2d on LLVM CPUs (m = 2 or 4).

Why: ResNet-style nets spend most of their time in 3×3 convs, and the direct conv is near the
GEMM roofline; Winograd needs (m+2)²/(9 m²) of the multiplies (F(2): 0.44, F(4): 0.25).

The conv becomes five or six TE stages, each block annotated ``tvm_fusion.winograd = <stage>`` (the
``Winograd`` schedule rule recognises them by that, see ``schedules/winograd.py``):

* ``weight``: ``U[e, ν, c, k] = Σ G[e, i] g[k, c, i, j] G[ν, j]``, reading only the weight, so the
  schedule marks it a layout-rewrite preproc block and ``SplitLayoutRewritePreproc`` +
  ``FoldConstant`` evaluate it at compile time when the weight is a constant (the kernel then
  takes ``U`` as an argument; nothing of it runs at run time). Summed in float64.
* ``pad``: the zero-padded input (up to whole tiles) in polyphase layout
  ``P[b, c, y, r, q] = d[b, c, y, q·m + r]``, so that column ``tx·m + j`` of every tile in a row
  is a contiguous vector ``P[.., j mod m, tx + j / m]`` over the tiles;
* ``input``: ``V[e, ν, c, b, ty, tx] = Σ B[a, e] d[b, c, ty·m + a, tx·m + a'] B[a', ν]`` (for F(4) in two
  passes, ``input_rows`` = d B first), over the tile columns rounded up to whole vectors;
* ``gemm``: ``M[e, ν, k, b, ty, tx] = Σ_c U[e, ν, c, k] V[e, ν, c, b, ty, tx]``, a batch of α²
  GEMMs (the only reduction);
* ``output``: ``Y[b, k, h, w] = Σ A[e, h mod m] M[e, ν, k, b, h / m, w / m] A[ν, w mod m]``, the
  conv's result, on which FuseTIR appends the fused epilogue (bias, residual add, relu, clip).

Transforms are written as one expression per (row, column) of the small matrices with only the
non-zero terms and literal coefficients, selected by the block's iteration indices: once the
schedule unrolls those loops the selection folds away, and no multiply by 0 is ever computed.
Matrices: TVM's Cook-Toom construction (``topi.nn.winograd_util``), points [0, -1, 1] for F(2) and
[0, -1, 1, 1/2, -2] for F(4) (the low-error choice of Barabasz et al.).

Which convs take which form is a pipeline decision (:func:`conv_algorithms`): a table from conv
signature to ``direct`` / ``winograd2`` / ``winograd4``, made by tuning, with a measured cost rule
(:func:`default_algorithm`) for convs it does not list.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.topi.nn import winograd_util

from .conv_args import cpu_float32_nchw_conv, padded_width
from .selected_sums import selected_sums

STAGE = "tvm_fusion.winograd"  # block annotation: weight / pad / input_rows / input / gemm / output
TILE = "tvm_fusion.winograd_tile"  # block annotation on every stage: m
SIGNATURE = "tvm_fusion.conv_signature"  # block annotation on the gemm stage (tuning groups by it)
DIRECT = "direct"
FORMS = {"winograd2": 2, "winograd4": 4}
ALGORITHMS = (DIRECT, *FORMS)


@functools.cache
def transform_matrices(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(A, B, G)`` of F(m×m, 3×3) in float64: A is α×m, B α×α, G α×3 (α = m + 2)."""
    alpha = m + 2
    points = winograd_util._interpolation_points(alpha)  # pylint: disable=protected-access
    a, b, g = winograd_util._cook_toom_convolution(points, m, 3)  # pylint: disable=protected-access
    return np.asarray(a, np.float64), np.asarray(b, np.float64), np.asarray(g, np.float64)


def separable_input_transform(m: int) -> bool:
    """Whether F(m)'s input transform is computed as two passes (rows, then columns): when that
    computes fewer terms than the double sum over the tile (see ``winograd_conv2d_nchw``)."""
    _, b_mat, _ = transform_matrices(m)
    nnz = (b_mat != 0).sum(axis=0)  # non-zeros per column of B
    alpha = m + 2
    return 2 * alpha * int(nnz.sum()) < int(nnz.sum()) ** 2


def tile_grid(height: int, width: int, padding, m: int, lanes: int):
    """``((oh, ow), (nh, nw), nw_v)`` of a 3x3 stride-1 conv in F(m): its output size, its tile
    rows and columns, and the columns the input transform computes (rounded up to whole vectors
    when a row has more than 8 tiles, see ``winograd_conv2d_nchw``)."""
    pt, pl, pb, pr = (int(p) for p in padding)
    oh, ow = height + pt + pb - 2, width + pl + pr - 2
    nh, nw = math.ceil(oh / m), math.ceil(ow / m)
    return (oh, ow), (nh, nw), padded_width(nw, lanes) if nw > 8 else nw


def winograd_conv2d_nchw(
    data,
    weight,
    padding,
    m: int,
    out_dtype: str | None = None,
    signature: str = "",
    lanes: int = 1,
    gemm_cols: int | None = None,
):
    """TE of the Winograd conv (see module docstring); returns the NCHW output tensor. ``lanes``:
    the SIMD width the input transform is vectorized with (it runs over whole vectors of tiles).
    ``gemm_cols``: the tile columns per row the GEMM computes (default: the real ones; at most the
    input transform's rounded-up columns, see ``schedules.winograd.gemm_tile_columns``)."""
    n_ = data.shape[0]  # symbolic in a generic entry (dynamic batch): an outer loop throughout
    c_, h_, w_ = (int(x) for x in data.shape[1:])
    k_, _, kh_, kw_ = (int(x) for x in weight.shape)
    assert kh_ == kw_ == 3
    dtype = out_dtype or data.dtype
    alpha = m + 2
    pt, pl, pb, pr = (int(p) for p in padding)
    (oh, ow), (nh, nw), nw_v = tile_grid(h_, w_, padding, m, lanes)
    a_mat, b_mat, g_mat = transform_matrices(m)
    ann = {TILE: m}

    # the zero-padded input (whole tiles: padded at the bottom / right as needed) in polyphase
    # layout, P[b, c, y, r, q] = d_pad[b, c, y, q·m + r]: column tx·m + j of a tile row is then
    # P[.., j mod m, tx + j / m], so the transform below reads whole vectors along the tiles
    # of a row where the plain layout would need a gather (stride m) per window element
    # The input transform runs over tile columns rounded up to whole 256-bit vectors when a row
    # has more than 8 tiles (14 tiles: one 16-lane vector, not 8 + 4 + 2 lanes per load and
    # store; 64ch 56x56 F(4) 0.51 -> 0.45 ms); the GEMM computes the real ones, or some of the
    # padding too where that widens its micro-kernel (``gemm_cols``), and the output transform
    # reads the real ones. Fewer tiles stay as they are (7 -> 8 was 6 % slower at 128->32 14x14
    # F(2), AVX-512). The phase length is a multiple of 4, so the pad stage vectorizes (17 would
    # not).
    nw_g = gemm_cols or nw
    assert nw <= nw_g <= nw_v, f"GEMM tile columns {nw_g} outside [{nw}, {nw_v}]"
    rows, phase_len = nh * m + 2, -(-(nw_v + (alpha - 1) // m) // 4) * 4

    def polyphase(b, c, y, r, q):
        yy, xx = y - pt, q * m + r - pl
        inside = tirx.all(yy >= 0, yy < h_, xx >= 0, xx < w_)
        return tirx.if_then_else(inside, data[b, c, yy, xx], tirx.const(0.0, data.dtype))

    data_pad = te.compute(
        (n_, c_, rows, m, phase_len), polyphase, name="winograd_pad", attrs={STAGE: "pad", **ann}
    )

    points = list(itertools.product(range(alpha), repeat=2))

    def weight_transform(e, nu, c, k):
        def terms(ei, ni):
            return [
                (g_mat[ei, i] * g_mat[ni, j], weight[k, c, i, j].astype("float64"))
                for i in range(3)
                for j in range(3)
            ]

        return selected_sums((e, nu), points, terms, "float64").astype(dtype)

    u = te.compute(
        (alpha, alpha, c_, k_), weight_transform, name="winograd_weight", attrs={STAGE: "weight", **ann}
    )

    # V = Bᵀ d B. F(4): in two passes, d B along each of the tile's α input rows, then Bᵀ (·) down
    # the columns: 2 α³ terms where the double sum has up to α⁴ (~330 vs ~650 per tile: the
    # low-error points make B dense; 64ch 56x56 0.50 -> 0.45 ms with the whole vectors below,
    # 128->32 28x28 0.19 -> 0.14 ms). F(2)'s B has two non-zeros per column: two passes would
    # compute as many terms as the double sum, plus the intermediate.
    def window(b, c, ty, tx, y, x):  # d[b, c, ty·m + y, tx·m + x], in the polyphase layout
        return data_pad[b, c, ty * m + y, x % m, tx + x // m].astype(dtype)

    if separable_input_transform(m):

        def input_rows(i, nu, c, b, ty, tx):
            def terms(ii, ni):
                return [(b_mat[j, ni], window(b, c, ty, tx, ii, j)) for j in range(alpha)]

            return selected_sums((i, nu), points, terms, dtype)

        rows_v = te.compute(
            (alpha, alpha, c_, n_, nh, nw_v),
            input_rows,
            name="winograd_input_rows",
            attrs={STAGE: "input_rows", **ann},
        )

        def input_transform(e, nu, c, b, ty, tx):
            def terms(ei):
                return [(b_mat[i, ei], rows_v[i, nu, c, b, ty, tx]) for i in range(alpha)]

            return selected_sums((e,), [(ei,) for ei in range(alpha)], terms, dtype)

    else:

        def input_transform(e, nu, c, b, ty, tx):
            def terms(ei, ni):
                return [
                    (b_mat[i, ei] * b_mat[j, ni], window(b, c, ty, tx, i, j))
                    for i in range(alpha)
                    for j in range(alpha)
                ]

            return selected_sums((e, nu), points, terms, dtype)

    v = te.compute(
        (alpha, alpha, c_, n_, nh, nw_v),
        input_transform,
        name="winograd_input",
        attrs={STAGE: "input", **ann},
    )
    rc = te.reduce_axis((0, c_), name="rc")
    mm = te.compute(
        (alpha, alpha, k_, n_, nh, nw_g),
        lambda e, nu, k, b, ty, tx: te.sum(u[e, nu, rc, k] * v[e, nu, rc, b, ty, tx], axis=[rc]),
        name="winograd_gemm",
        attrs={STAGE: "gemm", SIGNATURE: signature, **ann},
    )

    def output_transform(b, k, h, w):
        def terms(i, j):
            return [
                (a_mat[e, i] * a_mat[nu, j], mm[e, nu, k, b, h // m, w // m])
                for e in range(alpha)
                for nu in range(alpha)
            ]

        return selected_sums((h % m, w % m), itertools.product(range(m), repeat=2), terms, dtype)

    return te.compute(
        (n_, k_, oh, ow), output_transform, name="winograd_output", attrs={STAGE: "output", **ann}
    )


# ---- which convs take which form ---------------------------------------------------------------


def conv_signature(data_shape, weight_shape, padding, dtype) -> str:
    """The key of a conv in decision tables: shapes, padding and dtype (the weights' values and
    the fused epilogue do not change which algorithm is faster); a symbolic batch by its name."""
    d = "x".join(str(int(x)) if isinstance(x, (int, tirx.IntImm)) else str(x) for x in data_shape)
    w = "x".join(str(int(x)) for x in weight_shape)
    p = ",".join(str(int(x)) for x in padding)
    return f"conv2d_nchw/{d}/{w}/pad{p}/{dtype}"


_CHOICES: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "tvm_fusion_conv_algorithms", default=None
)


@contextlib.contextmanager
def conv_algorithms(choices: dict | str | None):
    """Within the block, eligible convs are legalized as ``choices`` says: a dict from
    :func:`conv_signature` to an algorithm (others: :func:`default_algorithm`), or one algorithm
    name for every eligible conv (``"direct"`` turns Winograd off), or None (the cost rule)."""
    if isinstance(choices, str) and choices not in ALGORITHMS:
        raise ValueError(f"unknown conv algorithm {choices!r}: one of {', '.join(ALGORITHMS)}")
    token = _CHOICES.set(choices)
    try:
        yield
    finally:
        _CHOICES.reset(token)


def chosen_algorithm(signature: str, conv: dict) -> str:
    choices = _CHOICES.get()
    if isinstance(choices, str):
        return choices
    if choices and signature in choices:
        return choices[signature]
    return default_algorithm(**conv)


# The untuned choice, from per-layer measurements (docs/winograd.md, ResNet-18's 3x3 convs, conv +
# bias + relu alone, 2 threads, AMD EPYC znver4, ms; direct / F(2) / F(4)): 64ch 56x56 1.09 / 0.62 /
# 0.46, 128ch 28x28 1.06 / 0.57 / 0.36, 256ch 14x14 1.02 / 0.52 / 0.45, 512ch 7x7 1.03 / 0.68 /
# 1.17. Alone, the transformed weight (α²/9 times the weight's size) stays in cache; in the model
# it streams from memory once per output-channel block, so what wins there needs enough tiles to
# reuse it: 49 tiles or more won for both tile sizes, the larger tile winning when both have
# enough; 256ch 14x14 in F(4) (16 tiles) lost in ResNet-18 (0.62 -> 0.74 ms per conv). With 16
# tiles F(2) still wins when the GEMM is wide: 512ch 7x7 in ResNet-18, 1.20 -> 1.06 ms per conv
# (DenseNet's 128->32 7x7 convs lost 1 % of the model). Few channels keep the direct conv, the GEMM
# then being too short to pay for the transforms. Measured at 55x55 and 27x27 (AVX-512 and AVX2
# code, ms direct / F(4)): 16->64 0.32 / 0.21 (AVX2 0.32 / 0.25), 16->32 0.15 / 0.12, 24->96
# (27x27) 0.17 / 0.10 won; 8->32 0.10 / 0.10, 8->64 0.20 / 0.24, 16->16 0.12 / 0.19, 32->16 (27x27)
# 0.04 / 0.06 did not: 16 input channels are enough, 16 output channels are not.
MIN_TILES = 32
MIN_TILES_WIDE = 16  # F(2) for a conv with at least MIN_WIDE_CHANNELS in and out
MIN_WIDE_CHANNELS = 512
MIN_CHANNELS_IN = 16
MIN_CHANNELS_OUT = 32


def default_algorithm(channels_in: int, channels_out: int, tiles: dict, lanes: int = 1, **_) -> str:
    """The untuned algorithm for a conv (see the measurements above): F(4) if it has at least
    ``MIN_TILES`` output tiles, else F(2) if that has (or ``MIN_TILES_WIDE``, for a conv at least
    ``MIN_WIDE_CHANNELS`` wide), else direct; direct for fewer than ``MIN_CHANNELS_IN`` input or
    ``MIN_CHANNELS_OUT`` output channels, or output channels not a whole number of SIMD vectors."""
    too_few = channels_in < MIN_CHANNELS_IN or channels_out < MIN_CHANNELS_OUT
    if too_few or channels_out % lanes:
        return DIRECT
    for algorithm in ("winograd4", "winograd2"):
        if tiles[FORMS[algorithm]] >= MIN_TILES:
            return algorithm
    wide = min(channels_in, channels_out) >= MIN_WIDE_CHANNELS
    return "winograd2" if wide and tiles[FORMS["winograd2"]] >= MIN_TILES_WIDE else DIRECT


def eligible_conv(call: relax.Call) -> dict | None:
    """The conv's shapes if Winograd can compute it (3×3, stride 1, dilation 1, groups 1, NCHW /
    OIHW, float32 shapes static but for the batch, LLVM target in scope), else None. A symbolic
    batch counts as one image in the tile counts the cost rule decides by."""
    shapes = cpu_float32_nchw_conv(call)
    attrs = call.attrs
    if shapes is None or int(attrs.groups) != 1 or any(int(s) != 1 for s in attrs.strides):
        return None
    dshape, wshape = shapes
    if wshape[2:] != [3, 3]:
        return None
    from ..schedules._util import vector_lanes  # pylint: disable=import-outside-toplevel

    padding = [int(p) for p in attrs.padding]
    lanes = vector_lanes(tvm.target.Target.current(), "float32")
    grids = {m: tile_grid(dshape[2], dshape[3], padding, m, lanes) for m in FORMS.values()}
    (oh, ow), _, _ = grids[2]
    if oh < 1 or ow < 1:
        return None
    images = dshape[0] if isinstance(dshape[0], int) else 1
    return {
        "data_shape": dshape,
        "weight_shape": wshape,
        "padding": padding,
        "channels_in": dshape[1],
        "channels_out": wshape[0],
        "images": images,
        "tiles": {m: images * nh * nw for m, (_, (nh, nw), _) in grids.items()},
        "lanes": lanes,
    }


def legalize_conv2d_winograd(bb: relax.BlockBuilder, call: relax.Call):
    """Legalize an eligible conv as Winograd when the decision for it says so; None otherwise."""
    conv = eligible_conv(call)
    if conv is None:
        return None
    signature = conv_signature(conv["data_shape"], conv["weight_shape"], conv["padding"], "float32")
    algorithm = chosen_algorithm(signature, conv)
    if algorithm not in FORMS:
        return None
    m = FORMS[algorithm]
    return bb.call_te(
        winograd_conv2d_nchw,
        call.args[0],
        call.args[1],
        conv["padding"],
        m,
        None,
        signature,
        conv["lanes"],
        _gemm_cols(conv, m),
        primfunc_name_hint=f"conv2d_winograd{m}",
    )


def _gemm_cols(conv: dict, m: int) -> int:
    """The GEMM's tile columns per row for ``conv`` in F(m) on the current target (see
    ``schedules.winograd.gemm_tile_columns``)."""
    from ..schedules.winograd import gemm_tile_columns  # pylint: disable=import-outside-toplevel

    dshape = conv["data_shape"]
    _, (nh, nw), nw_v = tile_grid(dshape[2], dshape[3], conv["padding"], m, conv["lanes"])
    target = tvm.target.Target.current()
    if target is None:
        return nw
    rows = conv["images"] * nh
    return gemm_tile_columns(nw, nw_v, conv["channels_in"], conv["channels_out"], rows, target)
