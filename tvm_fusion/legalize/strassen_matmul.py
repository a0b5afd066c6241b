"""One level of Strassen's algorithm for large float32 matmuls by a constant weight, on LLVM CPUs
(opt-in: ``strassen=True``).

Why: a transformer's time is its linear layers, and our GEMM micro-kernel already runs them at
90-95 % of the FMA peak; the remaining speed is in fewer multiplies. Strassen computes the 2 x 2
block product ``C = A B`` with 7 block products instead of 8 (-12.5 % multiplies). The weight
``B`` is a constant, so its 7 block sums are computed at compile time (as Winograd's transformed
weight); what is left at run time is a stage of ``A``'s 7 block operands (5 sums, 2 copies:
7/4 of ``A``'s size) and the sums of the products into ``C``, which the schedule computes per
micro-kernel tile from a small per-task buffer, so no product goes to memory
(``schedules/strassen.py``). The weight to stream grows to 7/4 of B's: what is saved is bounded
by memory traffic, not by the 1/8 of the FMAs. BERT-base's GEMMs alone run 5-9 % faster
(:func:`default_use` is the measured size rule), but whole transformers did not gain on the
2-core znver4 VM it was measured on, where their weights stream from memory: Strassen / plain
0.95-1.12 over five models (docs/performance.md).

Why it is off by default: besides that, its error is bounded relative to the whole blocks, not to
each row. Row ``i`` of C's top blocks is a sum of products that also carry row ``i`` of A's bottom blocks
and cancel in exact arithmetic; in float32 they leave noise of about 1e-7 of the blocks'
magnitude. A row that the plain product makes exactly zero (a padded token) becomes such noise,
and a model that normalizes it undoes the scale: Swin V2's cosine attention divides K by its
L2 norm (eps 1e-12), its padded window tokens' K rows became unit vectors of noise, and the
model's output moved by 0.12 of its magnitude (max |err| / max |ref| against ONNX Runtime; 1e-6
without Strassen). On BERT-style models the error stays at 1.9e-6 (plain 1.6e-6). Use it where
the model's rows are not normalized from near-zero; ``strassen=True`` applies the size rule,
``strassen="always"`` every eligible matmul.

Only a constant weight gets its block sums at compile time, but the legalization runs inside the
fused functions, where the weight is a parameter: a matmul whose right operand is computed at run
time takes this form too and then computes the weight sums at every call (7/4 of the weight's
size).

The kernel is five TE stages, each block annotated ``tvm_fusion.strassen = <stage>``:

* ``weight``: ``T[p, r, j]``, the 7 sums of B's blocks (``T[p] = Σ ± B[qk, qn]``), reading only B;
  the schedule makes it a compile-time layout-rewrite preproc (as Winograd's weight transform);
* ``input``: ``S[p, i, r]``, the 7 sums of A's blocks;
* ``gemm``: ``P[p, i, j] = Σ_r S[p, i, r] T[p, r, j]``, the 7 products (the only reduction);
* ``output``: ``C[.., qr, i, qc, j] = Σ ± P[p, i, j]``, C by blocks, and ``view``, C as the
  matmul's result ``[.., qr·m + i, qc·n + j]``, on which FuseTIR appends the fused epilogue
  (bias, GELU, residual add).

Block sums are written with :mod:`.selected_sums` (one expression per case, folded once the
schedule unrolls the case loops).
"""

from __future__ import annotations

import contextlib
import contextvars

import tvm
from tvm import relax, te

from .conv_args import out_dtype, static_shapes
from .selected_sums import selected_sums

STAGE = "tvm_fusion.strassen"  # block annotation: weight / input / gemm / output / view
SIGNATURE = "tvm_fusion.matmul_signature"  # on the gemm stage: rows x depth x columns

# Strassen's products: (signed blocks of A, signed blocks of B), a block as (sign, row, column) of
# the 2 x 2 split; and C's blocks as signed sums of the products (their indices).
PRODUCTS = (
    (((1, 0, 0), (1, 1, 1)), ((1, 0, 0), (1, 1, 1))),  # (A11 + A22)(B11 + B22)
    (((1, 1, 0), (1, 1, 1)), ((1, 0, 0),)),  # (A21 + A22) B11
    (((1, 0, 0),), ((1, 0, 1), (-1, 1, 1))),  # A11 (B12 - B22)
    (((1, 1, 1),), ((1, 1, 0), (-1, 0, 0))),  # A22 (B21 - B11)
    (((1, 0, 0), (1, 0, 1)), ((1, 1, 1),)),  # (A11 + A12) B22
    (((1, 1, 0), (-1, 0, 0)), ((1, 0, 0), (1, 0, 1))),  # (A21 - A11)(B11 + B12)
    (((1, 0, 1), (-1, 1, 1)), ((1, 1, 0), (1, 1, 1))),  # (A12 - A22)(B21 + B22)
)
OUTPUT_BLOCKS = {
    (0, 0): ((1, 0), (1, 3), (-1, 4), (1, 6)),
    (0, 1): ((1, 2), (1, 4)),
    (1, 0): ((1, 1), (1, 3)),
    (1, 1): ((1, 0), (-1, 1), (1, 2), (1, 5)),
}

# The size rule, from per-GEMM measurements (matmul + epilogue alone, Strassen / plain, 2 AVX-512
# cores, znver4; docs/performance.md): over 128 rows, 768 -> 3072 + GELU 0.92-0.95, 3072 -> 768 +
# residual 0.94, 768 -> 2304 0.91, 768 -> 768 0.95, 512 -> 2048 0.94, 2048 -> 512 0.95; 64 rows
# 768 -> 768 0.96; within noise, left out: 32 rows 768 -> 3072 0.97-0.99, 256 -> 1024 0.98; lost:
# 384 -> 384 1.05, 512 x 128 -> 512 1.07, 3136 x 96 -> 384 1.09. The saving is 1/8 of the FMAs;
# the costs (A's block operands, the products' sums, 7/4 of the weight to stream) weigh more on
# a short reduction or few rows.
MIN_HALF_ROWS = 32
MIN_HALF_DEPTH = 256
MIN_HALF_COLUMNS = 256

