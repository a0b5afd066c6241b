"""RewriteLayout: move whole conv regions to the target's preferred activation layout.

Runs on high-level Relax (before LegalizeOps). Per target:

* CUDA (and other GPU kinds): ``NHWC`` activations, ``OHWI`` kernels. dlight's ``gpu.Matmul`` rule
  schedules NHWC/OHWI and NHWC/HWIO convs alike; OHWI keeps the reduction channel innermost in
  both operands (like a matmul with a transposed B), and is what stock ConvertLayout uses.
* LLVM CPU: blocked ``NCHW{b}c`` activations, ``OIHW{i}i{o}o`` kernels, with ``b`` = SIMD width /
  32 (8 on AVX2). ``tvm.target.codegen.llvm_get_vector_width`` reports 512 bits for znver3 and
  haswell in TVM 0.27 (wrong for AVX2), so on x86 the width comes from the CPU features instead.

Why not the stock passes alone (TVM 0.27):

* ``relax.transform.ConvertLayout`` handles NHWC, but it segfaults on ``NCHW8c``; and Relax's
  conv2d legalization refuses blocked layouts ("channel chunk ... cannot be legalized").
  We keep ``R.nn.conv2d`` with ``data_layout="NCHW8c"`` in the IR (struct-info inference accepts
  it) and register a legalization for it (:func:`legalize_conv2d_nchwc`), which emits our own TE
  compute for NCHWc conv (the topi ``conv2d_NCHWc`` needs a target in scope and folds the input
  channel into one reduce axis). Other layouts go to the stock legalization unchanged.
* ``relax.transform.OptimizeLayoutTransform`` cancels a pair of layout_transforms when the shapes
  match, without checking that the maps compose to the identity; we check the composition.

A conv whose channels the block size does not divide stays NCHW, with one exception: a conv with
fewer input channels than the block (an RGB stem) reads ``NCHW{Cin}c`` (a single chunk) and
writes ``NCHW{b}c``, as the x86 schedules in TVM do, so the model input needs just one transform.
Layout-agnostic ops (elementwise, per-channel broadcast against constants, pools, spatial mean)
follow their input into the new layout, so a ``layout_transform`` remains only where a region
ends (model output, reshape/flatten/matmul, unsupported ops). Constants are transformed in numpy
at compile time, so no ``layout_transform`` of a constant is ever emitted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, s_tir
from tvm.ir import Op
from tvm.sym import Analyzer
from tvm.target import codegen

from ..ir import binding_users, graph_functions, int_values, op_name, static_shape, with_functions
from ..legalize import register as register_legalizations
from ..legalize.conv_args import out_dtype
from ..targets import is_gpu, parse_target

__all__ = ["RewriteLayout", "count_layout_transforms", "choose_layout", "channels_last_model"]

_Const = tvm.ir.expr.Constant
_LT = Op.get("relax.layout_transform")
_CALL_TIR = Op.get("relax.call_tir")

_UNARY = {
    "relax.nn.relu",
    "relax.clip",
    "relax.nn.silu",
    "relax.nn.hardswish",
    "relax.nn.gelu",
    "relax.nn.gelu_tanh",
    "relax.sigmoid",
    "relax.tanh",
    "relax.exp",
    "relax.negative",
    "relax.abs",
    "relax.sqrt",
    "relax.rsqrt",
    "relax.square",
    "relax.astype",
    "relax.nn.leakyrelu",
    "relax.erf",
}
_BINARY = {
    "relax.add",
    "relax.subtract",
    "relax.multiply",
    "relax.divide",
    "relax.maximum",
    "relax.minimum",
    "relax.power",
}
_ELEMENTWISE = _UNARY | _BINARY
_POOL = {"relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"}


# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """An activation layout for NCHW tensors: ``NHWC`` (block == 0) or ``NCHW{block}c``.

    Channels-last also covers other ranks: ``[N, C1.., Ck, S1.., Ss]`` (``spatial`` = s trailing
    spatial dims, ``rank`` = 1 + k + s) as ``[N, S1.., Ss, C1.., Ck]``. That is the form a channel
    shuffle takes between its reshapes (C -> (g, C/g): k = 2), and a flattened feature map
    (``[N, C, H*W]`` before ViT's token transpose: s = 1), so they stay in the region.
    """

    block: int
    rank: int = 4
    spatial: int = 2

    @property
    def name(self) -> str:
        return "NHWC" if self.block == 0 else f"NCHW{self.block}c"

    @property
    def spatial_axes(self) -> list[int]:
        return [1, 2] if self.block == 0 else [2, 3]

    def with_rank(self, rank: int, spatial: int | None = None) -> _Layout:
        return _Layout(self.block, rank, self.spatial if spatial is None else spatial)

    def fits(self, channels: int) -> bool:
        return self.block == 0 or channels % self.block == 0

    @property
    def channels_last_axes(self) -> list[int]:
        """The permutation NCHW-form -> channels-last: ``[0, spatial.., channels..]``."""
        r, sp = self.rank, self.spatial
        return [0, *range(r - sp, r), *range(1, r - sp)]

    def axis(self, axis: int) -> int:
        """Where NCHW axis ``axis`` is in this layout (the chunk axis for C in NCHW{b}c)."""
        axis %= self.rank
        return axis if self.block else self.channels_last_axes.index(axis)

    def new_shape(self, shape) -> list[int]:
        shape = list(shape)
        if self.block == 0:
            return [shape[a] for a in self.channels_last_axes]
        n, c, h, w = shape
        return [n, c // self.block, h, w, self.block]

    def old_shape(self, shape) -> list[int]:
        shape = list(shape)
        if self.block == 0:
            old = [0] * self.rank
            for pos, a in enumerate(self.channels_last_axes):
                old[a] = shape[pos]
            return old
        n, co, h, w, ci = shape
        return [n, co * ci, h, w]

    def is_reshape(self, shape) -> bool:
        """Whether the transform of an NCHW ``shape`` only moves unit dims (a free reshape)."""
        r, sp = self.rank, self.spatial
        spatial = int(np.prod(shape[r - sp :]))
        return spatial == 1 or (self.block == 0 and int(np.prod(shape[1 : r - sp])) == 1)

    def to_map(self) -> tvm.tirx.IndexMap:
        b, r = self.block, self.rank
        if b == 0:
            axes = self.channels_last_axes
            return tvm.tirx.IndexMap.from_func(lambda *i: tuple(i[a] for a in axes), ndim=r)
        return tvm.tirx.IndexMap.from_func(lambda n, c, h, w: (n, c // b, h, w, c % b))

    def from_map(self) -> tvm.tirx.IndexMap:
        b, r = self.block, self.rank
        if b == 0:
            back = [self.channels_last_axes.index(a) for a in range(r)]
            return tvm.tirx.IndexMap.from_func(lambda *j: tuple(j[p] for p in back), ndim=r)
        return tvm.tirx.IndexMap.from_func(lambda n, co, h, w, ci: (n, co * b + ci, h, w))

    def np_act(self, arr: np.ndarray) -> np.ndarray:
        """Transform a 4-D NCHW array whose C dim is 1 or divisible by the block (broadcast ok)."""
        if self.block == 0:
            return np.ascontiguousarray(arr.transpose(0, 2, 3, 1))
        n, c, h, w = arr.shape
        if c == 1:
            return np.ascontiguousarray(arr.reshape(n, 1, h, w, 1))
        b = self.block
        return np.ascontiguousarray(arr.reshape(n, c // b, b, h, w).transpose(0, 1, 3, 4, 2))


def _parse_layout(layout) -> _Layout | None:
    if layout is None:
        return None
    if isinstance(layout, _Layout):
        return layout
    text = str(layout).strip()
    if text == "NHWC":
        return _Layout(0)
    m = re.fullmatch(r"NCHW(\d+)c", text)
    if m and int(m.group(1)) > 0:
        return _Layout(int(m.group(1)))
    raise ValueError(
        f"RewriteLayout: unsupported layout {layout!r}; use 'NHWC', 'NCHW<n>c', 'NCHW', 'as-model', 'auto' or None"
    )


def _cpu_block(target: tvm.target.Target) -> int:
    """fp32 lanes of the widest SIMD register the CPU has."""

    def has(feature):
        try:
            return bool(codegen.target_has_features(feature, target))
        except Exception:
            return False

    if has("avx512f"):
        return 16
    if has("avx") or has("avx2"):
        return 8
    if has("sse2"):
        return 4
    try:
        bits = int(codegen.llvm_get_vector_width(target))
    except Exception:
        bits = -1
    return max(bits // 32, 4) if bits > 0 else 4


# Layout value: the model's own. NCHW, or NHWC where most of the model's convs are channels-last
# between permutes of its own (see channels_last_model).
AS_MODEL = "as-model"
_TO_NHWC, _TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
_MAX_ELEMENTWISE_HOPS = 3  # elementwise ops between a conv and the model's permute


def channels_last_model(mod: tvm.IRModule) -> bool:
    """Whether most (more than half) of the model's ``relax.nn.conv2d`` calls read a tensor the
    model permuted from NHWC, or write one it permutes to NHWC (through up to
    ``_MAX_ELEMENTWISE_HOPS`` elementwise ops; the bindings of its graph functions' blocks, not of
    nested ``If`` branches): ConvNeXt's blocks (depthwise conv -> permute -> LayerNorm, MLP ->
    permute back -> scale, residual add; 18 of its 22 convs, the others its patchify stem and
    downsampling convs) and Swin's patch embedding (its one conv). NCHW there costs two
    transposes per block; in NHWC the model's own permutes are the identity (ConvNeXt-T: 106 -> 84
    kernels, 3.4 % faster in one process; its depthwise convs too are faster channels-last).
    The choice is for the whole model, and in NHWC the convs lose the NCHW-only CPU lowerings
    (Winograd, the depthwise and strided 1x1 forms, PadConvChannels), hence a majority of convs,
    not any: FocalNet (12 of 40 convs next to its permutes; 1.009x slower in NHWC) and PVT (3 of
    10) stay NCHW, as every conv net without such permutes does (MobileNetV2 in NHWC: 1.12x)."""
    counts = [_channels_last_convs(func) for _, func in graph_functions(mod)]
    convs, adjacent = sum(c for c, _ in counts), sum(a for _, a in counts)
    return 2 * adjacent > convs


def _channels_last_convs(func: relax.Function) -> tuple[int, int]:
    """(2-D convs, those next to one of the model's NCHW <-> NHWC permutes) in ``func``."""
    values = relax.analysis.get_var2val(func)
    users = binding_users(func)

    def permute_axes(value):
        if op_name(value) != "relax.permute_dims" or value.attrs.axes is None:
            return None
        return [int(a) for a in value.attrs.axes]

    def elementwise(value):
        return op_name(value) in _ELEMENTWISE

    def from_nhwc(var, hops=_MAX_ELEMENTWISE_HOPS) -> bool:
        value = values.get(var)
        if value is None:
            return False
        if permute_axes(value) == _TO_NCHW:
            return True
        return (
            hops > 0
            and elementwise(value)
            and any(isinstance(arg, relax.Var) and from_nhwc(arg, hops - 1) for arg in value.args)
        )

    def to_nhwc(var, hops=_MAX_ELEMENTWISE_HOPS) -> bool:
        for user in users.get(var, []):
            value = values[user]
            if permute_axes(value) == _TO_NHWC:
                return True
            if hops > 0 and elementwise(value) and to_nhwc(user, hops - 1):
                return True
        return False

    convs = [(var, value) for var, value in values.items() if op_name(value) == "relax.nn.conv2d"]
    adjacent = sum(1 for var, value in convs if from_nhwc(value.args[0]) or to_nhwc(var))
    return len(convs), adjacent


def choose_layout(target=None, layout="auto", mod: tvm.IRModule | None = None) -> str:
    """The activation layout RewriteLayout uses: 'NHWC', 'NCHW<b>c' or 'NCHW' (no change).
    ``layout="as-model"`` decides by ``mod`` (see :func:`channels_last_model`)."""
    if layout == AS_MODEL:
        if mod is None:
            raise ValueError("RewriteLayout: layout 'as-model' is decided by the module: pass mod")
        return "NHWC" if channels_last_model(mod) else "NCHW"
    if layout not in (None, "auto"):
        return "NCHW" if str(layout) == "NCHW" else _parse_layout(layout).name
    if target is None:
        target = tvm.target.Target.current(allow_none=True)
    target = parse_target("llvm" if target is None else target)
    if is_gpu(target):
        return "NHWC"
    if target.kind.name == "llvm":
        return f"NCHW{_cpu_block(target)}c"
    return "NCHW"


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _analyzer():
    return Analyzer()


def _is_identity_pair(inner: relax.Call, outer: relax.Call) -> bool:
    """outer(inner(x)) == x: same shape before and after and the index maps compose to identity."""
    if inner.attrs.pad_value is not None or outer.attrs.pad_value is not None:
        return False
    src, dst = static_shape(inner.args[0]), static_shape(outer)
    if src is None or dst is None or src != dst:
        return False
    m1, m2 = inner.attrs.index_map, outer.attrs.index_map
    if len(m1.initial_indices) != len(src):
        return False
    analyzer = _analyzer()
    idx = []
    for i, extent in enumerate(src):
        v = tvm.tirx.Var(f"i{i}", "int64")
        analyzer.bind(v, tvm.ir.Range(0, extent))
        idx.append(v)
    try:
        mid = m1.map_indices(idx, analyzer)
        final = m2.map_indices(mid, analyzer)
    except Exception:
        return False
    if len(final) != len(idx):
        return False
    return all(analyzer.can_prove_equal(f, v) for f, v in zip(final, idx))


def _elementwise_block(func: tvm.tirx.PrimFunc):
    """(schedule, block) if ``func`` is one spatial block that reads same-index or scalar buffers."""
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:
        return None
    if len(blocks) != 1:
        return None
    block = sch.get(blocks[0])
    if any(int(iv.iter_type) != 0 for iv in block.iter_vars):  # 0 == kDataPar
        return None
    ivars = [iv.var for iv in block.iter_vars]

    def same_index(region) -> bool:
        if len(region.region) == 0:
            return True
        if len(region.region) != len(ivars):
            return False
        return all(
            isinstance(r.min, tvm.tirx.Var) and r.min.same_as(v) and int(r.extent) == 1
            for r, v in zip(region.region, ivars)
        )

    if len(block.writes) != 1 or len(block.writes[0].region) != len(ivars) or not same_index(block.writes[0]):
        return None
    if not all(same_index(r) for r in block.reads):
        return None
    return sch, blocks[0]


# ------------------------------------------------------------------------------------------------
# the rewriter
# ------------------------------------------------------------------------------------------------
@relax.expr_functor.mutator
class _LayoutRewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, layout: _Layout):
        super().__init__(mod)
        self.mod_ = mod
        self.layout = layout
        self.elementwise_funcs = {}  # (gvar, layout) -> relayouted PrimFunc's gvar
        self._reset()

    def _reset(self):
        self.native = {}  # original var -> (layout, var in that layout); tuple vars: (layout, tuple)
        self.cache = {}  # (original var, layout or None for NCHW) -> converted var
        self.adopted = set()  # vars whose NCHW form is the model's own permute_dims of a plain tensor

    # -- plumbing -----------------------------------------------------------------------------
    def visit_dataflow_block_(self, block):
        self._reset()  # DataflowVars do not outlive their block
        return super().visit_dataflow_block_(block)

    def _nchw(self, var):
        """The NCHW version of an original var (emits the transform back if needed)."""
        if var not in self.native:
            return self.visit_expr(var)
        key = (var, None)
        if key not in self.cache:
            lay, lv = self.native[var]
            if isinstance(lv.ty, relax.TupleType):  # a split: each part back to NCHW
                parts = [
                    self._back(lay, self.builder_.emit(relax.TupleGetItem(lv, i)))
                    for i in range(len(lv.ty.fields))
                ]
                self.cache[key] = self.builder_.emit(relax.Tuple(parts))
            elif var in self.adopted:  # the model's own permute, re-emitted where NCHW is needed
                self.cache[key] = self.builder_.emit(relax.op.permute_dims(lv, [0, 3, 1, 2]))
            else:
                self.cache[key] = self._back(lay, lv)
        return self.cache[key]

    def _back(self, lay: _Layout, lv):
        """``lv`` (in ``lay``) as NCHW: a layout_transform, or a reshape when only unit dims move."""
        shape = static_shape(lv)
        if shape is not None and lay.is_reshape(lay.old_shape(shape)):
            return self.builder_.emit(relax.op.reshape(lv, lay.old_shape(shape)))
        return self.builder_.emit(relax.op.layout_transform(lv, lay.from_map()))

    def _in(self, expr, lay: _Layout):
        """``expr`` (an original var, 4-D NCHW) in layout ``lay``."""
        if isinstance(expr, relax.Var) and expr in self.native and self.native[expr][0] == lay:
            return self.native[expr][1]
        if isinstance(expr, _Const):
            return relax.const(lay.np_act(expr.value.numpy()))
        key = (expr, lay)
        if key not in self.cache:
            src = self._nchw(expr) if isinstance(expr, relax.Var) else self.visit_expr(expr)
            shape = static_shape(src)
            if shape is not None and lay.is_reshape(shape):
                self.cache[key] = self.builder_.emit(relax.op.reshape(src, lay.new_shape(shape)))
            else:
                self.cache[key] = self.builder_.emit(relax.op.layout_transform(src, lay.to_map()))
        return self.cache[key]

    def _native_layout(self, expr):
        if isinstance(expr, relax.Var) and expr in self.native:
            return self.native[expr][0]
        return None

    # -- bindings -----------------------------------------------------------------------------
    def visit_var_binding_(self, binding):
        var, value = binding.var, binding.value
        self._current_var = var
        converted = None
        if self.builder_.current_block_is_dataflow() and isinstance(value, relax.Call):
            try:
                converted = self._convert(value)
            except _Skip:
                converted = None
        elif (
            self.builder_.current_block_is_dataflow()
            and isinstance(value, relax.TupleGetItem)
            and value.tuple_value in self.native
        ):
            lay, tup = self.native[value.tuple_value]
            converted = lay, relax.TupleGetItem(tup, value.index)
        if converted is not None and converted[0] is None:
            # a plain (layout-free) result computed from the native tensor: permute_dims(x,
            # [0, 2, 3, 1]) of NHWC x is x itself; a spatial mean without keepdims is [N, C]
            if isinstance(var, relax.DataflowVar):
                self.set_var_remap(var, self._bind(converted[1], var))
            else:
                self.set_var_remap(var, self.builder_.emit_output(converted[1], name_hint=var.name))
            return
        if converted is not None:
            lay, expr = converted
            if isinstance(var, relax.DataflowVar):
                self.native[var] = (lay, self._bind(expr, var))
            else:  # block output: used outside the dataflow block, so hand back NCHW
                new = self._bind(expr, var)
                self.native[var] = (lay, new)
                if isinstance(new.ty, relax.TupleType) or var in self.adopted:
                    back = self._nchw(var)
                else:
                    shape = static_shape(new)
                    if shape is not None and lay.is_reshape(lay.old_shape(shape)):
                        back = relax.op.reshape(new, lay.old_shape(shape))
                    else:
                        back = relax.op.layout_transform(new, lay.from_map())
                out = self.builder_.emit_output(back, name_hint=var.name)
                self.cache[(var, None)] = out
                self.set_var_remap(var, out)
            return
        # unconverted op: every converted input goes back to NCHW first
        for fv in relax.analysis.free_vars(value):
            if fv in self.native:
                self.set_var_remap(fv, self._nchw(fv))
        super().visit_var_binding_(binding)

    def _bind(self, expr, var):
        """``expr`` bound to a new dataflow var named after ``var``, or ``expr`` itself when it is a
        var already (a permute the layout makes the identity): no ``var = x`` binding, which the
        planner (extending a group only by readers of its last op's var) would stop at."""
        return expr if isinstance(expr, relax.Var) else self.builder_.emit(expr, name_hint=var.name)

    def _convert(self, call: relax.Call):
        """(layout, new expr) if ``call`` runs in the target layout, else None."""
        name = op_name(call)
        out_shape = static_shape(call)
        if name == "relax.nn.conv2d":
            return self._conv2d(call)
        if name == "relax.layout_transform":
            return None
        if call.op.same_as(_CALL_TIR):
            return self._call_tir(call, out_shape)
        if name == "relax.concat":
            return self._concat(call, out_shape)
        if name == "relax.split":
            return self._split(call)
        if name == "relax.reshape":
            return self._reshape(call, out_shape)
        if name == "relax.permute_dims":
            return self._permute_dims(call, out_shape)
        if name == "relax.strided_slice":
            return self._strided_slice(call, out_shape)
        if name in ("relax.mean", "relax.sum", "relax.max", "relax.min"):
            lay = self._native_layout(call.args[0])
            if lay is None or lay != _Layout(lay.block) or call.attrs.axis is None:
                return None
            axes = sorted(int(a) % 4 for a in call.attrs.axis)
            if axes != [2, 3]:
                return None
            fn = {
                "relax.mean": relax.op.mean,
                "relax.sum": relax.op.sum,
                "relax.max": relax.op.max,
                "relax.min": relax.op.min,
            }[name]
            if bool(call.attrs.keepdims):
                return lay, fn(self._in(call.args[0], lay), axis=lay.spatial_axes, keepdims=True)
            # [N, C] in any layout: NHWC reduces to it directly, NCHW{b}c to [N, C/b, b]
            pooled = fn(self._in(call.args[0], lay), axis=lay.spatial_axes, keepdims=False)
            if lay.block:
                pooled = relax.op.reshape(self.builder_.emit(pooled), out_shape)
            return None, pooled
        if name == "relax.nn.group_norm":
            return self._group_norm(call)
        if out_shape is None or len(out_shape) != 4:
            return None
        if name in _UNARY:
            lay = self._native_layout(call.args[0])
            if lay is None or not lay.fits(out_shape[1]):
                return None
            rest = [self.visit_expr(a) for a in call.args[1:]]
            return lay, relax.Call(call.op, [self._in(call.args[0], lay)] + rest, call.attrs)
        if name in _BINARY:
            return self._binary(call, out_shape)
        if name == "relax.image.resize2d":
            return self._resize2d(call)
        if name in _POOL:
            lay = self._native_layout(call.args[0])
            if (
                lay is None
                or lay != _Layout(lay.block)
                or str(call.attrs.layout) != "NCHW"
                or str(call.attrs.out_layout) != "NCHW"
            ):
                return None
            fn = {
                "relax.nn.max_pool2d": relax.op.nn.max_pool2d,
                "relax.nn.avg_pool2d": relax.op.nn.avg_pool2d,
                "relax.nn.adaptive_avg_pool2d": relax.op.nn.adaptive_avg_pool2d,
            }[name]
            x = self._in(call.args[0], lay)
            if name == "relax.nn.adaptive_avg_pool2d":
                osize = call.attrs.output_size
                return lay, fn(
                    x,
                    output_size=None if osize is None else [int(v) for v in osize],
                    layout=lay.name,
                    out_layout=lay.name,
                )
            kw = dict(
                pool_size=[int(v) for v in call.attrs.pool_size],
                strides=[int(v) for v in call.attrs.strides],
                padding=[int(v) for v in call.attrs.padding],
                dilation=[int(v) for v in call.attrs.dilation],
                ceil_mode=bool(call.attrs.ceil_mode),
                layout=lay.name,
                out_layout=lay.name,
            )
            if name == "relax.nn.avg_pool2d":
                kw["count_include_pad"] = bool(call.attrs.count_include_pad)
            return lay, fn(x, **kw)
        return None

    def _resize2d(self, call):
        """NHWC resize (SegFormer's decode head upsamples each stage before a concat and a conv);
        TOPI's resize2d takes the layout as an attribute."""
        lay = self._native_layout(call.args[0])
        a = call.attrs
        if lay is None or lay != _Layout(0) or str(a.layout) != "NCHW":
            return None
        return lay, relax.op.image.resize2d(
            self._in(call.args[0], lay),
            self.visit_expr(call.args[1]),
            roi=[float(v) for v in a.roi],
            layout="NHWC",
            method=str(a.method),
            coordinate_transformation_mode=str(a.coordinate_transformation_mode),
            rounding_method=str(a.rounding_method),
            cubic_alpha=float(a.cubic_alpha),
            cubic_exclude=int(a.cubic_exclude),
            extrapolation_value=float(a.extrapolation_value),
            out_dtype=a.out_dtype if a.out_dtype is not None and str(a.out_dtype) else None,
        )

    def _group_norm(self, call):
        """Channels-last group norm: the same groups of consecutive channels, found on the last
        axis (NCHW{b}c would split a group over two axes: not converted)."""
        lay = self._native_layout(call.args[0])
        a = call.attrs
        rank = lay.rank if lay is not None else 0
        if lay is None or lay.block or lay.spatial != rank - 2 or int(a.channel_axis) % rank != 1:
            return None
        if sorted(int(v) % rank for v in a.axes) != list(range(2, rank)):
            return None
        gamma, beta = (self.visit_expr(v) for v in call.args[1:])
        return lay, relax.op.nn.group_norm(
            self._in(call.args[0], lay),
            gamma,
            beta,
            num_groups=int(a.num_groups),
            channel_axis=rank - 1,
            axes=list(range(1, rank - 1)),
            epsilon=float(a.epsilon),
            center=bool(a.center),
            scale=bool(a.scale),
        )

    def _conv2d(self, call):
        a = call.attrs
        if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCHW", "OIHW", "NCHW"):
            return None
        data, weight = call.args
        if not isinstance(weight, _Const):
            return None
        dshape, oshape, wshape = (
            static_shape(data),
            static_shape(call),
            [int(x) for x in weight.value.shape],
        )
        if dshape is None or oshape is None:
            return None
        cin, cout, groups = dshape[1], oshape[1], int(a.groups)
        w = weight.value.numpy()
        lay = self.layout
        common = dict(
            strides=[int(x) for x in a.strides],
            padding=[int(x) for x in a.padding],
            dilation=[int(x) for x in a.dilation],
            groups=groups,
            out_dtype=out_dtype(a),
        )
        if lay.block == 0:
            new_w = relax.const(np.ascontiguousarray(w.transpose(0, 2, 3, 1)))
            x = self._in(data, lay)
            return lay, relax.op.nn.conv2d(
                x, new_w, data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC", **common
            )
        b = lay.block
        depthwise = groups > 1 and groups == cin == cout and wshape[1] == 1
        if groups != 1 and not depthwise:
            return None  # grouped (non-depthwise) conv: stays NCHW
        if cout % b:
            return None  # the block does not divide the output channels: stays NCHW
        if depthwise:
            ib = 1
            in_lay = lay
            ob = b
            # (C, 1, kh, kw) -> (C/b, 1, kh, kw, 1, b)
            new_w = w.reshape(cout // b, b, 1, 1, wshape[2], wshape[3]).transpose(0, 2, 4, 5, 3, 1)
            klayout = f"OIHW1i{b}o"
        else:
            if cin % b == 0:
                ib, in_lay = b, lay
            elif cin < b and self._native_layout(data) is None:
                ib, in_lay = cin, _Layout(cin)  # small-channel stem: one input chunk
            else:
                return None
            ob = b
            new_w = w.reshape(cout // ob, ob, cin // ib, ib, wshape[2], wshape[3]).transpose(0, 2, 4, 5, 3, 1)
            klayout = f"OIHW{ib}i{ob}o"
        x = self._in(data, in_lay)
        new_w = relax.const(np.ascontiguousarray(new_w))
        return lay, relax.op.nn.conv2d(
            x, new_w, data_layout=in_lay.name, kernel_layout=klayout, out_layout=lay.name, **common
        )

    def _binary(self, call, out_shape):
        lay = None
        for arg in call.args:
            lay = lay or self._native_layout(arg)
        if lay is None or not lay.fits(out_shape[1]) or lay != _Layout(lay.block):
            return None  # (4-D NCHW-form operands only: constants are transformed as such)
        new_args = []
        for arg in call.args:
            shape = static_shape(arg)
            if shape is None:
                return None
            if len(shape) == 0 or shape == (1,):
                new_args.append(self.visit_expr(arg) if not isinstance(arg, _Const) else arg)
            elif isinstance(arg, _Const):
                if len(shape) > 4:
                    return None
                arr = arg.value.numpy().reshape((1,) * (4 - len(shape)) + shape)
                if arr.shape[1] not in (1, out_shape[1]):
                    return None
                new_args.append(relax.const(lay.np_act(arr)))
            elif isinstance(arg, relax.Var) and len(shape) == 4 and shape[1] == out_shape[1]:
                if self._native_layout(arg) not in (None, lay) and shape != out_shape:
                    return None
                new_args.append(self._in(arg, lay))
            else:
                return None
        return lay, relax.Call(call.op, new_args, call.attrs)

    # -- ops that move data between channels: concat, split, slice, channel shuffle -----------
    def _channel_ok(self, lay: _Layout, axis: int, sizes) -> bool:
        """NCHW{b}c keeps a cut along C only where it falls on a block boundary."""
        return lay.block == 0 or axis % 4 != 1 or all(int(n) % lay.block == 0 for n in sizes)

    def _concat(self, call, out_shape):
        fields = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
        if not fields or out_shape is None or call.attrs.axis is None:
            return None
        lay = next((self._native_layout(f) for f in fields if self._native_layout(f) is not None), None)
        shapes = [static_shape(f) for f in fields]
        if lay is None or any(s is None or len(s) != lay.rank for s in shapes):
            return None
        axis = int(call.attrs.axis) % lay.rank
        if lay != _Layout(lay.block) and any(self._native_layout(f) != lay for f in fields):
            return None
        if not self._channel_ok(lay, axis, [s[axis] for s in shapes]):
            return None
        parts = [self._in(f, lay) for f in fields]
        return lay, relax.op.concat(parts, axis=lay.axis(axis))

    def _split(self, call):
        lay = self._native_layout(call.args[0])
        shape = static_shape(call.args[0])
        if lay is None or shape is None:
            return None
        axis = int(call.attrs.axis) % lay.rank
        sections = call.attrs.indices_or_sections
        if isinstance(sections, tvm.tirx.IntImm | int):
            n = int(sections)
            if not self._channel_ok(lay, axis, [shape[axis] // n]):
                return None
            new_sections = n
        else:
            cuts = [int(i) for i in sections]
            if not self._channel_ok(lay, axis, cuts):
                return None
            step = lay.block if (lay.block and axis == 1) else 1
            new_sections = [c // step for c in cuts]
        return lay, relax.op.split(self._in(call.args[0], lay), new_sections, axis=lay.axis(axis))

    def _strided_slice(self, call, out_shape):
        lay = self._native_layout(call.args[0])
        if lay is None or out_shape is None or len(call.args) != 5:
            return None
        if not all(
            isinstance(a, relax.Tuple | relax.ShapeExpr) or hasattr(a, "values") for a in call.args[1:4]
        ):
            return None
        try:
            axes = [int(a) % lay.rank for a in int_values(call.args[1])]
            begin, end = int_values(call.args[2]), int_values(call.args[3])
            strides = int_values(call.args[4]) if call.args[4] is not None else [1] * len(axes)
        except (TypeError, ValueError, AttributeError):
            return None
        shape = static_shape(call.args[0])
        for ax, b0, e0, st in zip(axes, begin, end, strides):
            if lay.block and ax == 1:
                e0 = min(e0, shape[1])
                if st != 1 or b0 % lay.block or e0 % lay.block:
                    return None
        new_axes, new_begin, new_end = [], [], []
        for ax, b0, e0 in zip(axes, begin, end):
            step = lay.block if (lay.block and ax == 1) else 1
            new_axes.append(lay.axis(ax))
            new_begin.append(b0 // step)
            new_end.append(min(e0, shape[ax]) // step)
        return lay, relax.op.strided_slice(
            self._in(call.args[0], lay),
            new_axes,
            new_begin,
            new_end,
            strides,
            bool(call.attrs.assume_inbound),
        )

    def _reshape(self, call, out_shape):
        """Channels-last reshapes: among the channel dims (N and the spatial dims kept), or the
        spatial dims merged into one (``[N, C, H, W] -> [N, C, H*W]``)."""
        lay = self._native_layout(call.args[0])
        shape = static_shape(call.args[0])
        if lay is None and self.layout.block == 0:
            return self._tokens_as_image(call, out_shape)
        if lay is None or lay.block or shape is None or out_shape is None or len(out_shape) < 3:
            return None
        sp, r = lay.spatial, lay.rank
        x = self._in(call.args[0], lay)
        if shape[0] == out_shape[0] and shape[-sp:] == out_shape[-sp:] and len(out_shape) > sp + 1:
            new = lay.with_rank(len(out_shape))
            return new, relax.op.reshape(x, new.new_shape(out_shape))
        channels = shape[1 : r - sp]
        if out_shape[:-1] == shape[: r - sp] and out_shape[-1] == int(np.prod(shape[r - sp :])):
            new = lay.with_rank(len(out_shape), spatial=1)
            return new, relax.op.reshape(x, [shape[0], out_shape[-1], *channels])
        return None

    def _tokens_as_image(self, call, out_shape):
        """``reshape(permute_dims(t, [0, 2, 1]), [N, C, H, W])`` of tokens ``t`` ``[N, H*W, C]``
        (SegFormer: a transformer stage handing its tokens to a conv): in NHWC that
        is ``reshape(t, [N, H, W, C])``, no data moved. Adopted like the model's own permutes."""
        source = self.visit_expr(call.args[0])
        permute = self.lookup_binding(source) if isinstance(source, relax.Var) else None
        if op_name(permute) != "relax.permute_dims" or permute.attrs.axes is None:
            return None
        tokens = permute.args[0]
        shape = static_shape(tokens)
        if [int(a) for a in permute.attrs.axes] != [0, 2, 1] or shape is None or len(shape) != 3:
            return None
        if out_shape is None or len(out_shape) != 4 or list(out_shape[:2]) != [shape[0], shape[2]]:
            return None
        n, c, h, w = out_shape
        self.adopted.add(self._current_var)
        return self.layout, relax.op.reshape(tokens, [n, h, w, c])

    def _permute_dims(self, call, out_shape):
        x = call.args[0]
        lay = self._native_layout(x)
        shape = static_shape(x)
        if shape is None or out_shape is None or call.attrs.axes is None:
            return None
        axes = [int(a) for a in call.attrs.axes]
        if lay is None:
            # the model's own NHWC -> NCHW permute of a plain tensor: NHWC native is that tensor
            if self.layout.block == 0 and axes == [0, 3, 1, 2] and isinstance(x, relax.Var):
                self.adopted.add(self._current_var)
                return self.layout, self.visit_expr(x)
            return None
        if lay.block:
            return None
        if axes == lay.channels_last_axes:
            # NCHW -> NHWC (ConvNeXt), [N, C, L] -> [N, L, C] (ViT's tokens): the native tensor
            return None, self._in(x, lay)
        r, sp = lay.rank, lay.spatial
        if axes[0] == 0 and axes[r - sp :] == list(range(r - sp, r)):
            # channels among themselves: the same permutation of the trailing channel dims
            inner = [sp + a for a in axes[1 : r - sp]]
            return lay, relax.op.permute_dims(self._in(x, lay), [0, *range(1, sp + 1), *inner])
        return None

    def _call_tir(self, call, out_shape):
        """call_tir to an elementwise PrimFunc (e.g. the ONNX importer's Clip): relayout its buffers."""
        gvar, args = call.args[0], call.args[1]
        if (
            not isinstance(args, relax.Tuple)
            or len(call.args) != 2
            or out_shape is None
            or len(out_shape) != 4
        ):
            return None
        lay = None
        for arg in args.fields:
            lay = lay or self._native_layout(arg)
        if lay is None or not lay.fits(out_shape[1]) or lay != _Layout(lay.block):
            return None  # (4-D NCHW-form operands only: constants are transformed as such)
        shapes = [static_shape(a) for a in args.fields]
        if any(s is None or (s != out_shape and len(s) != 0) for s in shapes):
            return None
        key = (gvar, lay)
        if key not in self.elementwise_funcs:
            func = self.mod_[gvar]
            if not isinstance(func, tvm.tirx.PrimFunc) or len(func.params) != len(args.fields) + 1:
                return None
            found = _elementwise_block(func)
            if found is None:
                return None
            sch, block = found
            try:
                # iteration space first, then buffers: indices come out as plain iter vars, so
                # AnnotateTIROpPattern still sees an elementwise op (fusable into the conv)
                sch.transform_block_layout(block, lay.to_map())
                for i, shp in enumerate(shapes):
                    if len(shp):
                        sch.transform_layout(block, ("read", _read_index(sch, block, func, i)), lay.to_map())
                sch.transform_layout(block, ("write", 0), lay.to_map())
            except Exception:
                return None
            new_mod = sch.mod
            new_func = new_mod["main"]
            self.elementwise_funcs[key] = self.builder_.add_func(new_func, gvar.name_hint + "_" + lay.name)
        new_gv = self.elementwise_funcs[key]
        new_args = [self._in(a, lay) if len(s) else self.visit_expr(a) for a, s in zip(args.fields, shapes)]
        out_sinfo = relax.TensorType(lay.new_shape(out_shape), call.ty.dtype)
        return lay, relax.call_tir(new_gv, new_args, out_sinfo)


class _Skip(Exception):
    pass


def _read_index(sch, block_rv, func, param_index) -> int:
    """Index in the block's read list of the buffer bound to ``func.params[param_index]``."""
    param = func.params[param_index]
    buffer_map = getattr(func, "buffer_map", None)  # TVM < 0.27: params are handles
    buf = buffer_map[param] if buffer_map is not None else param
    block = sch.get(block_rv)
    for i, region in enumerate(block.reads):
        src = getattr(region, "source", None)
        if src is None:
            src = getattr(region, "buffer", None)
        if src is not None and (src.same_as(buf) or str(src.name) == str(buf.name)):
            return i
    raise _Skip()


# ------------------------------------------------------------------------------------------------
# cleanup: cancel identity pairs, fold transforms of constants
# ------------------------------------------------------------------------------------------------
@relax.expr_functor.mutator
class _TransformCleaner(relax.PyExprMutator):
    """Cancel ``layout_transform(layout_transform(x, A), A^-1)`` and fold transforms of constants."""

    def __init__(self, mod):
        super().__init__(mod)
        self.changed = 0

    def _value_of(self, expr):
        for _ in range(8):  # follow var aliases
            if not isinstance(expr, relax.Var):
                break
            bound = self.lookup_binding(expr)
            if bound is None:
                break
            expr = bound
        return expr

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, Op) or not call.op.same_as(_LT):
            return call
        src = call.args[0]
        inner = self._value_of(src)
        if isinstance(inner, relax.Call) and inner.op.same_as(_LT) and _is_identity_pair(inner, call):
            self.changed += 1
            return inner.args[0]
        if isinstance(inner, _Const) and call.attrs.pad_value is None:
            try:
                arr = call.attrs.index_map.map_tensor(inner.value)
            except Exception:
                return call
            self.changed += 1
            return relax.const(arr.numpy())
        return call


def _cleanup(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` (not changed in place) with identity pairs cancelled and transforms of constants
    folded; a cancelled pair's var, left bound to its source (``y = x``), is resolved too, so its
    readers read the source (the planner extends a group only by readers of its last op's var)."""
    cleaned = False
    for _ in range(4):  # pairs can nest (A B B^-1 A^-1)
        updates = {}
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                cleaner = _TransformCleaner(mod)
                new_func = cleaner.visit_expr(func)
                if cleaner.changed:
                    updates[gv] = relax.analysis.remove_all_unused(new_func)
        if not updates:
            break
        mod, cleaned = with_functions(mod, updates), True
    return relax.transform.CanonicalizeBindings()(mod) if cleaned else mod


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
@tvm.transform.module_pass(opt_level=0, name="RewriteLayout")
class RewriteLayout:
    """Rewrite conv regions into the target's layout (NHWC on GPUs, NCHW{b}c on LLVM CPUs).

    Parameters
    ----------
    target : Target | str | dict | None
        Picks the layout when ``layout`` is None (else ``Target.current()``, else the host CPU).
    layout : str | None
        Overrides the choice: ``"NHWC"``, ``"NCHW8c"`` (any block), ``"NCHW"`` (only cancel
        redundant transforms), ``"as-model"`` (NHWC for a model whose convs are channels-last
        between its own permutes, else NCHW: :func:`channels_last_model`).
    """

    def __init__(self, target=None, layout=None):
        self.target = target
        self.layout = layout

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        register_legalizations()  # the NCHW{c} convs this writes need our conv2d lowering
        mod = _cleanup(mod)
        chosen = choose_layout(self.target, "auto" if self.layout is None else self.layout, mod)
        if chosen == "NCHW":
            return mod
        lay = _parse_layout(chosen)
        rewriter = _LayoutRewriter(mod, lay)
        for gv, func in list(graph_functions(mod)):
            new_func = rewriter.visit_expr(func)
            rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(new_func))
        mod = rewriter.builder_.get()
        mod = relax.transform.DeadCodeElimination()(mod)
        return _cleanup(mod)


def count_layout_transforms(mod: tvm.IRModule, include_permute_dims: bool = False) -> int:
    """Number of layout transforms in the Relax functions of ``mod``.

    Counts ``R.layout_transform`` calls and, after legalization, ``call_tir`` to PrimFuncs that
    are layout transforms (named ``*layout_transform*`` or with ``operator_name`` saying so).
    ``include_permute_dims`` also counts ``R.permute_dims`` of 4-D and 5-D tensors, which is how
    stock ``ConvertLayout`` spells NCHW<->NHWC (for comparisons).
    """
    lt_funcs = set()
    for gv, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            opname = (
                str(func.attrs["operator_name"])
                if func.attrs and "operator_name" in func.attrs.keys()
                else ""
            )
            if "layout_transform" in gv.name_hint or "layout_transform" in opname:
                lt_funcs.add(gv.name_hint)
    count = 0

    def visit(expr):
        nonlocal count
        if isinstance(expr, relax.Call) and isinstance(expr.op, Op):
            if expr.op.same_as(_LT):
                count += 1
            elif include_permute_dims and expr.op.name == "relax.permute_dims":
                shape = static_shape(expr)
                if shape is not None and len(shape) in (4, 5):
                    count += 1
            elif expr.op.same_as(_CALL_TIR) and isinstance(expr.args[0], relax.GlobalVar):
                if expr.args[0].name_hint in lt_funcs:
                    count += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return count
