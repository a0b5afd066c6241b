"""Default CPU schedules: numerics kept vs the unscheduled build, and the loops are parallel + SIMD."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import HOST_HAS_AVX512, ort_run, relax_main, run_executable, run_relax
from tvm import relax, s_tir, te, tirx, topi
from tvm.s_tir import dlight as dl

from tvm_fusion import models
from tvm_fusion.ir import tir_stmts
from tvm_fusion.legalize import LegalizeOps
from tvm_fusion.schedules import (
    Contraction,
    Depthwise,
    Injective,
    ParallelFallback,
    PlainReduction,
    RowReduction,
    Strassen,
    TunableMatmul,
    WindowReduction,
    Winograd,
    apply_default_schedules,
    default_rules,
)
from tvm_fusion.schedules._util import PARALLEL_MIN_ELEMENTS, collect_loops, loop_kinds, safe_rule, uses_var
from tvm_fusion.schedules.contraction_plan import MAX_IMBALANCE, imbalance
from tvm_fusion.schedules.fallback import get_sblock_realize

ZNVER3 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
ZNVER4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})  # AVX-512
RNG = np.random.default_rng(0)


# -- helpers ------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def parallel_even_tiny_kernels(monkeypatch, request):
    """Test shapes are tiny; schedule them as the big kernels they stand for (parallel included).

    ``test_tiny_contraction_stays_single_threaded`` opts out to test the threshold itself.
    """
    if "keep_parallel_threshold" not in request.keywords:
        from tvm_fusion.schedules import contraction_plan

        monkeypatch.setattr(contraction_plan, "PARALLEL_MIN_MACS", 0)


def _rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype("float32")


def _fused(mod):
    from tvm_fusion.legalize import enabled
    from tvm_fusion.legalize.winograd_conv import conv_algorithms

    # these tests are about the direct schedules: no Winograd kernels (tests/test_winograd.py)
    with ZNVER3, conv_algorithms("direct"), enabled():
        return relax.get_pipeline("zero")(mod)


def _scheduled(mod, prepack=True):
    with ZNVER3:
        return apply_default_schedules(ZNVER3, prepack=prepack)(_fused(mod))


def _run(mod, feeds):
    return run_relax(mod, feeds, ZNVER3)


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _assert_parallel_unless_small(name, func):
    """A kernel has a parallel loop, unless its output is small enough for one thread."""
    out_elements = int(np.prod([int(d) for d in func.params[-1].shape]))
    if out_elements >= PARALLEL_MIN_ELEMENTS:
        assert tirx.ForKind.PARALLEL in loop_kinds(func), f"{name} has no parallel loop\n{func}"


def _check(mod, feeds, rtol=1e-5, atol=1e-5, need_vector=True):
    """Scheduled build == unscheduled build; every kernel scheduled, parallel (and vectorized)."""
    expected = _run(_fused(mod), feeds)
    sched = _scheduled(mod)
    funcs = _prim_funcs(sched)
    assert funcs
    for name, func in funcs.items():
        assert func.attrs is not None and "tirx.is_scheduled" in func.attrs, name
        kinds = loop_kinds(func)
        _assert_parallel_unless_small(name, func)
        if need_vector:
            assert tirx.ForKind.VECTORIZED in kinds, f"{name} has no vectorized loop\n{func}"
    got = _run(sched, feeds)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    return sched


# -- dense / matmul ---------------------------------------------------------------------------
def test_matmul_constant_weight_is_packed():
    w = _rand(64, 96, scale=0.1)
    mod = relax_main({"x": (32, 64)}, lambda bb, x: relax.op.matmul(x, relax.const(w)))
    x = _rand(32, 64)
    sched = _check(mod, [x])
    np.testing.assert_allclose(_run(sched, [x]), x @ w, rtol=1e-4, atol=1e-4)
    # the weight reaching the kernel is the packed constant [N/vt, K, vt], not the 2-D original
    (func,) = [f for n, f in _prim_funcs(sched).items() if "matmul" in n]
    shapes = [tuple(int(d) for d in p.shape) for p in func.params]
    assert (64, 96) not in shapes and any(len(s) == 3 and s[1] == 64 for s in shapes), shapes
    assert not any("preproc" in n or "layout" in n for n in _prim_funcs(sched)), list(_prim_funcs(sched))


@pytest.mark.parametrize(
    "rows,n", [(14, 51), (1, 100), (1, 10)], ids=["odd_width_linear", "classifier_gemv", "one_vector"]
)
def test_odd_width_constant_weight_is_padded_by_its_packing(rows, n):
    """A linear whose output width has no divisor near a SIMD vector (FocalNet's 384 -> 771 =
    3 x 257) ran in 3-lane vectors at 59 GF/s; an M = 1 classifier in one accumulator chain. The
    iteration is padded to whole vectors, the weight's padding done by its packing (folded at
    compile time, not a copy per call), and the result cropped: 771 -> 2.42 -> 0.58 ms, a
    512 -> 1000 classifier 0.029 -> 0.015 ms (znver4)."""
    w, b = _rand(64, n, scale=0.1), _rand(n)
    mod = relax_main(
        {"x": (rows, 64)},
        lambda bb, x: relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)),
    )
    x = _rand(rows, 64)
    sched = _check(mod, [x], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_run(sched, [x]), x @ w + b, rtol=1e-4, atol=1e-4)
    (func,) = [f for name, f in _prim_funcs(sched).items() if "matmul" in name]
    # the weight reaches the kernel padded (and packed when that gains): [tiles, 64, vt] or [64, n']
    (weight,) = [tuple(int(d) for d in p.shape) for p in func.params[1:-1] if len(p.shape) >= 2]
    width = weight[0] * weight[2] if len(weight) == 3 else weight[1]
    lanes = 8  # ZNVER3
    assert width % lanes == 0 and width >= n, weight
    run_time_pads = [
        blk.name_hint
        for blk in tir_stmts(func)
        if isinstance(blk, s_tir.SBlock) and blk.name_hint.endswith("_pad")
    ]
    assert not run_time_pads, f"the weight is padded at every call\n{func}"


def test_reshape_epilogue_of_a_padded_linear_covers_its_whole_output():
    """ConvBERT's span kernels: a 192 -> 27 linear, padded to whole vectors, whose result is
    reshaped to [384, 9, 1] in its epilogue. ``reverse_compute_at`` gave the reshape 25 x 5
    points a tile of 8 rows (24 x 9 needed): columns 5-8 of the output were never written (NaN
    from the whole model; seen with AVX-512's 16-lane tiles). The epilogue now runs as its own
    stage there: every block of the kernel iterates over at least its whole domain."""
    import tvm_fusion

    w, b = _rand(192, 27, scale=0.1), _rand(27)

    def linear_then_reshape(bb, x):
        y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
        return relax.op.nn.softmax(bb.emit(relax.op.reshape(y, [384, 9, 1])), axis=1)

    mod = relax_main({"x": (1, 128, 192)}, linear_then_reshape)
    x = _rand(1, 128, 192)
    result = tvm_fusion.build(mod, ZNVER4, tuning_logs=None)  # our fusion policy
    (fused,) = [gv for gv in result.lowered.functions if "matmul" in gv.name_hint]
    assert "reshape" in fused.name_hint  # the reshape is the linear's epilogue
    sch = s_tir.Schedule(result.lowered[fused])
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        block = sch.get(block)
        loops = sch.get_loops(sch.get_sblock(block.name_hint))
        iterations = math.prod(int(sch.get(lp).extent) for lp in loops)
        points = math.prod(int(iv.dom.extent) for iv in block.iter_vars)
        assert iterations >= points, f"{block.name_hint}: {iterations} iterations for {points} points"
    if HOST_HAS_AVX512:
        logits = (x @ w + b).reshape(384, 9, 1)
        expected = np.exp(logits - logits.max(axis=1, keepdims=True))
        expected /= expected.sum(axis=1, keepdims=True)
        got = run_executable(result.executable, [x])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_matmul_without_prepack_has_same_numbers():
    w = _rand(40, 24, scale=0.1)
    mod = relax_main({"x": (10, 40)}, lambda bb, x: relax.op.matmul(x, relax.const(w)))
    x = _rand(10, 40)
    sched = _scheduled(mod, prepack=False)
    np.testing.assert_allclose(_run(sched, [x]), x @ w, rtol=1e-4, atol=1e-4)


def test_batch_matmul_two_activations():
    mod = relax_main({"a": (3, 20, 16), "b": (3, 16, 24)}, lambda bb, a, b: relax.op.matmul(a, b))
    _check(mod, [_rand(3, 20, 16), _rand(3, 16, 24)])


def test_dense_bias_gelu_epilogue_runs_inside_the_tile():
    w, b = _rand(32, 48, scale=0.2), _rand(48)

    def body(bb, x):
        y = bb.emit(relax.op.add(relax.op.matmul(x, relax.const(w)), relax.const(b)))
        return relax.op.nn.gelu(y)

    mod = relax_main({"x": (1, 16, 32)}, body)
    sched = _check(mod, [_rand(1, 16, 32)], rtol=1e-4, atol=1e-5)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "matmul" in n]
    # the epilogue runs right after each tile, under the same parallel loop as the matmul
    # (not as a second full pass over a full-size intermediate)
    par = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.PARALLEL]
    assert len(par) == 1
    out_name = func.params[-1].name
    body = par[0].body.script()
    assert "matmul" in body and f"{out_name}[" in body, body


# -- conv2d -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cin,cout,k,stride,groups,size",
    [
        (8, 16, 3, 1, 1, 12),
        (16, 24, 1, 1, 1, 10),
        (8, 16, 3, 2, 1, 13),
        (16, 16, 3, 1, 16, 12),
        (12, 12, 3, 2, 12, 9),
    ],
    ids=["3x3", "1x1", "3x3s2", "depthwise", "depthwise_s2"],
)
def test_conv2d_nchw_bias_relu(cin, cout, k, stride, groups, size):
    w, b = _rand(cout, cin // groups, k, k, scale=0.3), _rand(1, cout, 1, 1)

    def body(bb, x):
        y = relax.op.nn.conv2d(x, relax.const(w), strides=stride, padding=k // 2, groups=groups)
        return relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(y), relax.const(b))))

    _check(relax_main({"x": (1, cin, size, size)}, body), [_rand(1, cin, size, size)], rtol=1e-4, atol=1e-4)


def test_ragged_conv_tile_epilogue_stays_vectorized():
    """A few-channel conv like the squeezenet stem (3->64, 3x3 stride 2, a 111-wide output plane,
    before RGB stems took the depthwise form) in row tiles of 8: the last tile along W is partial,
    and its bounds check on the epilogue's pixel loop made the vectorized loop scalar (one scalar
    load, max and store per element; the kernel 0.85 ms, 0.62 with the epilogue vectorized over
    channels instead). 8 input channels: still TVM's conv and this rule."""
    w, b = _rand(64, 8, 3, 3, scale=0.3), _rand(1, 64, 1, 1)

    def body(bb, x):
        y = relax.op.nn.conv2d(x, relax.const(w), strides=2)
        return relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(y), relax.const(b))))

    sched = _check(relax_main({"x": (1, 8, 47, 47)}, body), [_rand(1, 8, 47, 47)], rtol=1e-4, atol=1e-4)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    (epilogue,) = [
        blk
        for blk in sch.get_child_blocks(sch.get_sblock("root"))
        if any(region.source.name == "compute_intermediate" for region in sch.get(blk).writes)
    ]
    vectorized = [lp for lp in sch.get_loops(epilogue) if sch.get(lp).kind == tirx.ForKind.VECTORIZED]
    predicate = get_sblock_realize(sch, epilogue).predicate
    assert not isinstance(predicate, tirx.IntImm), "the tile is not ragged: the test checks nothing"
    assert vectorized, func
    assert not any(uses_var(predicate, sch.get(lp).loop_var) for lp in vectorized), func


