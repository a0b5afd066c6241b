"""IR statistics for summaries, tests and benchmarks: ops, kernels, fused groups, layout transforms."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import tvm
from tvm import relax

from .ir import is_primitive, tir_stmts
from .passes.rewrite_layout import count_layout_transforms  # noqa: F401  (re-exported: one definition)


def _relax_functions(mod: tvm.IRModule):
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function):
            yield gvar, func


def _calls(mod: tvm.IRModule, include_primitive: bool = False):
    """Every relax.Call in the module's (non-primitive) Relax functions."""
    found = []
    for _, func in _relax_functions(mod):
        if not include_primitive and is_primitive(func):
            continue
        relax.analysis.post_order_visit(
            func, lambda e: found.append(e) if isinstance(e, relax.Call) else None
        )
    return found


def op_counts(mod: tvm.IRModule) -> collections.Counter:
    """High-level Relax op calls that run at inference time (before legalisation), by op name.

    Calls on constants only (e.g. the reshape of a conv bias) are left out: they are folded at
    compile time and never become kernels in any pipeline.
    """
    counts = collections.Counter()
    for call in _calls(mod):
        if not isinstance(call.op, tvm.ir.Op) or call.op.name.startswith(
            ("relax.call_", "relax.builtin", "relax.memory", "relax.vm")
        ):
            continue
        if any(relax.analysis.free_vars(arg) for arg in call.args):
            counts[call.op.name.removeprefix("relax.")] += 1
    return counts


def kernel_calls(mod: tvm.IRModule) -> list[str]:
    """Names of the PrimFuncs main launches, one entry per launch (call_tir or direct call)."""
    names = []
    for call in _calls(mod):
        if isinstance(call.op, tvm.ir.Op) and call.op.name in ("relax.call_tir", "relax.call_tir_inplace"):
            names.append(call.args[0].name_hint)
        elif isinstance(call.op, tvm.ir.GlobalVar) and isinstance(mod[call.op], tvm.tirx.PrimFunc):
            names.append(call.op.name_hint)
    return names


def _is_view(func: tvm.tirx.PrimFunc) -> bool:
    """A pure reshape PrimFunc; RewriteDataflowReshape turns its launch into a free view."""
    return bool(relax.analysis.has_reshape_pattern(func))


@dataclasses.dataclass
class Summary:
    ops: int  # high-level ops in the imported module's entry
    kernels: int  # kernel launches of the entry after the pipeline (reshape views excluded)
    fused_groups: int  # kernels made from more than one op
    layout_transforms: int
    op_histogram: dict
    entries: int = 1  # Relax entry functions: main plus one per shape bucket

    def format(self) -> str:
        text = (
            f"ops {self.ops} -> kernels {self.kernels} ({self.fused_groups} fused groups), "
            f"layout transforms left {self.layout_transforms}"
        )
        if self.entries > 1:
            text += f" (counted in main; {self.entries - 1} shape-bucket entries are the same graph)"
        return text


def kernel_count(mod: tvm.IRModule) -> int:
    return sum(1 for name in kernel_calls(mod) if not _is_view(mod[mod.get_global_var(name)]))


def fused_kernel_count(mod: tvm.IRModule) -> int:
    """Kernels whose PrimFunc holds more than one compute op (blocks other than pads)."""
    count = 0
    for name in kernel_calls(mod):
        func = mod[mod.get_global_var(name)]
        if _is_view(func):
            continue
        count += _compute_blocks(func) > 1
    return count


def _compute_blocks(func: tvm.tirx.PrimFunc) -> int:
    """Blocks under the root, not counting padding (it is part of the conv that reads it)."""
    sch = tvm.s_tir.Schedule(func)
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # a PrimFunc without a root block: one opaque kernel
        return 1
    names = [sch.get(b).name_hint for b in blocks]
    return sum(1 for n in names if not n.startswith(("pad", "T_pad", "PadInput", "data_pad")))


def summarize(before: tvm.IRModule, after: tvm.IRModule, entry: str = "main") -> Summary:
    """Counts for ``entry`` alone: shape buckets add specialised copies of it, which would otherwise
    count every op once per bucket."""
    entries = sum(1 for _, f in _relax_functions(after) if not is_primitive(f))
    before, after = entry_only(before, entry), entry_only(after, entry)
    hist = op_counts(before)
    return Summary(
        ops=sum(hist.values()),
        kernels=kernel_count(after),
        fused_groups=fused_kernel_count(after),
        layout_transforms=count_layout_transforms(after),
        op_histogram=dict(hist),
        entries=entries,
    )


