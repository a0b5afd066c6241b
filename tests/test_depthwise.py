"""Depthwise convs (legalize/depthwise_conv.py + schedules/depthwise.py): numerics vs ONNX Runtime
over strides, odd sizes, kernel sizes and fused epilogues; the kernel's structure (one kernel with
its epilogue, padding per task, no gather); which convs take the form; the tunable space."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import HOST_HAS_AVX512, ort_run, run_executable
from tvm import relax, tirx

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import tir_stmts
from tvm_fusion.legalize.conv_args import padded_width
from tvm_fusion.legalize.depthwise_conv import STAGE
from tvm_fusion.pipeline import pipeline_passes, run_passes, unscheduled_module
from tvm_fusion.schedules import Depthwise
from tvm_fusion.schedules._util import access_class
from tvm_fusion.targets import llvm_target

ZNVER3 = llvm_target("znver3")  # AVX2 (8 lanes): the CI machine's vector width
SKYLAKE = llvm_target("skylake-avx512")  # 16 lanes: widths are padded differently


def _dw_model(channels, size, stride, kernel=3, epilogue="clip", seed=0, pads=None):
    """x -> depthwise Conv (bias, same padding unless ``pads``: ONNX's [top, left, bottom,
    right]) -> epilogue: "none", "clip" (relu6), "residual" (add a second input), "silu" or
    "bn_silu" (BatchNormalization, then SiLU)."""
    g = models.GraphBuilder("dw", seed)
    x = g.input("x", (1, channels, size, size))
    w = g.weight("dw_w", (channels, 1, kernel, kernel))
    b = g.const("dw_b", g.rng.standard_normal(channels).astype(np.float32) * 0.1)
    pads = pads or [kernel // 2] * 4
    y = g.op(
        "Conv", [x, w, b], kernel_shape=[kernel, kernel], pads=pads, strides=[stride] * 2, group=channels
    )
    out = (size + pads[0] + pads[2] - kernel) // stride + 1
    if epilogue == "clip":
        y = g.relu6(y)
    elif epilogue == "residual":
        y = g.add(y, g.input("r", (1, channels, out, out)))
    elif epilogue == "silu":
        y = g.op("Mul", [y, g.op("Sigmoid", [y])])
    elif epilogue == "bn_silu":  # EfficientNet: BN folds into a bias add that SiLU reads twice
        y = g.batch_norm(y, channels)
        y = g.op("Mul", [y, g.op("Sigmoid", [y])])
    return g.finish([y])


def _lowered(model, target=ZNVER3):
    return run_passes(import_onnx(model).mod, pipeline_passes(target), target)


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _stages(func) -> set:
    return {
        str(s.annotations[STAGE])
        for s in tir_stmts(func.body)
        if isinstance(s, tvm.s_tir.SBlock) and STAGE in s.annotations
    }


CASES = [
    # channels, size, stride, kernel, epilogue
    (8, 16, 1, 3, "clip"),
    (12, 21, 1, 3, "residual"),  # odd width: padded to whole vectors, cropped
    (16, 15, 2, 3, "clip"),  # stride 2, odd input
    (24, 28, 2, 3, "none"),  # stride 2, the conv writes the output itself
    (6, 11, 1, 5, "silu"),  # 5x5 (EfficientNet / MNASNet)
    (16, 24, 2, 3, "bn_silu"),  # an epilogue that reads the conv's result twice
    (10, 20, 2, 5, "residual"),
    (4, 9, 2, 3, "clip"),  # output 5 wide: stride 2 takes the form below MIN_WIDTH
]
GROUPED = [
    # channels in, channels out, groups, size, stride
    (48, 48, 6, 28, 2),  # RegNet: 8 channels per group
    (16, 32, 4, 13, 1),  # ResNeXt-like: 4 in, 8 out per group
    (8, 16, 8, 18, 1),  # depthwise with a channel multiplier of 2
    (3, 24, 1, 23, 2),  # an RGB stem: one group of 3 input channels
]


@pytest.mark.parametrize("target", [ZNVER3, SKYLAKE], ids=["avx2", "avx512"])
@pytest.mark.parametrize("channels,size,stride,kernel,epilogue", CASES)
def test_depthwise_matches_onnxruntime(target, channels, size, stride, kernel, epilogue):
    model = _dw_model(channels, size, stride, kernel, epilogue)
    feeds = models.random_inputs(model, seed=1)
    result = tvm_fusion.build(model, target, tuning_logs=None)
    funcs = _prim_funcs(result.lowered)
    assert any(_stages(f) for f in funcs.values()), list(funcs)  # it took the depthwise form
    # and the Depthwise rule scheduled it, epilogue included (SiLU's x * sigmoid(x) uses the
    # conv's result twice), not Contraction
    assert any(_by_depthwise_rule(f) for f in funcs.values()), list(funcs)
    if target is ZNVER3 or HOST_HAS_AVX512:
        got = run_executable(result.executable, feeds)
        ref = ort_run(model, feeds)
        assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5


def _by_depthwise_rule(func) -> bool:
    """The Depthwise rule's mark: the padded input (with a stride, its phase copy) computed inside
    the parallel task loop (other rules make it a stage of its own)."""
    parallel = [
        s for s in tir_stmts(func.body) if isinstance(s, tirx.For) and s.kind == tirx.ForKind.PARALLEL
    ]
    return any(
        isinstance(s, tvm.s_tir.SBlock) and s.name_hint.startswith(("depthwise_pad", "depthwise_phase"))
        for loop in parallel
        for s in tir_stmts(loop.body)
    )


@pytest.mark.parametrize("cin,cout,groups,size,stride", GROUPED)
def test_grouped_convs_with_narrow_groups_match_onnxruntime(cin, cout, groups, size, stride):
    g = models.GraphBuilder("grouped", 0)
    x = g.input("x", (1, cin, size, size))
    w = g.weight("w", (cout, cin // groups, 3, 3))
    b = g.const("b", g.rng.standard_normal(cout).astype(np.float32) * 0.1)
    y = g.op("Conv", [x, w, b], kernel_shape=[3, 3], pads=[1] * 4, strides=[stride] * 2, group=groups)
    model = g.finish([g.relu(y)])
    result = tvm_fusion.build(model, ZNVER3, tuning_logs=None)
    assert any(_stages(f) for f in _prim_funcs(result.lowered).values())
    feeds = models.random_inputs(model, seed=1)
    got, ref = run_executable(result.executable, feeds), ort_run(model, feeds)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5


def test_depthwise_is_one_kernel_padding_per_task_without_gathers():
    model = _dw_model(32, 56, 2, 3, "clip")
    funcs = _prim_funcs(_lowered(model))
    assert len(funcs) == 1, list(funcs)  # conv + bias + clip: one kernel
    ((_, func),) = funcs.items()
    assert {"phase", "conv"} <= _stages(func)
    stmts = list(tir_stmts(func.body))
    # one parallel loop (tasks: a channel's block of output rows) ...
    loops = [s for s in stmts if isinstance(s, tirx.For)]
    parallel = [lp for lp in loops if lp.kind == tirx.ForKind.PARALLEL]
    assert len(parallel) == 1

    # ... inside which the padded input is computed (only the rows a task reads: it stays in L1;
    # with a stride, by the phase copy)
    def pads(node):
        return [
            s
            for s in tir_stmts(node)
            if isinstance(s, tvm.s_tir.SBlock) and ("pad" in s.name_hint or "phase" in s.name_hint)
        ]

    assert pads(parallel[0].body) and len(pads(parallel[0].body)) == len(pads(func.body))
    # the conv's inner loop is a vector over output columns reading whole vectors: every load of
    # the padded input along the vectorized loop has stride 1 (the polyphase layout)
    (conv,) = [s for s in stmts if isinstance(s, tvm.s_tir.SBlock) and s.name_hint == "depthwise_conv_update"]
    column = conv.iter_vars[3].var  # (b, c, y, x | kh, kw)
    reads = [r for r in conv.reads if r.source.name.startswith("depthwise_phase")]
    assert reads and all(access_class(r, column) == "contiguous" for r in reads)
    assert any(lp.kind == tirx.ForKind.VECTORIZED for lp in loops)


@pytest.mark.parametrize(
    "size,kernel,pads",
    [(56, 3, None), (15, 3, None), (24, 5, None), (28, 3, [0, 0, 1, 1])],  # the last: no left padding
)
def test_stride_2_phase_copy_splits_off_its_padded_borders(size, kernel, pads):
    """The phase copy computes the zero padding, its column loop split into the borders and the
    interior: every column the interior copies is inside the input (no column condition left to
    mask), and it is the widest such range (each border copies at least one padded column)."""
    model = _dw_model(32, size, 2, kernel, pads=pads)
    ((_, func),) = _prim_funcs(_lowered(model)).items()
    stmts = list(tir_stmts(func.body))
    loops = {lp.loop_var.name: lp for lp in stmts if isinstance(lp, tirx.For)}
    parts = []  # the q range of each part of the phase copy
    for realize in stmts:
        if isinstance(realize, tvm.s_tir.SBlockRealize) and realize.block.annotations.get(STAGE) == "phase":
            q = loops[realize.iter_values[4].name]  # (b, c, y, r, q)
            parts.append(range(int(q.min), int(q.min) + int(q.extent)))
    parts.sort(key=lambda r: r.start)
    assert len(parts) >= 2 and [p.start for p in parts[1:]] == [p.stop for p in parts[:-1]]
    left = (pads or [kernel // 2] * 4)[1]

    def padded(q) -> bool:  # input column q * 2 + r - left outside the input, for some r
        return any(not 0 <= q * 2 + r - left < size for r in range(2))

    inside = [p for p in parts if not any(padded(q) for q in p)]
    assert len(inside) == 1 and all(any(padded(q) for q in p) for p in parts if p is not inside[0])
    assert (inside[0].start == 0 or padded(inside[0].start - 1)) and padded(inside[0].stop)
    feeds = models.random_inputs(model, seed=1)
    built = tvm_fusion.build(model, ZNVER3, tuning_logs=None)
    ref = ort_run(model, feeds)
    assert float(np.abs(run_executable(built.executable, feeds) - ref).max() / np.abs(ref).max()) <= 1e-5


def test_which_convs_take_the_depthwise_form():
    assert padded_width(56, 8) == 56 and padded_width(56, 16) == 56
    assert padded_width(28, 16) == 32 and padded_width(14, 8) == 16 and padded_width(112, 16) == 112
    # narrow stride-1 planes (7x7; 14x14 with a 3x3 window) keep TVM's conv, 5x5 windows at 14x14
    # take the form; grouped convs with wide groups keep TVM's conv
    for size, kernel, ours in ((7, 3, False), (14, 3, False), (14, 5, True), (7, 5, False)):
        stages = [_stages(f) for f in _prim_funcs(_lowered(_dw_model(64, size, 1, kernel))).values()]
        assert any(stages) == ours, (size, kernel)
    g = models.GraphBuilder("grouped", 0)
    x = g.input("x", (1, 64, 14, 14))
    y = g.op("Conv", [x, g.weight("w", (64, 32, 3, 3))], kernel_shape=[3, 3], pads=[1] * 4, group=2)
    grouped = g.finish([y])
    assert not any(_stages(f) for f in _prim_funcs(_lowered(grouped)).values())
    # ungrouped convs only as RGB stems: few input channels, stride 1 or 2, a window wider than the
    # stride (a patchifying stride-4 stem, a 1x1 conv and a 16-channel conv keep TVM's conv)
    for cin, stride, k, ours in (
        (3, 2, 3, True),
        (3, 1, 3, True),
        (3, 4, 4, False),
        (3, 1, 1, False),
        (16, 2, 3, False),
    ):
        g = models.GraphBuilder("stem", 0)
        y = g.op(
            "Conv",
            [g.input("x", (1, cin, 32, 32)), g.weight("w", (16, cin, k, k))],
            kernel_shape=[k, k],
            strides=[stride, stride],
        )
        assert any(_stages(f) for f in _prim_funcs(_lowered(g.finish([y]))).values()) == ours, (
            cin,
            stride,
            k,
        )
    # a plain LegalizeOps elsewhere in the process (stock TVM's flow) keeps TVM's conv
    with ZNVER3:
        stock = relax.transform.LegalizeOps()(import_onnx(_dw_model(32, 28, 2)).mod)
    assert not any(_stages(f) for f in _prim_funcs(stock).values())


def test_rows_of_a_wide_group_balance_input_loads_against_weight_loads():
    """A micro-kernel of r rows x c channels loads r input vectors and c weights per step for r x c
    FMAs: depthwise (one channel) takes the most rows; a stem's 64 channels, 4 rows x 4 channels."""
    from tvm_fusion.schedules.depthwise import channel_choices, row_choices

    assert row_choices(112) == [8, 7, 4, 2]
    assert row_choices(112, group_out=64, registers=32)[0] == 4
    assert channel_choices(64, 4, 32)[0] == 4
    assert row_choices(28, group_out=8, registers=32)[0] == 4  # RegNet's groups of 8