def _packed_conv_weight(sched):
    """The conv kernel's packed weight shape: (cout / vt, cin, kh, kw, vt) when the SIMD axis is
    the output channel."""
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    return [tuple(int(d) for d in p.shape) for p in func.params if len(p.shape) == 5]


@pytest.mark.parametrize(
    "cin,cout,size,k", [(32, 32, 16, 3), (64, 64, 56, 3)], ids=["3x3_small", "3x3_resnet"]
)
def test_nchw_conv_vectorizes_output_channels(cin, cout, size, k):
    """NCHW 3x3 convs put SIMD lanes on output channels (packed weight vectors, broadcast
    inputs), not on W: along W the input window slides (misaligned loads) and 8 broadcast weights
    feed only 8 FMAs. Measured on the ResNet-18 64x56x56 conv: 2.2 ms (W lanes) vs 1.5 ms
    (znver3, 2 threads, docs/performance.md)."""
    w, b = _rand(cout, cin, k, k, scale=0.2), _rand(1, cout, 1, 1)

    def body(bb, x):
        y = relax.op.nn.conv2d(x, relax.const(w), padding=k // 2)
        return relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(y), relax.const(b))))

    mod = relax_main({"x": (1, cin, size, size)}, body)
    if size <= 16:
        sched = _check(mod, [_rand(1, cin, size, size)], rtol=1e-4, atol=1e-4)
    else:  # the real layer shapes: schedule only (the unscheduled reference would take seconds)
        sched = _scheduled(mod)
    (shape,) = _packed_conv_weight(sched)
    vt = shape[-1]
    assert vt % 8 == 0 and shape[0] * vt == cout and shape[1:4] == (cin, k, k), shape


@pytest.mark.parametrize("group_width,size", [(16, 7), (24, 7), (32, 9)])
def test_grouped_conv_vectorizes_output_channels_within_a_group(group_width, size):
    """A grouped conv reads input channel ``oc // G * G + rc``: along output channels that is one
    broadcast per vector tile that stays inside a group, not a gather. The rule priced it as a
    gather and put the lanes on W (RegNetX's 400-channel 7x7 convs, 16 channels a group: 7 of 16
    lanes busy, 0.075 -> 0.046 ms with the lanes on output channels). Shapes the depthwise form
    (``legalize/depthwise_conv.py``: up to 16 channels a group on planes at least 8 wide) leaves
    to TVM's conv and this rule."""
    channels = 4 * group_width
    w, b = _rand(channels, group_width, 3, 3, scale=0.2), _rand(1, channels, 1, 1)

    def body(bb, x):
        y = relax.op.nn.conv2d(x, relax.const(w), padding=1, groups=channels // group_width)
        return relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(y), relax.const(b))))

    sched = _check(
        relax_main({"x": (1, channels, size, size)}, body),
        [_rand(1, channels, size, size)],
        rtol=1e-4,
        atol=1e-4,
    )
    (name,) = [n for n in _prim_funcs(sched) if "conv" in n]
    assert "depthwise" not in name, name
    (shape,) = _packed_conv_weight(sched)
    vt = shape[-1]
    assert group_width % vt == 0 and shape[0] * vt == channels and shape[1:4] == (group_width, 3, 3), shape


def test_pointwise_conv_without_epilogue_keeps_its_plane():
    """A bare 1x1 conv (fusion off) writes its output parameter directly; the plane is not
    flattened there (the accumulator's write-back would cover a span of it wrongly)."""
    w = _rand(16, 24, 1, 1, scale=0.2)
    mod = relax_main({"x": (1, 24, 56, 56)}, lambda bb, x: relax.op.nn.conv2d(x, relax.const(w)))
    _check(mod, [_rand(1, 24, 56, 56)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "size,residual", [(10, True), (56, False)], ids=["10x10_residual", "56x56_mobilenet"]
)
def test_pointwise_conv_is_a_gemm_over_the_flattened_plane(size, residual):
    """A 1x1 stride-1 conv is a GEMM whose N axis is the H*W plane: the contraction and its
    epilogue (bias, clip, residual add) iterate one hw axis, the SIMD lanes walk it contiguously.
    MobileNet 24->144 at 56x56: 0.20-0.28 ms as a conv (lanes on channels), 0.15 ms as a GEMM."""
    cin, cout = 24, 144 if size == 56 else 16
    w, b = _rand(cout, cin, 1, 1, scale=0.2), _rand(1, cout, 1, 1)

    def body(bb, x, *rest):
        y = bb.emit(relax.op.add(bb.emit(relax.op.nn.conv2d(x, relax.const(w))), relax.const(b)))
        y = bb.emit(relax.op.clip(y, 0.0, 6.0))
        return relax.op.add(y, rest[0]) if rest else y

    inputs = {"x": (1, cin, size, size)}
    if residual:
        inputs["r"] = (1, cout, size, size)
    mod = relax_main(inputs, body)
    if size <= 16:
        sched = _check(mod, [_rand(*shape) for shape in inputs.values()], rtol=1e-4, atol=1e-4)
    else:
        sched = _scheduled(mod)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    vec = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.VECTORIZED]
    assert vec, func
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    doms = {
        n: [int(it.dom.extent) for it in sch.get(sch.get_sblock(n)).iter_vars] for n in _block_names(func)
    }
    assert size * size in doms["conv2d_nchw_update"], doms  # one plane iter, not (H, W)
    assert all(size not in d for n, d in doms.items() if n != "root"), doms  # epilogue merged too


@pytest.mark.parametrize("k,copy_kept", [(1, False), (3, True)], ids=["1x1_unpadded", "3x3_padded"])
def test_unpadded_conv_reads_its_input_directly(k, copy_kept):
    """An unpadded conv's ``pad_temp`` is a plain copy of the input: it is inlined (MobileNet's
    144->24 1x1 conv: 0.23 -> 0.17 ms without the 1.8 MB copy); a real pad stays its own stage
    (inlined, it would put a branch in the micro-kernel)."""
    w = _rand(16, 8, k, k, scale=0.3)

    def body(bb, x):
        return relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=k // 2)))

    sched = _check(relax_main({"x": (1, 8, 10, 10)}, body), [_rand(1, 8, 10, 10)], rtol=1e-4, atol=1e-4)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    assert ("pad_temp" in _block_names(func)) == copy_kept, _block_names(func)


def _small_padded_conv(cin, cout, size, stride=1, dilation=1, batch=1):
    w, b = _rand(cout, cin, 3, 3, scale=0.3), _rand(1, cout, 1, 1)

    def body(bb, x):
        y = relax.op.nn.conv2d(x, relax.const(w), strides=stride, padding=dilation, dilation=dilation)
        return relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(y), relax.const(b))))

    return relax_main({"x": (batch, cin, size, size)}, body), [_rand(batch, cin, size, size)], w


def _conv_kernel(sched):
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    return func


@pytest.mark.parametrize(
    "cin,cout,size,stride,dilation,batch",
    [(16, 16, 32, 1, 1, 1), (16, 32, 17, 2, 1, 1), (8, 24, 15, 1, 2, 1), (8, 16, 12, 1, 1, 2)],
    ids=["16ch_32x32", "s2_odd", "dilated", "batch2"],
)
def test_small_conv_pads_its_rows_inside_each_parallel_task(cin, cout, size, stride, dilation, batch):
    """A padded conv with a small weight computes the padded rows each parallel task reads inside
    that task (no parallel pad stage of its own: one fork-join less, the rows stay in L1), the
    task running every output-channel tile of its rows; it matches the unscheduled kernel."""
    from tvm_fusion.schedules.contraction import TASK_LOCAL_WEIGHT_BYTES

    mod, feeds, w = _small_padded_conv(cin, cout, size, stride, dilation, batch)
    assert w.nbytes <= TASK_LOCAL_WEIGHT_BYTES
    func = _conv_kernel(_check(mod, feeds, rtol=1e-4, atol=1e-4))
    par = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.PARALLEL]
    assert len(par) == 1, func
    sch = s_tir.Schedule(func)
    (pad,) = [n for n in _block_names(func) if n.startswith("pad")]
    assert sch.get(sch.get_loops(sch.get_sblock(pad))[0]).same_as(par[0]), func
    # and the padded rows are a per-task buffer once lowered (no shared halo rows between threads)
    lowering = tvm.transform.Sequential(
        [
            s_tir.transform.LowerInitBlock(),
            s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
            s_tir.transform.ConvertBlocksToOpaque(),
            s_tir.transform.CompactBufferAllocation(),
        ]
    )
    lines = lowering(tvm.IRModule({"main": func}))["main"].script().splitlines()
    (alloc,) = [i for i, line in enumerate(lines) if f"{pad} = T.sblock_alloc_buffer" in line]
    (loop,) = [i for i, line in enumerate(lines) if "T.parallel(" in line]
    assert loop < alloc, "\n".join(lines)