ALWAYS = "always"
_CHOICE: contextvars.ContextVar[bool | str] = contextvars.ContextVar("tvm_fusion_strassen", default=False)


def check_choice(choice) -> None:
    """Raise ValueError unless ``choice`` is False, True or ``"always"``."""
    if choice not in (False, True, ALWAYS):
        raise ValueError(f"strassen must be False, True or {ALWAYS!r}, not {choice!r}")


@contextlib.contextmanager
def strassen(choice: bool | str):
    """Within the block, eligible matmuls take Strassen's form never (False, the default), where
    :func:`default_use` says (True) or always (``"always"``)."""
    check_choice(choice)
    token = _CHOICE.set(choice)
    try:
        yield
    finally:
        _CHOICE.reset(token)


def default_use(rows: int, depth: int, columns: int) -> bool:
    """Whether Strassen pays for an eligible ``rows x depth`` by ``depth x columns`` matmul (the
    decision with ``strassen=True``)."""
    return rows // 2 >= MIN_HALF_ROWS and depth // 2 >= MIN_HALF_DEPTH and columns // 2 >= MIN_HALF_COLUMNS


def eligible_matmul(call: relax.Call) -> dict | None:
    """``{"rows", "depth", "columns"}`` of a matmul Strassen can compute: float32, an LLVM
    target in scope, a 2-D ``[K, N]`` right operand, a left operand ``[1.., M, K]`` (one matrix),
    all static and even; else None."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm" or len(call.args) != 2:
        return None
    shapes = static_shapes(call)
    dtypes = {str(call.args[0].ty.dtype), str(call.args[1].ty.dtype), out_dtype(call.attrs) or "float32"}
    if shapes is None or dtypes != {"float32"}:
        return None
    x_shape, w_shape = shapes
    if len(w_shape) != 2 or len(x_shape) < 2:
        return None
    *lead, rows, depth = x_shape
    if any(d != 1 for d in lead) or w_shape[0] != depth:
        return None
    columns = w_shape[1]
    if rows % 2 or depth % 2 or columns % 2:
        return None
    return {"rows": rows, "depth": depth, "columns": columns}


def matmul_signature(rows: int, depth: int, columns: int) -> str:
    return f"matmul/{rows}x{depth}x{columns}/float32"


def strassen_matmul(x: te.Tensor, w: te.Tensor, signature: str = "") -> te.Tensor:
    """TE of ``x @ w`` by one level of Strassen (module docstring); ``x`` is ``[1.., M, K]``."""
    *lead, rows, depth = (int(d) for d in x.shape)
    columns = int(w.shape[1])
    m, k2, n = rows // 2, depth // 2, columns // 2  # the halves: a block is m x k2 (A), k2 x n (B)
    zeros = (0,) * len(lead)
    dtype = x.dtype

    def weight(p, r, j):
        def terms(q):
            return [(sign, w[qk * k2 + r, qn * n + j]) for sign, qk, qn in PRODUCTS[q][1]]

        return selected_sums((p,), [(q,) for q in range(7)], terms, dtype)

    def input_sums(p, i, r):
        def terms(q):
            return [(sign, x[(*zeros, qi * m + i, qk * k2 + r)]) for sign, qi, qk in PRODUCTS[q][0]]

        return selected_sums((p,), [(q,) for q in range(7)], terms, dtype)

    t = te.compute((7, k2, n), weight, name="strassen_weight", attrs={STAGE: "weight"})
    s = te.compute((7, m, k2), input_sums, name="strassen_input", attrs={STAGE: "input"})
    rk = te.reduce_axis((0, k2), name="rk")
    products = te.compute(
        (7, m, n),
        lambda p, i, j: te.sum(s[p, i, rk] * t[p, rk, j], axis=[rk]),
        name="strassen_gemm",
        attrs={STAGE: "gemm", SIGNATURE: signature},
    )

    def output(*idx):
        *_, q_row, i, q_col, j = idx

        def terms(qr, qc):
            return [(sign, products[p, i, j]) for sign, p in OUTPUT_BLOCKS[(qr, qc)]]

        return selected_sums((q_row, q_col), list(OUTPUT_BLOCKS), terms, dtype)

    # C by blocks, then viewed as the matmul's result: the block sums read the products plainly
    # (``P[p, i, j]``, not ``P[p, r mod m, c mod n]``), which the schedule's compute_at needs
    blocks = te.compute((*lead, 2, m, 2, n), output, name="strassen_output", attrs={STAGE: "output"})
    return te.compute(
        (*lead, rows, columns),
        lambda *idx: blocks[(*idx[:-2], idx[-2] // m, idx[-2] % m, idx[-1] // n, idx[-1] % n)],
        name="strassen_view",
        attrs={STAGE: "view"},
    )


def legalize_matmul_strassen(bb: relax.BlockBuilder, call: relax.Call):
    """Legalize an eligible matmul by Strassen when the decision says so; None otherwise."""
    shape = eligible_matmul(call)
    if shape is None:
        return None
    rows, depth, columns = shape["rows"], shape["depth"], shape["columns"]
    choice = _CHOICE.get()
    if not choice or (choice is True and not default_use(rows, depth, columns)):
        return None
    return bb.call_te(
        strassen_matmul,
        call.args[0],
        call.args[1],
        matmul_signature(rows, depth, columns),
        primfunc_name_hint="matmul_strassen",
    )