def test_rule_space_of_a_depthwise_kernel_contains_the_default():
    from tvm_fusion.tuning import extract_tasks, rule_space

    mod = unscheduled_module(import_onnx(_dw_model(32, 28, 1)).mod, ZNVER3)
    (task,) = extract_tasks(mod, ZNVER3)
    func = task.dispatched[0]["main"]
    space = rule_space(func, ZNVER3)
    assert space is not None and space.rule_type is Depthwise and set(space.names) == {"rows", "lanes"}
    default = Depthwise().apply(func, ZNVER3, False)
    at_default, effective = space.schedule(func, ZNVER3, (0,) * len(space.names))
    assert effective == (0,) * len(space.names)
    tvm.ir.assert_structural_equal(at_default.mod, default.mod)
    # another point is another schedule, and it computes the same numbers
    other, _ = space.schedule(func, ZNVER3, (1,) * len(space.names))
    assert other.mod.script() != default.mod.script()
    want, got = _outputs(func, default, other)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0


def _outputs(func, *schedules) -> list[np.ndarray]:
    """Each schedule of ``func`` run on the same random inputs (the last parameter is the output,
    zeroed)."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.shape]).astype(np.float32) for p in func.params]
    args[-1][:] = 0
    outputs = []
    for sch in schedules:
        tensors = [tvm.runtime.tensor(a) for a in args]
        tvm.compile(sch.mod, target=ZNVER3)["main"](*tensors)
        outputs.append(tensors[-1].numpy())
    return outputs


def _block_names(sch) -> set:
    return {b.name_hint for b in tir_stmts(sch.mod["main"]) if isinstance(b, tvm.s_tir.SBlock)}


def test_stride_2_space_can_compute_the_padding_in_its_own_copy():
    """With a stride the tuner also decides where the zero padding is computed: inside the phase
    copy (the default: one copy, its interior without masks) or in a copy of its own before it.
    Both compute the same numbers."""
    from tvm_fusion.tuning import extract_tasks, rule_space

    mod = unscheduled_module(import_onnx(_dw_model(32, 28, 2)).mod, ZNVER3)
    (task,) = extract_tasks(mod, ZNVER3)
    func = task.dispatched[0]["main"]
    space = rule_space(func, ZNVER3)
    assert "pad" in space.names
    point = tuple(1 if name == "pad" else 0 for name in space.names)
    own_copy, effective = space.schedule(func, ZNVER3, point)
    assert effective == point
    default = Depthwise().apply(func, ZNVER3, False)
    assert {"depthwise_pad", "depthwise_phase"} <= _block_names(own_copy)
    default_names = _block_names(default)
    assert "depthwise_pad" not in default_names
    assert any(name.startswith("depthwise_phase") for name in default_names)
    want, got = _outputs(func, default, own_copy)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0


def test_tuning_searches_the_depthwise_space_and_the_build_replays_it(tmp_path):
    """The rule's decisions are searched like Contraction's: every candidate's trace prints and
    replays (TVM 0.27's decompose_padding cannot print its trace, which aborted the search; the
    rule does not use it), and the build with the records matches ORT. The space is small: a
    time budget ends early once it is measured whole, and the summary says so."""
    from tvm_fusion import tuning

    tuning.check_environment()
    model = _dw_model(32, 28, 2, 3, "clip")
    kw = dict(log_root=tmp_path, name="dw", num_trials_per_iter=2, progress=False, check_default=False)
    res = tuning.tune_model(model, ZNVER3, trials=1_000_000, time_budget_s=600, **kw)  # --minutes 10
    (task,) = res.tasks
    (fused,) = tuning.extract_tasks(unscheduled_module(import_onnx(model).mod, ZNVER3), ZNVER3)
    space = tuning.rule_space(fused.dispatched[0]["main"], ZNVER3)
    assert task.space_exhausted and 2 <= task.trials <= space.size
    assert res.ended_early and "every task's search space is measured" in str(res)
    again = tuning.tune_model(model, ZNVER3, trials=1_000_000, time_budget_s=600, **kw)
    assert again.new_trials == 0 and "its whole space measured before" in str(again)
    built = tvm_fusion.build(model, ZNVER3, name="dw", tuning_logs=tmp_path)
    assert built.records_status == "ok"
    feeds = models.random_inputs(model, seed=1)
    got, ref = run_executable(built.executable, feeds), ort_run(model, feeds)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5


def test_stride_2_phase_copy_of_a_small_plane_has_no_gather_or_scatter():
    """The task's polyphase rows are copied in the padded row's order (phase innermost,
    unrolled). Phase-major, LLVM vectorized the short rows of a 14x14 plane (5x5 window, 10
    columns per phase) across rows with gathers and scatters: mobilenet_v3's 288x14x14 kernel
    took 0.050 ms, 0.019 ms now. (Whether the old order fails depends on LLVM's znver4 cost
    model: it did with the LLVM in apache-tvm 0.27.0.post1.)"""
    import re

    model = _dw_model(32, 14, 2, 5, "clip")
    result = tvm_fusion.build(model, llvm_target("znver4", 2), tuning_logs=None)
    assert any({"phase", "conv"} <= _stages(f) for f in _prim_funcs(result.lowered).values())
    (llvm,) = [m for m in [result.executable.mod, *result.executable.mod.imports] if m.kind == "llvm"]
    asm = llvm.inspect_source("asm")
    assert "vfmadd" in asm  # the kernel is there
    assert not re.findall(r"\b(v\w*gather\w*|v\w*scatter\w*)", asm)
    if HOST_HAS_AVX512:
        feeds = models.random_inputs(model, seed=1)
        got, ref = run_executable(result.executable, feeds), ort_run(model, feeds)
        assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5