@pytest.mark.parametrize("why", ["large weight", "inputs knob"])
def test_padded_conv_keeps_its_pad_stage(monkeypatch, why):
    """With a weight beyond TASK_LOCAL_WEIGHT_BYTES (here: the limit lowered), or the tuner's other
    choice of the ``inputs`` knob, the pad is a parallel stage of its own again."""
    import tvm_fusion.schedules.contraction as contraction

    mod, feeds, _ = _small_padded_conv(16, 16, 32)
    if why == "large weight":
        monkeypatch.setattr(contraction, "TASK_LOCAL_WEIGHT_BYTES", 1)
        func = _conv_kernel(_check(mod, feeds, rtol=1e-4, atol=1e-4))
    else:
        (name,) = [n for n in _prim_funcs(_fused(mod)) if "conv" in n]
        with ZNVER3:
            sch = contraction.Contraction(knobs={"inputs": 1}).apply(_fused(mod)[name], ZNVER3, False)
        func = sch.mod["main"]
    assert len([lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.PARALLEL]) == 2, func


def test_conv2d_nhwc_residual_add():
    w = _rand(3, 3, 8, 8, scale=0.3)  # HWIO

    def body(bb, x):
        y = bb.emit(
            relax.op.nn.conv2d(x, relax.const(w), padding=1, data_layout="NHWC", kernel_layout="HWIO")
        )
        return relax.op.add(y, x)

    _check(relax_main({"x": (1, 6, 6, 8)}, body), [_rand(1, 6, 6, 8)], rtol=1e-4, atol=1e-4)


def _conv_nchwc(data, kernel, stride=1, pad=1):
    """NCHW{i}c x OIHW{i}i{o}o -> NCHW{o}c, the form the layout pass emits."""
    n, icc, h, w, ib = (int(d) for d in data.shape)
    occ, _, kh, kw, _, ob = (int(d) for d in kernel.shape)
    oh, ow = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    padded = topi.nn.pad(data, [0, 0, pad, pad, 0], [0, 0, pad, pad, 0], name="data_pad")
    ric, rkh, rkw, rib = (
        te.reduce_axis((0, e), name=nm) for e, nm in ((icc, "ic"), (kh, "kh"), (kw, "kw"), (ib, "ib"))
    )
    return te.compute(
        (n, occ, oh, ow, ob),
        lambda b, oc, y, x, o: te.sum(
            padded[b, ric, y * stride + rkh, x * stride + rkw, rib] * kernel[oc, ric, rkh, rkw, rib, o],
            axis=[ric, rkh, rkw, rib],
        ),
        name="conv_nchwc",
    )


@pytest.mark.parametrize("stride", [1, 2])
def test_conv2d_nchwc_blocked_layout(stride):
    w, b = _rand(2, 2, 3, 3, 8, 8, scale=0.2), _rand(1, 2, 1, 1, 8)

    def body(bb, x):
        y = bb.emit_te(_conv_nchwc, x, relax.const(w), stride)
        return relax.op.nn.relu(bb.emit(relax.op.add(y, relax.const(b))))

    sched = _check(relax_main({"x": (1, 2, 9, 9, 8)}, body), [_rand(1, 2, 9, 9, 8)], rtol=1e-4, atol=1e-4)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    vec = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.VECTORIZED]
    assert any(int(lp.extent) == 8 for lp in vec)  # the 8-wide output-channel block is the SIMD axis


def test_contraction_rule_recognises_nchwc_by_structure():
    """The rule is handed a bare TE PrimFunc (no names it could match on)."""
    data = te.placeholder((1, 1, 6, 6, 8), name="d")
    kern = te.placeholder((2, 1, 3, 3, 8, 8), name="k")
    func = te.create_prim_func([data, kern, _conv_nchwc(data, kern)])
    sch = Contraction().apply(func, ZNVER3, False)
    assert sch is not None
    kinds = loop_kinds(sch.mod["main"])
    assert {tirx.ForKind.PARALLEL, tirx.ForKind.VECTORIZED, tirx.ForKind.UNROLLED} <= kinds


# -- reductions, pooling, elementwise ---------------------------------------------------------
def test_softmax():
    _check(
        relax_main({"x": (2, 4, 16, 24)}, lambda bb, x: relax.op.nn.softmax(x, axis=-1)),
        [_rand(2, 4, 16, 24)],
    )


def test_layer_norm():
    g, b = _rand(48), _rand(48)
    mod = relax_main(
        {"x": (1, 10, 48)}, lambda bb, x: relax.op.nn.layer_norm(x, relax.const(g), relax.const(b), axes=[-1])
    )
    _check(mod, [_rand(1, 10, 48)], rtol=1e-4, atol=1e-4)


def test_pools_and_mean():
    def body(bb, x):
        y = bb.emit(relax.op.nn.max_pool2d(x, pool_size=3, strides=2, padding=1))
        return relax.op.mean(y, axis=[2, 3], keepdims=True)

    # 64 x 24 x 24 means: enough elements for the mean's parallel loop (PARALLEL_MIN_ELEMENTS)
    _check(relax_main({"x": (1, 64, 48, 48)}, body), [_rand(1, 64, 48, 48)], need_vector=False)


def _mean_then_erf_gelu(bb, x):
    """FocalNet's ``mean -> gelu``: the mean read by two of GELU's blocks (``x / sqrt(2)`` for
    the erf, ``x * ...`` at the end)."""
    mean = bb.emit(relax.op.mean(x, axis=[3], keepdims=True))
    erf = bb.emit(relax.op.erf(bb.emit(relax.op.multiply(mean, relax.const(0.7071067811865476, "float32")))))
    half = bb.emit(
        relax.op.multiply(
            bb.emit(relax.op.add(erf, relax.const(1.0, "float32"))), relax.const(0.5, "float32")
        )
    )
    return relax.op.multiply(mean, half)


def test_reduction_epilogue_read_twice_keeps_the_reduction_schedule(caplog):
    """The reduction rule reverse-inlined GELU's first block into the mean although GELU's last
    block read the mean too; this TVM's ``reverse_compute_inline`` allows that and drops the
    mean's buffer, and FocalNet's four ``mean -> gelu`` kernels failed to compile."""
    mod = relax_main({"x": (1, 96, 1, 56)}, _mean_then_erf_gelu)
    x = _rand(1, 96, 1, 56)
    with caplog.at_level("WARNING", logger="tvm_fusion.schedules"):
        sched = _check(mod, [x], need_vector=False)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("tvm_fusion")]
    assert not ours, ours
    (func,) = _prim_funcs(sched).values()
    rf_buffers = [
        b.name
        for n in tir_stmts(func)
        if isinstance(n, s_tir.SBlock)
        for b in n.alloc_buffers
        if b.name.endswith(".rf")
    ]
    assert rf_buffers, f"not the reduction rule's schedule (its partial sums in SIMD lanes)\n{func}"
    mean = x.mean(axis=3, keepdims=True)
    expected = mean * 0.5 * (1 + np.vectorize(math.erf)(mean / math.sqrt(2)))
    np.testing.assert_allclose(_run(sched, [x]), expected, rtol=1e-5, atol=1e-6)


def test_a_rule_whose_schedule_drops_a_buffer_declines(caplog):
    """A schedule that reads a buffer it no longer defines (the ``reverse_compute_inline`` bug
    above) would fail the whole build at compile time; the rule declines instead, with a warning,
    and the next rule schedules the kernel."""

    class Careless(dl.ScheduleRule):
        @safe_rule
        def apply(self, func, target, tunable):
            sch = s_tir.Schedule(func)
            (divide,) = [
                b for b in sch.get_child_blocks(sch.get_sblock("root")) if "divide" in sch.get(b).name_hint
            ]
            # the mean has two readers: this TVM inlines anyway and drops the mean's buffer (if a
            # later TVM refuses, safe_rule declines without the warning and this test says so)
            sch.reverse_compute_inline(sch.get_consumers(divide)[0])
            return sch

    (func,) = _prim_funcs(_fused(relax_main({"x": (1, 96, 1, 56)}, _mean_then_erf_gelu))).values()
    with caplog.at_level("WARNING", logger="tvm_fusion.schedules"):
        assert Careless().apply(func, ZNVER3, False) is None
    assert "T_divide" in caplog.text and "no longer defines" in caplog.text


def test_small_elementwise_kernel_runs_single_threaded():
    """An elementwise kernel with fewer than PARALLEL_MIN_ELEMENTS outputs has no parallel loop
    (the fork-join costs more than the work) and is still vectorized; a larger one is parallel."""
    for shape, parallel in (((1, 32, 16, 16), False), ((1, 64, 28, 28), True)):
        assert (np.prod(shape) >= PARALLEL_MIN_ELEMENTS) == parallel
        mod = relax_main({"x": shape}, lambda bb, x: relax.op.nn.relu(bb.emit(relax.op.multiply(x, x))))
        x = _rand(*shape)
        (func,) = _prim_funcs(_scheduled(mod)).values()
        assert (tirx.ForKind.PARALLEL in loop_kinds(func)) == parallel, func
        assert tirx.ForKind.VECTORIZED in loop_kinds(func), func
        np.testing.assert_allclose(_run(_scheduled(mod), [x]), np.maximum(x * x, 0), rtol=1e-6)