def entry_only(mod: tvm.IRModule, entry: str = "main") -> tvm.IRModule:
    """``mod`` without the non-primitive Relax functions other than ``entry`` (kernels all kept)."""
    if entry not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod
    return tvm.IRModule(
        {
            gv: f
            for gv, f in mod.functions.items()
            if not isinstance(f, relax.Function) or is_primitive(f) or gv.name_hint == entry
        },
        attrs=mod.attrs,
    )


def estimated_bytes(mod: tvm.IRModule) -> int:
    """Bytes main reads and writes at kernel boundaries (a roofline lower bound on traffic)."""
    total = 0
    for call in _calls(mod):
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
            for expr in [*args, call]:
                total += _tensor_bytes(expr.ty)
    return total


def _tensor_bytes(ty) -> int:
    if isinstance(ty, relax.TupleType):
        return sum(_tensor_bytes(f) for f in ty.fields)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return 0
    dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else 1 for d in ty.shape.values]
    return int(np.prod(dims, dtype=np.int64)) * np.dtype(str(ty.dtype)).itemsize


def model_flops(mod: tvm.IRModule) -> float:
    """FLOPs of one inference, from the high-level ops (convs and matmuls dominate; others count 1/element)."""
    total = 0.0
    for call in _calls(mod):
        if not isinstance(call.op, tvm.ir.Op) or not isinstance(call.ty, relax.TensorType):
            continue
        out = _tensor_bytes(call.ty) / max(np.dtype(str(call.ty.dtype)).itemsize, 1)
        name = call.op.name
        if name.startswith("relax.nn.conv") and len(call.args) >= 2:
            w = [int(d) for d in call.args[1].ty.shape.values]
            kernel_layout = str(getattr(call.attrs, "kernel_layout", "OIHW"))
            per_out = int(np.prod(w)) // _out_channels(w, kernel_layout)
            total += 2.0 * out * per_out
        elif name == "relax.matmul":
            k = call.args[0].ty.shape.values[-1]
            total += 2.0 * out * (int(k) if isinstance(k, tvm.tirx.IntImm) else 1)
        elif not name.startswith(
            ("relax.call_", "relax.reshape", "relax.permute_dims", "relax.layout_transform")
        ):
            total += out
    return total


def _out_channels(weight_shape: list[int], kernel_layout: str) -> int:
    """Output channels of a conv weight in any layout ("OIHW", "OHWI", "OIHW8i8o" ...)."""
    letters = [c for c in kernel_layout if c.isalpha()]
    return int(np.prod([d for d, c in zip(weight_shape, letters) if c in "Oo"])) or 1


def tir_buffers(func: tvm.tirx.PrimFunc) -> list[tuple[str, tuple, str, str]]:
    """``(name, shape, dtype, scope)`` of every buffer a PrimFunc takes or allocates
    (parameters have scope "param")."""
    found = [(b.name, tuple(b.shape), str(b.dtype), "param") for b in func.params if hasattr(b, "shape")]
    for node in tir_stmts(func):
        allocated = list(getattr(node, "alloc_buffers", []) or [])
        if isinstance(node, tvm.tirx.AllocBuffer):
            allocated.append(node.buffer)
        for buf in allocated:
            found.append((buf.name, tuple(buf.shape), str(buf.dtype), str(buf.scope())))
    return found


def largest_intermediate(mod: tvm.IRModule) -> tuple[str, int]:
    """The largest buffer a run of ``main`` materialises besides its inputs: a kernel's output
    tensor, or a global-memory allocation inside a kernel. ``(description, bytes)``."""
    best = ("none", 0)
    for call in _calls(mod):
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            size = _tensor_bytes(call.ty)
            if size > best[1]:
                best = (f"{call.args[0].name_hint} output {_shape_text(call.ty)}", size)
    for gvar, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        for name, shape, dtype, scope in tir_buffers(func):
            if scope != "global" or not all(isinstance(d, (int, tvm.tirx.IntImm)) for d in shape):
                continue
            size = int(np.prod([int(d) for d in shape], dtype=np.int64)) * np.dtype(dtype).itemsize
            if size > best[1]:
                best = (f"{gvar.name_hint}:{name} {tuple(int(d) for d in shape)}", size)
    return best


def _shape_text(ty) -> str:
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return str(tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else "?" for d in ty.shape.values))
    return "?"