def test_small_mean_runs_single_threaded():
    """A global mean of fewer than PARALLEL_MIN_ELEMENTS elements has no parallel loop (a fork-join
    costs more than the sum), and still matches."""
    shape = (1, 32, 16, 16)
    assert np.prod(shape) < PARALLEL_MIN_ELEMENTS
    mod = relax_main({"x": shape}, lambda bb, x: relax.op.mean(x, axis=[2, 3], keepdims=True))
    x = _rand(*shape)
    sched = _scheduled(mod)
    (func,) = _prim_funcs(sched).values()
    assert tirx.ForKind.PARALLEL not in loop_kinds(func)
    assert tirx.ForKind.VECTORIZED in loop_kinds(func)
    np.testing.assert_allclose(_run(sched, [x]), x.mean(axis=(2, 3), keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool", ["max", "avg_relu"])
def test_pool_pads_each_output_row_in_its_parallel_iteration(pool):
    """Pools pad only the input rows an output row reads, inside that row's parallel iteration
    (ResNet-18's stem max pool: 0.38-0.56 ms with the whole padded input materialised, 0.16 ms)."""

    def body(bb, x):
        if pool == "max":
            return relax.op.nn.max_pool2d(x, pool_size=3, strides=2, padding=1)
        y = bb.emit(relax.op.nn.avg_pool2d(x, pool_size=3, strides=2, padding=1, count_include_pad=True))
        return relax.op.nn.relu(y)

    sched = _check(relax_main({"x": (1, 8, 13, 13)}, body), [_rand(1, 8, 13, 13)], need_vector=False)
    (func,) = _prim_funcs(sched).values()
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    names = _block_names(func)
    (pad,) = [n for n in names if n.startswith("pad")]
    (update,) = [n for n in names if n.endswith("_update")]
    pad_outer, pool_outer = (sch.get(sch.get_loops(sch.get_sblock(n))[0]) for n in (pad, update))
    assert pad_outer.kind == tirx.ForKind.PARALLEL and pad_outer.same_as(pool_outer), names


def test_pool_epilogue_chain_runs_per_row():
    """PoolFormer's token mixer ``(avg_pool(x) - x) * s + y``: every epilogue block runs in the
    pool's parallel row loop (they were whole-tensor passes over materialised intermediates), and
    the stride-1 window's column loop is innermost (contiguous), the window taps outside it."""
    scale, channels = _rand(8, 1, 1), 8

    def body(bb, x, y):
        pooled = bb.emit(
            relax.op.nn.avg_pool2d(x, pool_size=3, strides=1, padding=1, count_include_pad=False)
        )
        mixed = bb.emit(relax.op.multiply(relax.const(scale), relax.op.subtract(pooled, x)))
        return relax.op.add(y, mixed)

    shape = (1, channels, 14, 14)
    mod = relax_main({"x": shape, "y": shape}, body)
    sched = _check(mod, [_rand(*shape), _rand(*shape)], need_vector=False)
    (func,) = _prim_funcs(sched).values()
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    names = _block_names(func)
    outer = {sch.get(sch.get_loops(sch.get_sblock(n))[0]) for n in names}
    assert len(outer) == 1 and next(iter(outer)).kind == tirx.ForKind.PARALLEL, names
    (update,) = [n for n in names if n.endswith("_update")]
    innermost = sch.get(sch.get_loops(sch.get_sblock(update))[-1])
    assert int(innermost.extent) == 14, innermost  # the output columns, not a 3-tap window loop


def test_elementwise_chain():
    def body(bb, x, y):
        return relax.op.nn.relu(relax.op.multiply(relax.op.add(x, y), relax.const(np.float32(0.5))))

    _check(
        relax_main({"x": (2, 3, 10, 16), "y": (2, 3, 10, 16)}, body),
        [_rand(2, 3, 10, 16), _rand(2, 3, 10, 16)],
    )


def test_transpose_reshape():
    def body(bb, x):
        return relax.op.reshape(relax.op.permute_dims(x, [0, 2, 1, 3]), (1, 12, 32))

    _check(relax_main({"x": (1, 4, 12, 8)}, body), [_rand(1, 4, 12, 8)])


def _vector_walks_last_dim_of(func, shape) -> bool:
    """Whether the vectorized loop moves the last (contiguous) dim of the access to a buffer of
    ``shape`` (read or written; the shapes in these tests differ), rather than another dim."""
    (vec,) = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.VECTORIZED]
    for node in tir_stmts(func):
        if not (hasattr(node, "block") and hasattr(node, "iter_values")):
            continue
        bound = [iv.var for iv, v in zip(node.block.iter_vars, node.iter_values) if uses_var(v, vec.loop_var)]
        for access in list(node.block.reads) + list(node.block.writes):
            if tuple(int(d) for d in access.source.shape) == shape:
                assert len(bound) == 1, func  # the vector is one iter of this block
                return uses_var(access.region[-1].min, bound[0])
    raise AssertionError(f"no access to a {shape} buffer\n{func}")


def test_transpose_takes_its_vectors_along_the_input_lines(monkeypatch):
    """NHWC -> NCHW with a layer scale and a residual (ConvNeXt's return from its channels-last
    MLP; SqueezeBERT's NCW layer norms): vectorized along the output's columns, each lane would load
    from another input line (a gather of 6 lanes here). The vector runs along the input's channels
    instead, a whole vector of them."""
    gamma = _rand(32, 1, 1)

    def body(bb, x, res):
        return relax.op.add(
            relax.op.multiply(relax.op.permute_dims(x, [0, 3, 1, 2]), relax.const(gamma)), res
        )

    from tvm_fusion.schedules import injective

    monkeypatch.setattr(injective, "PARALLEL_MIN_ELEMENTS", 0)  # scheduled as a large transpose
    x, res = _rand(1, 4, 6, 32), _rand(1, 32, 4, 6)
    sched = _check(relax_main({"x": x.shape, "res": res.shape}, body), [x, res])
    (func,) = _prim_funcs(sched).values()
    assert _vector_walks_last_dim_of(func, x.shape), func
    assert tirx.ForKind.PARALLEL in loop_kinds(func), func
    # atol: an output that cancels to ~1e-5 differs in its last bits where LLVM fuses the
    # multiply-add into one FMA (one rounding) and numpy rounds twice
    expected = x.transpose(0, 3, 1, 2) * gamma + res
    np.testing.assert_allclose(_run(sched, [x, res]), expected, rtol=1e-5, atol=1e-6)


def test_transpose_keeps_output_vectors_when_input_lines_are_short():
    """NCHW -> NHWC over 6 columns: along the input's lines only a partial vector fits, stored lane
    by lane into the output (56x56 planes ran 1.8x slower so); the vector stays on the output's
    channels."""
    x = _rand(1, 32, 6, 6)
    sched = _check(relax_main({"x": x.shape}, lambda bb, x: relax.op.permute_dims(x, [0, 2, 3, 1])), [x])
    (func,) = _prim_funcs(sched).values()
    assert not _vector_walks_last_dim_of(func, x.shape), func
    assert _vector_walks_last_dim_of(func, (1, 6, 6, 32)), func  # along the output's channels


# -- end to end + rule selection --------------------------------------------------------------
def test_transformer_block_matches_onnxruntime():

    model = models.transformer_block(seq=8, hidden=32, heads=2)
    feeds = models.random_inputs(model)
    ref = ort_run(model, feeds)
    from tvm.relax.frontend.onnx import from_onnx

    sched = _scheduled(from_onnx(model, keep_params_in_input=False))
    for name, func in _prim_funcs(sched).items():
        assert "tirx.is_scheduled" in func.attrs, name
        _assert_parallel_unless_small(name, func)
    np.testing.assert_allclose(_run(sched, list(feeds.values())), ref, rtol=1e-4, atol=1e-4)


def test_rules_decline_what_they_do_not_handle():
    x = te.placeholder((4, 32), name="x")
    softmax = te.create_prim_func([x, topi.nn.softmax(x)])
    relu = te.create_prim_func([x, topi.nn.relu(x)])
    assert Contraction().apply(softmax, ZNVER3, False) is None  # two reductions: not a contraction
    assert RowReduction().apply(softmax, ZNVER3, False) is not None
    assert Contraction().apply(relu, ZNVER3, False) is None
    assert RowReduction().apply(relu, ZNVER3, False) is None
    assert Injective().apply(softmax, ZNVER3, False) is None
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert Contraction().apply(relu, cuda, False) is None
    assert ParallelFallback().apply(relu, cuda, False) is None


@pytest.mark.parametrize("op", ["layer_norm", "softmax"])
def test_row_reduction_sums_rows_in_simd_lanes(op):
    """Each row's sums are partial sums in vector lanes (an rfactor block, vectorized), every
    block under one parallel row loop; dlight's rule summed one scalar chain per row (BERT's
    128x768 layer norm 0.098 -> 0.012 ms)."""
    x, g, b = (
        te.placeholder((64, 256), name="x"),
        te.placeholder((256,), name="g"),
        te.placeholder((256,), name="b"),
    )
    if op == "layer_norm":
        func = te.create_prim_func([x, g, b, topi.nn.layer_norm(x, g, b, axis=[-1], epsilon=1e-5)])
    else:
        func = te.create_prim_func([x, topi.nn.softmax(x)])
    sch = RowReduction().apply(func, ZNVER3, False)
    mod = sch.mod["main"]
    assert '_rf_update"' in mod.script(), "no partial sums in lanes"
    kinds = [loop.kind for loop in collect_loops(mod)]
    assert kinds.count(tirx.ForKind.PARALLEL) == 1 and tirx.ForKind.VECTORIZED in kinds
    lib = tvm.tirx.build(sch.mod, target=ZNVER3)
    xv, gv, bv = _rand(64, 256), _rand(256), _rand(256)
    out = tvm.runtime.tensor(np.zeros((64, 256), "float32"))
    if op == "layer_norm":
        lib["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(gv), tvm.runtime.tensor(bv), out)
        ref = (xv - xv.mean(1, keepdims=True)) / np.sqrt(xv.var(1, keepdims=True) + 1e-5) * gv + bv
    else:
        lib["main"](tvm.runtime.tensor(xv), out)
        e = np.exp(xv - xv.max(1, keepdims=True))
        ref = e / e.sum(1, keepdims=True)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_row_reduction_leaves_a_channel_softmax_to_dlight():
    """A softmax over NCHW's channels reads its sums at (n, h, w) while the output's rows are
    (n, c, h): under that row loop each row would redo the reduction, so dlight's schedule stays."""
    x = te.placeholder((1, 32, 8, 8), name="x")
    sch = RowReduction().apply(te.create_prim_func([x, topi.nn.softmax(x, axis=1)]), ZNVER3, False)
    assert '_rf_update"' not in sch.mod["main"].script()
    lib = tvm.tirx.build(sch.mod, target=ZNVER3)
    xv = _rand(1, 32, 8, 8)
    out = tvm.runtime.tensor(np.zeros((1, 32, 8, 8), "float32"))
    lib["main"](tvm.runtime.tensor(xv), out)
    e = np.exp(xv - xv.max(1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_fallback_parallelizes_a_reduction_without_splitting_it():
    x = te.placeholder((64, 100), name="x")
    k = te.reduce_axis((0, 100), name="k")
    amax = te.compute((64,), lambda i: te.max(x[i, k] * x[i, k], axis=k), name="sqmax")
    func = te.create_prim_func([x, amax])
    sch = ParallelFallback().apply(func, ZNVER3, False)
    par = [lp for lp in collect_loops(sch.mod["main"]) if lp.kind == tirx.ForKind.PARALLEL]
    assert par and all(int(lp.extent) <= 64 for lp in par)
    lib = tvm.tirx.build(sch.mod, target=ZNVER3)
    xv = _rand(64, 100)
    out = tvm.runtime.tensor(np.zeros(64, "float32"))
    lib["main"](tvm.runtime.tensor(xv), out)
    np.testing.assert_allclose(out.numpy(), (xv * xv).max(axis=1), rtol=1e-6)


def test_default_rules_per_target():
    cuda = default_rules({"kind": "cuda", "arch": "sm_80"})
    # dlight's GPU rules (its Matmul with tunable config), each wrapped so that one that raises
    # declines (see test_cuda.py)
    assert [type(r.rule) for r in cuda] == [
        TunableMatmul,
        dl.gpu.GEMV,
        dl.gpu.Reduction,
        dl.gpu.GeneralReduction,
        dl.gpu.Fallback,
    ]
    cpu = default_rules(ZNVER3)
    assert [type(r) for r in cpu] == [
        WindowReduction,
        Winograd,
        Strassen,
        Depthwise,
        PlainReduction,
        Contraction,
        RowReduction,
        Injective,
        ParallelFallback,
    ]


def test_long_reduction_accumulates_in_a_local_register_tile():
    w = _rand(512, 32, scale=0.05)
    mod = relax_main({"x": (8, 512)}, lambda bb, x: relax.op.nn.relu(relax.op.matmul(x, relax.const(w))))
    sched = _check(mod, [_rand(8, 512)], rtol=1e-4, atol=1e-4)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "matmul" in n]
    assert 'scope="local"' in func.script()


# -- cache blocking of long reductions --------------------------------------------------------
def _reduction_loop_layout(func, block):
    """For each loop around block (outermost first): 'R' if it binds a reduction iter, else 'S'."""
    from tvm import s_tir

    from tvm_fusion.schedules.fallback import get_sblock_realize

    sch = s_tir.Schedule(func)
    blk = sch.get_sblock(block)
    stmt, realize = sch.get(blk), get_sblock_realize(sch, blk)
    r_vars = [
        v
        for it, val in zip(stmt.iter_vars, realize.iter_values)
        if it.iter_type == tirx.IterVar.CommReduce
        for v in tirx.analysis.undefined_vars(val)
    ]
    out = []
    for lp in sch.get_loops(blk):
        var = sch.get(lp).loop_var
        out.append("R" if any(v.same_as(var) for v in r_vars) else "S")
    return "".join(out)


def _update_block(func):
    names = [n for n in _block_names(func) if n.endswith("_update")]
    assert len(names) == 1, names
    return names[0]


@pytest.mark.parametrize("k", [1024, 64], ids=["K1024", "K64"])
def test_gemm_rows_are_not_cache_blocked(k):
    """A GEMM's row operand (x[m, k]) is read along the reduction: each tile uses up the lines it
    loads, so chunking K would only move the packed panel from L2 to L1 and cost an accumulator
    reload per chunk (measured slower on BERT / ViT GEMMs). K=1024 (a 96-128 KiB panel, more than
    L1) and K=64 both keep the plain schedule: one K loop inside the tile."""
    w, b = _rand(k, 512, scale=0.05), _rand(512)

    def body(bb, x):
        return relax.op.nn.relu(
            bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
        )

    x = _rand(128, k)
    sched = _check(relax_main({"x": (128, k)}, body), [x], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_run(sched, [x]), np.maximum(x @ w + b, 0), rtol=1e-4, atol=1e-4)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "matmul" in n]
    layout = _reduction_loop_layout(func, _update_block(func))
    par = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.PARALLEL]
    assert par, func
    assert layout.count("R") == 1, layout


def test_pointwise_conv_with_1024_input_channels_is_cache_blocked():
    """1x1 conv, 1024 -> 256 channels at 14x14 (a GEMM over the flattened plane whose row operand
    x[k, plane] gives one cache line per reduction step, shared by the next row tiles): the
    input-channel loop is chunked outside the row tiles so those lines stay in L1."""
    cin, cout, size = 1024, 256, 14
    w, b = _rand(cout, cin, 1, 1, scale=0.05), _rand(1, cout, 1, 1)

    def body(bb, x):
        y = bb.emit(relax.op.add(bb.emit(relax.op.nn.conv2d(x, relax.const(w))), relax.const(b)))
        return relax.op.nn.relu(y)

    sched = _check(
        relax_main({"x": (1, cin, size, size)}, body), [_rand(1, cin, size, size)], rtol=1e-4, atol=1e-4
    )
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    layout = _reduction_loop_layout(func, _update_block(func))
    # S(parallel) R(chunk) S..(row tiles) R(k in chunk) S..(micro-kernel)
    assert layout.startswith("SR") and layout.count("R") == 2 and "SR" in layout[1:], layout


def test_conv2d_256_input_channels_is_cache_blocked():
    """3x3 conv, 256 -> 64 channels at 14x14: the weight panel per channel tile (256*9 taps) is far
    more than L1; the input-channel loop is chunked outside the spatial tiles, numbers unchanged."""
    cin, cout, size = 256, 64, 14
    w, b = _rand(cout, cin, 3, 3, scale=0.05), _rand(1, cout, 1, 1)
    res = _rand(1, cout, size, size)

    def body(bb, x):
        y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1))
        y = bb.emit(relax.op.add(bb.emit(relax.op.add(y, relax.const(b))), relax.const(res)))
        return relax.op.nn.relu(y)

    sched = _check(
        relax_main({"x": (1, cin, size, size)}, body), [_rand(1, cin, size, size)], rtol=1e-4, atol=1e-4
    )
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    layout = _reduction_loop_layout(func, _update_block(func))
    # the input-channel chunk loop sits between the parallel loop and the spatial tile loops; the
    # in-chunk channels and the 3x3 taps are inside them
    assert layout.startswith("SR") and layout.count("R") == 4 and "SRRR" in layout[2:], layout


# -- reduction prologue + contraction (layer_norm / softmax fused in front of a GEMM) ---------
def _policy_fused(mod, policy=None):
    """The project pipeline up to FuseTIR (no schedules): LN -> matmul -> add -> gelu is one PrimFunc."""
    from tvm_fusion.pipeline import pipeline_passes

    with ZNVER3:
        for p in pipeline_passes(ZNVER3, policy, schedule=False):
            mod = p(mod)
    return mod


def _run_prim(func, feeds_and_out):
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=ZNVER3)
    args = [tvm.runtime.tensor(a) for a in feeds_and_out]
    lib["main"](*args)
    return args[-1].numpy()


def _loops_of(func, block):
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    return [sch.get(lp) for lp in sch.get_loops(sch.get_sblock(block))]


def _block_names(func):
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    out, stack = [], [sch.get_sblock("root")]
    while stack:
        for blk in sch.get_child_blocks(stack.pop()):
            out.append(sch.get(blk).name_hint)
            stack.append(blk)
    return out


def test_layer_norm_gemm_gelu_prologue_fusion():
    from tvm.relax.frontend.onnx import from_onnx

    model = models.transformer_block(seq=8, hidden=32, heads=2)
    fused = _policy_fused(from_onnx(model, keep_params_in_input=False))
    (name,) = [n for n in _prim_funcs(fused) if "layer_norm" in n and "matmul" in n and "gelu" in n]
    func = fused[name]
    # one PrimFunc: the LN row reductions, the GEMM and the erf epilogue
    assert func.script().count("T.init()") >= 3
    sch = Contraction(prepack=False).apply(func, ZNVER3, False)
    assert sch is not None, "Contraction declined the fused LN + GEMM PrimFunc"
    got_func = sch.mod["main"]
    feeds = [_rand(*[int(d) for d in p.shape]) for p in func.params]
    np.testing.assert_allclose(_run_prim(got_func, feeds), _run_prim(func, feeds), rtol=1e-5, atol=1e-5)
    # GEMM: the register-tiled micro-kernel (parallel tiles, reduction, unrolled rows, SIMD)
    kinds = [lp.kind for lp in _loops_of(got_func, "matmul_update")]
    assert kinds[0] == tirx.ForKind.PARALLEL and kinds[-1] == tirx.ForKind.VECTORIZED, kinds
    assert tirx.ForKind.UNROLLED in kinds
    # LN: its own stage, parallel over rows, vectorized normalize and rfactor'ed sums
    ln = [lp.kind for lp in _loops_of(got_func, "T_layer_norm")]
    assert ln[0] == tirx.ForKind.PARALLEL and ln[-1] == tirx.ForKind.VECTORIZED, ln
    rf_blocks = [n for n in _block_names(got_func) if n.endswith("_rf_update")]
    assert len(rf_blocks) == 2, _block_names(got_func)  # sum and variance, SIMD partial sums
    assert all(_loops_of(got_func, n)[-1].kind == tirx.ForKind.VECTORIZED for n in rf_blocks)
    # and through the whole default-schedule pass (with weight packing) the model matches ORT

    feeds = models.random_inputs(model)
    ref = ort_run(model, feeds)
    with ZNVER3:
        sched = apply_default_schedules(ZNVER3)(fused)
    (packed,) = [f for n, f in _prim_funcs(sched).items() if "layer_norm" in n and "gelu" in n]
    assert tirx.ForKind.VECTORIZED in [lp.kind for lp in _loops_of(packed, "matmul_update")]
    np.testing.assert_allclose(_run(sched, list(feeds.values())), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [20], ids=["odd_width"])  # 32 (rfactor) is the transformer test
def test_residual_add_layer_norm_gemm(width):
    from tvm_fusion import FusionPolicy

    g, b, w = _rand(width), _rand(width), _rand(width, 24, scale=0.2)

    def body(bb, x, y):
        s = bb.emit(relax.op.add(x, y))
        ln = bb.emit(relax.op.nn.layer_norm(s, relax.const(g), relax.const(b), axes=[-1]))
        return relax.op.matmul(ln, relax.const(w))

    mod = relax_main({"x": (1, 12, width), "y": (1, 12, width)}, body)
    fused = _policy_fused(mod, FusionPolicy(horizontal=False))
    assert any("layer_norm" in n and "matmul" in n for n in _prim_funcs(fused)), list(_prim_funcs(fused))
    feeds = [_rand(1, 12, width), _rand(1, 12, width)]
    expected = _run(fused, feeds)
    with ZNVER3:
        sched = apply_default_schedules(ZNVER3)(fused)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "layer_norm" in n]
    assert tirx.ForKind.PARALLEL in loop_kinds(func) and "matmul_update" in func.script()
    np.testing.assert_allclose(_run(sched, feeds), expected, rtol=1e-5, atol=1e-5)


def test_softmax_prologue_batch_matmul():
    """A user policy fusing softmax -> matmul: the softmax rows are a stage, the bmm a micro-kernel."""
    from tvm_fusion import FusionPolicy

    policy = FusionPolicy(horizontal=False)
    policy.vertical["softmax"] = policy.vertical["softmax"] + ["gemm"]

    def body(bb, s, v):
        return relax.op.matmul(bb.emit(relax.op.nn.softmax(s, axis=-1)), v)

    mod = relax_main({"s": (2, 16, 16), "v": (2, 16, 24)}, body)
    fused = _policy_fused(mod, policy)
    (name,) = [n for n in _prim_funcs(fused) if "softmax" in n]
    assert "matmul" in name, name
    feeds = [_rand(2, 16, 16), _rand(2, 16, 24)]
    expected = _run(fused, feeds)
    sch = Contraction().apply(fused[name], ZNVER3, False)
    assert sch is not None
    with ZNVER3:
        sched = apply_default_schedules(ZNVER3)(fused)
    np.testing.assert_allclose(_run(sched, feeds), expected, rtol=1e-5, atol=1e-5)


def test_two_contractions_are_declined():
    """QK^T -> softmax -> PV in one PrimFunc: two GEMMs, not a prologue; Contraction says no."""
    q = te.placeholder((16, 8), name="q")
    k = te.placeholder((16, 8), name="k")
    v = te.placeholder((16, 8), name="v")
    r = te.reduce_axis((0, 8), name="r")
    s = te.compute((16, 16), lambda i, j: te.sum(q[i, r] * k[j, r], axis=r), name="qk")
    p = topi.nn.softmax(s)
    r2 = te.reduce_axis((0, 16), name="r2")
    o = te.compute((16, 8), lambda i, j: te.sum(p[i, r2] * v[r2, j], axis=r2), name="pv")
    assert Contraction().apply(te.create_prim_func([q, k, v, o]), ZNVER3, False) is None


# -- fast GELU legalization -------------------------------------------------------------------
def test_fast_gelu_legalization_is_vectorizable_and_switchable():
    from tvm_fusion.legalize import register
    from tvm_fusion.legalize.fast_gelu import fast_gelu, fast_gelu_enabled

    register()

    mod = relax_main({"x": (4, 64)}, lambda bb, x: relax.op.nn.gelu(x))
    x = np.linspace(-7, 7, 256, dtype="float32").reshape(4, 64)
    import math

    exact = x * 0.5 * (1 + np.vectorize(math.erf)(x.astype("float64") / math.sqrt(2)))
    assert fast_gelu_enabled()
    with fast_gelu(False):
        slow = LegalizeOps()(mod)
    fast = LegalizeOps()(mod)
    assert "T.erf" in _prim_funcs(relax.transform.LegalizeOps()(mod))["gelu"].script()  # stock outside ours
    assert "T.erf" in _prim_funcs(slow)["gelu"].script()
    assert "T.erf" not in _prim_funcs(fast)["gelu"].script()  # the polynomial, no libm call
    for m in (slow, fast):
        np.testing.assert_allclose(_run(m, [x]), exact, rtol=0, atol=2e-6)


@pytest.mark.keep_parallel_threshold
def test_tiny_contraction_stays_single_threaded():
    """Below PARALLEL_MIN_MACS waking the thread pool costs more than the work: no parallel loop."""
    from tvm_fusion.schedules.contraction_plan import PARALLEL_MIN_MACS

    assert 1 * 32 * 10 < PARALLEL_MIN_MACS
    w = _rand(32, 10)
    mod = relax_main({"x": (1, 32)}, lambda bb, x: relax.op.matmul(x, relax.const(w)))
    x = _rand(1, 32)
    sched = _scheduled(mod)
    funcs = _prim_funcs(sched)
    assert funcs
    for func in funcs.values():
        kinds = loop_kinds(func)
        assert tirx.ForKind.PARALLEL not in kinds and tirx.ForKind.VECTORIZED in kinds, kinds
    np.testing.assert_allclose(_run(sched, [x]), x @ w, rtol=1e-5, atol=1e-5)


# -- the tuner's space over the Contraction rule's decisions ----------------------------------------
@pytest.mark.parametrize("model_name", ["resnet_block_net", "transformer_block"])
def test_rule_space_contains_the_default_schedule(model_name):
    """With every decision at its default (the cost model's plan), the schedule the tuner builds is
    the untuned kernel, structurally: tuning can never start worse than untuned."""
    from tvm_fusion.frontend import import_onnx
    from tvm_fusion.pipeline import unscheduled_module
    from tvm_fusion.tuning import extract_tasks, rule_space

    model = models.EXAMPLES[model_name]()
    mod = unscheduled_module(import_onnx(model).mod, ZNVER3)
    spaces = 0
    for task in extract_tasks(mod, ZNVER3):
        func = task.dispatched[0]["main"]
        space = rule_space(func, ZNVER3)
        if space is None:
            continue
        spaces += 1
        default = space.rule_type().apply(func, ZNVER3, False)  # Contraction, or Winograd for 3x3 convs
        at_default, effective = space.schedule(func, ZNVER3, (0,) * len(space.names))
        assert effective == (0,) * len(space.names)
        tvm.ir.assert_structural_equal(at_default.mod, default.mod)
        # and another point is another schedule
        other = space.schedule(func, ZNVER3, (1,) + (0,) * (len(space.names) - 1))
        assert other is not None and not tvm_ffi.structural_equal(other[0].mod, default.mod)
    assert spaces >= 3  # the convs / GEMMs of the model have spaces


def _unrolled_copies(stmt, copies=1) -> int:
    """The most copies of one statement that the unrolled loops around it ask LLVM for."""
    if isinstance(stmt, tirx.For):
        if stmt.kind == tirx.ForKind.UNROLLED:
            copies *= int(stmt.extent)
        return _unrolled_copies(stmt.body, copies)
    if isinstance(stmt, tirx.SeqStmt):
        return max(_unrolled_copies(s, copies) for s in stmt.seq)
    children = [getattr(stmt, n, None) for n in ("body", "block", "init", "then_case", "else_case")]
    children = [c for c in children if isinstance(c, tirx.Stmt)]
    return max([_unrolled_copies(c, copies) for c in children] or [copies])


def test_squeeze_excitation_scale_is_its_own_parallel_stage(cpu_target):
    """SE's ``x * sigmoid(conv(..))`` computes C x H x W elements from a 1 x C contraction. Computed
    per contraction tile (and unrolled: ~1,800 copies at 112x112) it took LLVM 2 minutes; as its
    own stage it is a parallel, vectorized loop nest with a bounded unroll."""
    import onnxruntime as ort
    from tvm.relax.frontend.onnx import from_onnx

    from tvm_fusion.api import optimize
    from tvm_fusion.schedules.contraction import MAX_EPILOGUE_UNROLL

    model = models.se_block(size=112, channels=32, reduced=8)
    feeds = models.random_inputs(model)
    lowered = optimize(from_onnx(model, keep_params_in_input=False), cpu_target)
    (name,) = [n for n in _prim_funcs(lowered) if "sigmoid_multiply" in n]
    func = _prim_funcs(lowered)[name]
    assert _unrolled_copies(func.body) <= MAX_EPILOGUE_UNROLL
    # the broadcast multiply is not under the contraction's tile loop: its own parallel nest
    # covers all 32 channels (the tile loop has 32 / vector width iterations)
    par = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.PARALLEL]
    assert any("T_multiply" in lp.script() and int(lp.extent) >= 32 for lp in par), func
    assert tirx.ForKind.VECTORIZED in loop_kinds(func)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()]).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _ragged_matmul(k: int):
    """``x[1, 197, k] @ w + b`` scheduled and checked: 197 rows have no divisor to tile by."""
    w, b = _rand(k, 64, scale=0.1 if k < 128 else 0.05), _rand(64)
    mod = relax_main(
        {"x": (1, 197, k)}, lambda bb, x: relax.op.add(relax.op.matmul(x, relax.const(w)), relax.const(b))
    )
    x = _rand(1, 197, k)
    sched = _check(mod, [x], rtol=1e-4, atol=1e-4)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "matmul" in n]
    return sched, func, x, w, b


def test_prime_row_count_gets_ragged_row_tiles():
    """197 rows (ViT's sequence) has no divisor to tile by: instead of one-row tiles that stream the
    whole weight panel per row (17x slower than 196 rows), the rows are tiled with a partial last
    tile."""
    sched, func, x, w, b = _ragged_matmul(96)
    unrolled = [
        lp
        for lp in collect_loops(func)
        if lp.kind == tirx.ForKind.UNROLLED and "matmul_update" in lp.script()
    ]
    assert any(int(lp.extent) > 1 for lp in unrolled), func  # a row tile of several rows
    assert "T.where" in func.script()  # the last tile skips the rows past 197
    np.testing.assert_allclose(_run(sched, [x]), x @ w + b, rtol=1e-4, atol=1e-4)


def test_prime_vector_extent_is_padded_to_whole_vectors():
    """Attention scores q @ k^T with 197 keys: the key axis is the only contiguous one, and 197 has
    no divisor to vectorize by. The iteration is padded to whole vectors (zero-padded copy of k^T,
    padded result cropped) instead of gathering across heads."""
    mod = relax_main({"q": (1, 4, 197, 16), "kt": (1, 4, 16, 197)}, lambda bb, q, kt: relax.op.matmul(q, kt))
    q, kt = _rand(1, 4, 197, 16), _rand(1, 4, 16, 197)
    sched = _check(mod, [q, kt], rtol=1e-4, atol=1e-4)
    (func,) = _prim_funcs(sched).values()
    text = func.script()
    assert "kt_pad" in text, text
    assert "* kt_pad[" in text  # the micro-kernel reads the padded copy (vectors along the keys)
    assert tirx.ForKind.VECTORIZED in loop_kinds(func)
    np.testing.assert_allclose(_run(sched, [q, kt]), q @ kt, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "op,name,ref",
    [
        (relax.op.exp, "exp", np.exp),
        (relax.op.sigmoid, "sigmoid", lambda v: 1 / (1 + np.exp(-v))),
        (relax.op.nn.silu, "silu", lambda v: v / (1 + np.exp(-v))),
        (relax.op.tanh, "tanh", np.tanh),
        (lambda t: relax.op.nn.softmax(t, axis=-1), "softmax", None),
    ],
)
def test_fast_exp_legalizations_have_no_libm_calls_and_are_switchable(op, name, ref):
    """exp / sigmoid / SiLU / tanh / softmax lower to SIMD arithmetic (topi.fast_exp / fast_tanh):
    T.exp / T.tanh become one scalar libm call per element (SiLU over 96x112x112: 4.1 -> 0.2 ms)."""
    from tvm_fusion.legalize import register
    from tvm_fusion.legalize.fast_exp import fast_exp, fast_exp_enabled

    register()

    mod = relax_main({"x": (4, 64)}, lambda bb, x: op(x))
    x = np.linspace(-12, 12, 256, dtype="float32").reshape(4, 64)
    assert fast_exp_enabled()
    with fast_exp(False):
        slow = LegalizeOps()(mod)
    fast = LegalizeOps()(mod)
    text = lambda m: "\n".join(f.script() for f in _prim_funcs(m).values())  # noqa: E731
    libm = ("T.exp(", "T.tanh(", "T.sigmoid(")  # T.sigmoid lowers to exp
    assert any(call in text(slow) for call in libm)
    assert not any(call in text(fast) for call in libm)
    x64 = x.astype("float64")
    if ref is None:
        e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
        expected = e / e.sum(axis=-1, keepdims=True)
    else:
        expected = ref(x64)
    for m in (slow, fast):
        np.testing.assert_allclose(_run(m, [x]), expected, rtol=3e-6, atol=1e-7)
    np.testing.assert_allclose(_run(_scheduled(mod), [x]), expected, rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize(
    "op, plane, width",
    [
        ("mean", (14, 16), 8),  # whole AVX2 vectors (the tests' target is znver3)
        ("mean", (13, 13), 13),
        ("mean", (7, 7), 7),
        ("mean", (14, 14), 14),
        ("max", (13, 13), 13),
        ("sum", (7, 7), 7),
        ("mean", (19, 19), None),  # no divisor from 4 to 16: one scalar chain
    ],
)
def test_global_reduction_sums_the_plane_in_simd_lanes(op, plane, width):
    """A mean / max / sum over H x W (squeeze-excitation's pool) is parallel over channels and
    reduces the contiguous plane in vector lanes (rfactor), not a contraction gathering across
    channels; a plane that is no whole number of vectors (13x13, 7x7) uses as many lanes as
    divide it."""
    reduce = getattr(relax.op, op)
    channels = 512  # enough elements for a parallel loop (PARALLEL_MIN_ELEMENTS) on every plane
    mod = relax_main({"x": (1, channels, *plane)}, lambda bb, x: reduce(x, [2, 3], keepdims=True))
    x = _rand(1, channels, *plane) - 3.0  # all negative: a max that started from 0 would show
    sched = _check(mod, [x], rtol=1e-5, atol=1e-5, need_vector=width is not None)
    (func,) = _prim_funcs(sched).values()
    vectorized = [int(lp.extent) for lp in collect_loops(func) if lp.kind == tirx.ForKind.VECTORIZED]
    if width is None:
        assert "_rf" not in func.script() and not vectorized, func
    else:
        assert "_rf" in func.script(), func  # the lanes' partial sums
        assert width in vectorized, func
    par = [lp for lp in collect_loops(func) if lp.kind == tirx.ForKind.PARALLEL]
    assert par and int(par[0].extent) == channels
    expected = getattr(x.astype("float64"), op)(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(_run(sched, [x]), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exponent", [2.0, 3.0, 2.5])
def test_small_integer_power_is_multiplication(exponent):
    """``x ** 3`` (GPT-2's tanh-GELU) lowers to products, not a powf call per element; other
    exponents keep the stock lowering."""
    mod = relax_main({"x": (4, 64)}, lambda bb, x: relax.op.power(x, relax.const(exponent, "float32")))
    x = np.abs(_rand(4, 64)) + 0.1
    legal = LegalizeOps()(mod)
    assert ("T.pow(" in "\n".join(f.script() for f in _prim_funcs(legal).values())) == (exponent == 2.5)
    np.testing.assert_allclose(_run(legal, [x]), x.astype("float64") ** exponent, rtol=2e-6)


@pytest.mark.parametrize("split", [(3, 4, 16), (4, 48), (12, 16)])
def test_reshape_epilogue_across_tile_boundaries_is_correct(split):
    """matmul -> add -> reshape that splits the tiled axis: where a tile straddles a reshape chunk
    the epilogue must not be computed per tile (it would read other tiles' accumulators); either
    way the kernel matches the unscheduled one. (The splits cross 16/24/32/48-wide tiles on both
    AVX2 and AVX-512 machines.)"""
    x = te.placeholder((2, 77, 64), name="x")
    w = te.placeholder((64, 192), name="w")
    b = te.placeholder((192,), name="b")
    k = te.reduce_axis((0, 64), "k")
    mm = te.compute((2, 77, 192), lambda i, j, n: te.sum(x[i, j, k] * w[k, n], axis=k), name="matmul")
    add = te.compute((2, 77, 192), lambda i, j, n: mm[i, j, n] + b[n], name="add")
    out = topi.reshape(add, (2, 77, *split))
    func = te.create_prim_func([x, w, b, out]).with_attr("global_symbol", "main")
    feeds = [_rand(2, 77, 64), _rand(64, 192), _rand(192)]

    def run(mod):
        args = [tvm.runtime.tensor(v) for v in feeds] + [
            tvm.runtime.tensor(np.zeros((2, 77, *split), "float32"))
        ]
        tvm.tirx.build(mod, target=ZNVER3)["main"](*args)
        return args[-1].numpy()

    sch = Contraction().apply(func, ZNVER3, False)
    assert sch is not None
    np.testing.assert_allclose(run(sch.mod), run(tvm.IRModule({"main": func})), rtol=1e-5, atol=1e-5)


def test_ragged_row_tiles_accumulate_in_the_intermediate():
    """A ragged last tile puts its bounds check on every accumulator update, and LLVM then keeps a
    ``local`` accumulator tile in memory: such tiles accumulate in the (compacted) intermediate
    (SqueezeNet's 128->16 1x1 conv over 55x55 in tiles of 8: 0.128 -> 0.058 ms)."""
    sched, func, x, w, b = _ragged_matmul(256)
    text = func.script()
    assert "T.where" in text, func  # 197 rows: the last tile is partial
    assert 'scope="local"' not in text, func
    np.testing.assert_allclose(_run(sched, [x]), x @ w + b, rtol=1e-4, atol=1e-4)


def test_pointwise_conv_with_few_output_channels_vectorizes_its_plane():
    """Lanes on output channels write an NCHW tile as one short run per channel (32 channels x 8
    pixels: 32 cache lines); lanes along the plane write 8 channel rows of whole vectors. The cost
    model charges each touched line, so MobileNet-V2's 144->32 1x1 conv at 28x28 vectorizes its
    plane (0.091 -> 0.039 ms with its input fresh from a producer)."""
    from tvm import s_tir

    from tvm_fusion.schedules._util import uses_var
    from tvm_fusion.schedules.fallback import get_sblock_realize

    w, b = _rand(32, 144, 1, 1, scale=0.1), _rand(1, 32, 1, 1)

    def body(bb, x):
        return relax.op.add(bb.emit(relax.op.nn.conv2d(x, relax.const(w))), relax.const(b))

    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "rocketlake", "num-cores": 2})
    with avx512:  # 16 lanes: on AVX2 the plane won already without the line cost
        sched = apply_default_schedules(avx512)(_fused(relax_main({"x": (1, 144, 28, 28)}, body)))
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    sch = s_tir.Schedule(func)
    update = sch.get_sblock("conv2d_nchw_update")
    inner = sch.get(sch.get_loops(update)[-1])
    assert inner.kind == tirx.ForKind.VECTORIZED, func
    realize = get_sblock_realize(sch, update)
    vector_dims = [
        int(iv.dom.extent)
        for iv, value in zip(realize.block.iter_vars, realize.iter_values)
        if uses_var(value, inner.loop_var)
    ]
    assert vector_dims == [28 * 28], (vector_dims, func)


def test_pointwise_conv_on_a_14x14_plane_takes_14_lane_rows_with_avx512():
    """With AVX-512 a partial vector computes in one register (LLVM masks or splits its loads and
    stores), so a 1x1 conv over a 14x14 plane (196 pixels: no whole 16-lane vector divides it) vectorizes over the plane in rows
    of 14 lanes and writes its output rows contiguously. Before, the lanes went on output
    channels and every tile's write-back was a transpose (EfficientNet's 80->480 expand: 0.18 vs
    0.08 ms). AVX2 keeps its plan: there a 14-lane vector is 8 + 6 lanes."""
    mod = _pointwise_conv_module(40, 96, 14)
    feeds = [_rand(1, 40, 14, 14)]
    expected = _run(_fused(mod), feeds)

    def conv_vector_extents(target):
        with target:
            sched = apply_default_schedules(target)(_fused(mod))
        (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
        return sched, {int(lp.extent) for lp in collect_loops(func) if lp.kind == tirx.ForKind.VECTORIZED}

    sched, extents = conv_vector_extents(ZNVER4)
    assert extents == {14}, extents
    assert 14 not in conv_vector_extents(ZNVER3)[1]  # AVX2: 8-lane vectors (the old plan)
    if HOST_HAS_AVX512:
        got = run_relax(sched, feeds, ZNVER4)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _pointwise_conv_module(cin, cout, size):
    """main(x) = clip(conv1x1(x) + bias): a MobileNet / SqueezeNet pointwise kernel."""
    w, b = _rand(cout, cin, 1, 1, scale=0.2), _rand(1, cout, 1, 1)

    def body(bb, x):
        y = bb.emit(relax.op.add(bb.emit(relax.op.nn.conv2d(x, relax.const(w))), relax.const(b)))
        return relax.op.clip(y, 0.0, 6.0)

    return relax_main({"x": (1, cin, size, size)}, body)


def _pointwise_conv_func(cin, cout, size):
    """The fused PrimFunc of :func:`_pointwise_conv_module`."""
    # weights marked layout-free (packable at compile time) as the build's first scheduling step does
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(_fused(_pointwise_conv_module(cin, cout, size)))
    (func,) = [f for n, f in _prim_funcs(mod).items() if "conv" in n]
    return func


def _every_plan(func, target):
    """(plan, its schedule) for every micro-kernel plan the tuner may pick."""
    rule = Contraction()
    rule.apply(func, target, False)
    for plan in range(rule.last_knobs.counts["plan"]):
        yield plan, Contraction(knobs={"plan": plan}).apply(func, target, False)


def test_every_plan_of_a_one_tile_wide_conv_runs_on_both_cores():
    """SqueezeNet's 512->64 1x1 conv over 13x13: when one vector tile covers all 64 output
    channels, the cache-blocked loop nest had a single parallel task and ran on one core (0.104
    ms, against 0.053 with 32-channel tiles). Whatever plan the model or the tuner picks, the
    work is split over both cores."""
    for plan, sch in _every_plan(_pointwise_conv_func(512, 64, 13), ZNVER4):
        main_loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("conv2d_nchw_update"))]
        parallel = [lp for lp in main_loops if lp.kind == tirx.ForKind.PARALLEL]
        assert parallel and int(parallel[0].extent) >= 2, f"plan {plan}\n{sch.mod['main']}"


def test_channel_lane_tile_writes_back_in_whole_vectors():
    """A tile with lanes on output channels and 7 plane rows (64->384 1x1 conv over 14x14) writes
    NCHW rows of 7 pixels. Vectorized along those rows, every store gathered one lane from each
    of 7 accumulator vectors and LLVM spilled the tile (2-3x slower, and bimodal from run to
    run); the write-back now runs along the channels in whole 16-lane vectors. Plans with lanes
    along the plane (14-lane rows) write contiguous rows and keep them."""
    target = ZNVER4
    func = _pointwise_conv_func(64, 384, 14)
    epilogue_lanes = {}
    for plan, sch in _every_plan(func, target):
        micro_kernel = sch.get(sch.get_loops(sch.get_sblock("conv2d_nchw_update"))[-1])
        epilogue = sch.get(sch.get_loops(sch.get_sblock("compute"))[-1])
        assert epilogue.kind == tirx.ForKind.VECTORIZED, f"plan {plan}\n{sch.mod['main']}"
        epilogue_lanes[plan] = (int(micro_kernel.extent), int(epilogue.extent))
    channel_lanes = {p: e for p, (m, e) in epilogue_lanes.items() if m == 16}
    assert channel_lanes and all(e % 16 == 0 for e in channel_lanes.values()), epilogue_lanes
    if HOST_HAS_AVX512:  # numerics of a strided write-back (the model's first channel-lane plan)
        plan = min(channel_lanes)
        got = _run_prim_func(Contraction(knobs={"plan": plan}).apply(func, target, False).mod["main"], target)
        want = _run_prim_func(func, target)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _run_prim_func(func, target):
    """Run a (scheduled or not) PrimFunc on fixed random inputs; its last argument is the output."""
    rt = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    rng = np.random.default_rng(1)
    args = [
        tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.shape]).astype("float32"))
        for p in func.params
    ]
    rt["main"](*args)
    return args[-1].numpy()


def test_pointwise_conv_with_13_lane_plane_rows_takes_channel_lanes_with_avx512():
    """SqueezeNet's classifier conv (512->1000 over 13x13, padded to 1008 channels by
    PadConvChannels): 13-lane plane rows leave 3 of 16 lanes idle, and channel lanes measured 12%
    faster (0.84 vs 0.96 ms). A 14x14 plane's 14-lane rows (2 idle) keep their plan (test above).
    The plan model decides for znver4 on any host; this checks the micro-kernel's lanes."""
    sch = Contraction().apply(_pointwise_conv_func(512, 1008, 13), ZNVER4, False)
    innermost = sch.get(sch.get_loops(sch.get_sblock("conv2d_nchw_update"))[-1])  # the micro-kernel's
    assert innermost.kind == tirx.ForKind.VECTORIZED and int(innermost.extent) == 16, sch.mod["main"]


def test_blocked_pointwise_conv_splits_evenly_over_the_cores():
    """MobileNet-V2's 960->160 1x1 conv over 7x7: the best micro-kernel (32 channels x 7 pixels)
    is cache-blocked into one parallel task per 32 channels, 5 tasks for 2 cores (0.083 ms); the
    16-channel plan makes 10 (0.070 ms). The plans are ranked by the tasks blocking leaves."""
    sch = Contraction().apply(_pointwise_conv_func(960, 160, 7), ZNVER4, False)
    loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("conv2d_nchw_update"))]
    (tasks,) = [int(lp.extent) for lp in loops if lp.kind == tirx.ForKind.PARALLEL]
    assert imbalance(tasks, 2) <= MAX_IMBALANCE, sch.mod["main"]


def test_injective_stage_with_a_symbolic_batch_is_parallel_and_vectorized():
    """A generic entry's copy stages (Winograd's pad, a strided 1x1 conv's subsample) have a
    symbolic batch: the stage still gets its parallel loop over batch x channels and a vector
    inner loop (it was one parallel loop over the images: serial and scalar for one image)."""
    from tvm_fusion.schedules._util import schedule_injective_block

    n = te.var("n", dtype="int64")
    x = te.placeholder((n, 16, 8, 32), name="x")
    y = te.compute(x.shape, lambda b, c, h, w: x[b, c, h, w] * 2.0, name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    schedule_injective_block(sch, sch.get_sblock("y"), ZNVER3)
    loops = collect_loops(sch.mod["main"])
    (par,) = [lp for lp in loops if lp.kind == tirx.ForKind.PARALLEL]
    assert uses_var(par.extent, n) and not isinstance(par.extent, tirx.IntImm)
    assert any(lp.kind == tirx.ForKind.VECTORIZED for lp in loops)


def test_rows_along_a_sliding_window_leave_registers_for_their_broadcasts():
    """A 1x7 conv with its micro-kernel rows along W reads ``x[c, h, w + r + kw]``: row r at step
    kw is row r+1 at kw-1, and LLVM keeps all the rows' broadcasts in registers to reuse them.
    With 6 rows x 4 vectors of output channels that is 24 accumulators + 4 weight vectors + 6
    broadcasts, more than AVX-512's 32 registers: inception_v3's 192-channel 1x7 conv at 17x17
    spilled (1.05 ms alone, 4.2 ms a model run) where rows along H, which do not slide, do not
    (0.72, 3.1). The rule now counts those registers: the micro-kernel it takes fits them (rows
    along H, or along W with fewer vectors; before: 6 rows x 4 vectors along W)."""
    w, b = _rand(192, 192, 1, 7, scale=0.1), _rand(1, 192, 1, 1)

    def body(bb, x):
        y = relax.op.nn.conv2d(x, relax.const(w), padding=(0, 3))
        return relax.op.nn.relu(bb.emit(relax.op.add(bb.emit(y), relax.const(b))))

    mod = relax_main({"x": (1, 192, 17, 17)}, body)
    with ZNVER4:
        sched = apply_default_schedules(ZNVER4)(_fused(mod))
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    sch = s_tir.Schedule(func)
    update = sch.get_sblock("conv2d_nchw_update")
    realize = get_sblock_realize(sch, update)
    unrolled = [sch.get(lp) for lp in sch.get_loops(update) if sch.get(lp).kind == tirx.ForKind.UNROLLED]
    assert len(unrolled) == 2, unrolled  # the micro-kernel: rows x vectors of output channels
    rows, vectors = (int(lp.extent) for lp in unrolled)
    block = realize.block
    (row_var,) = [
        iv.var
        for iv, value in zip(block.iter_vars, realize.iter_values)
        if uses_var(value, unrolled[0].loop_var)
    ]
    reduction_vars = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    slides = any(
        uses_var(rng.min, row_var) and any(uses_var(rng.min, rv) for rv in reduction_vars)
        for read in block.reads
        for rng in read.region
    )
    broadcasts = rows if slides else 1
    assert rows * vectors + vectors + broadcasts <= 32, (rows, vectors, slides)
    if HOST_HAS_AVX512:
        x = _rand(1, 192, 17, 17)
        np.testing.assert_allclose(
            run_relax(sched, [x], ZNVER4), _run(_fused(mod), [x]), rtol=1e-4, atol=1e-4
        )


def _micro_kernel_rows_dim(func, block_name):
    """The output dim the micro-kernel's register rows walk along: its first unrolled loop (the
    rows are unrolled outside the vectors of a tile wider than one register)."""
    sch = s_tir.Schedule(func)
    update = sch.get_sblock(block_name)
    realize = get_sblock_realize(sch, update)
    unrolled = [sch.get(lp) for lp in sch.get_loops(update) if sch.get(lp).kind == tirx.ForKind.UNROLLED]
    assert unrolled, "no register rows"
    rows = unrolled[0]
    (row_var,) = [
        iv.var
        for iv, value in zip(realize.block.iter_vars, realize.iter_values)
        if uses_var(value, rows.loop_var)
    ]
    (out,) = realize.block.writes
    return next(d for d, rng in enumerate(out.region) if uses_var(rng.min, row_var))


def test_nhwc_depthwise_conv_rows_run_along_w():
    """ConvNeXt's 7x7 depthwise convs (channels-last, lanes on channels): rows along H and along W
    cost the same in the plan model, and the tie went to H, whose rows are a whole image row apart
    in memory. Rows along W walk it contiguously: alone, 4-8 % faster at all four of ConvNeXt-T's
    shapes (96 ch at 56x56: 0.296 -> 0.284 ms), its 4x4/4 stem 0.219 -> 0.160."""
    c = 96
    w, b = _rand(c, 7, 7, 1, scale=0.1), _rand(1, 1, 1, c)

    def body(bb, x):
        y = relax.op.nn.conv2d(
            x, relax.const(w), padding=3, groups=c, data_layout="NHWC", kernel_layout="OHWI"
        )
        return relax.op.add(bb.emit(y), relax.const(b))

    mod = relax_main({"x": (1, 14, 14, c)}, body)
    sched = _check(mod, [_rand(1, 14, 14, c)], rtol=1e-4, atol=1e-4)
    (func,) = [f for n, f in _prim_funcs(sched).items() if "conv" in n]
    assert _micro_kernel_rows_dim(func, "group_conv2d_nhwc_update") == 2  # W of [N, H, W, C]
