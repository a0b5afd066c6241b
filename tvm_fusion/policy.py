"""The fusion policy as data: which ops may fuse, how deep, and when fusing pays off.

A :class:`FusionPolicy` is a plain, JSON-serialisable object. ``ApplyFusionPolicy`` (in
``tvm_fusion.passes.apply_fusion_policy``) reads it; nothing about fusion is hard-coded in the
pass. Users write their own policy as a dict::

    policy = FusionPolicy.from_dict({"max_fusion_depth": 3,
                                     "vertical": {"gemm": ["binary"], "binary": ["activation"]}})

Ops are grouped into *classes* (``OP_CLASSES``); the ``vertical`` table says which producer
class may hand its output to which consumer classes inside one kernel. On top of the table:

* ``max_fusion_depth`` caps the number of ops in one group (default 4); views (the ``view`` class:
  reshape, squeeze, ...), slices and concats are free index remaps and do not count;
* the unique-consumer rule: a producer whose output has several consumers (or is a function
  output) is never fused with a consumer, because its output must be written to memory anyway
  (this is not configurable: it is what keeps every group convex and side-effect free);
* ``anchor_classes`` (conv, gemm) are the heavy ops; a group holds at most one, and after it only
  ``epilogue_classes`` ops may follow, which is what schedules can fold into the anchor's tiles;
* a roofline cost model (:class:`Roofline`) prices every candidate edge: memory time saved by not
  writing and re-reading the intermediate, minus compute added when an inlined producer is
  recomputed for every read, plus one kernel launch saved. An edge is fused only when the
  benefit is at least ``benefit_threshold_us``.

Two switches run before the table: ``horizontal`` (sibling GEMMs over one input become one, see
``HorizontalFuse``) and ``attention`` (scaled-dot-product attention blocks become one fused kernel
that never materialises the score tensor, see ``FuseAttention``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PolicyError
from .jsonio import json_type, read_json

# Op names are Relax op names without the "relax." prefix.
OP_CLASSES: dict[str, list[str]] = {
    "conv": ["nn.conv1d", "nn.conv2d", "nn.conv3d", "nn.conv1d_transpose", "nn.conv2d_transpose"],
    "gemm": ["matmul", "nn.linear"],
    "binary": ["add", "subtract", "multiply", "divide", "maximum", "minimum", "power"],
    "activation": [
        "nn.relu",
        "nn.gelu",
        "nn.gelu_tanh",
        "nn.silu",
        "nn.hardswish",
        "nn.leakyrelu",
        "nn.softplus",
        "sigmoid",
        "tanh",
        "clip",
        "erf",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "negative",
        "abs",
        "square",
        "astype",
    ],
    # shape-only views: the same row-major data, so they may follow a GEMM's tile like an
    # elementwise op (exporters put one between a matmul and its bias add: GPT-2)
    "view": ["reshape", "expand_dims", "squeeze", "flatten"],
    "injective": ["permute_dims", "layout_transform", "broadcast_to"],
    # pieces joined along an axis: fused, its consumers read the pieces directly (DenseNet's
    # pre-activation BN, ShuffleNet's channel shuffle) and the joined tensor is not written
    "concat": ["concat"],
    # a crop of the producer's result: the channels PadConvChannels added, the Q/K/V split
    "slice": ["strided_slice"],
    "norm": ["nn.layer_norm", "nn.rms_norm", "nn.group_norm"],
    "softmax": ["nn.softmax", "nn.log_softmax"],
    "dropout": ["nn.dropout"],
    "pool": ["nn.max_pool2d", "nn.avg_pool2d", "nn.adaptive_avg_pool2d"],
    "reduce": ["mean", "sum", "max", "min", "variance"],
}

ELEMENTWISE = ["binary", "activation"]
# classes that do not count toward max_fusion_depth: fused, they write nothing (their readers
# read the data in place), so they take no room from the ops after them. A slice is most often
# our own crop (``PadConvChannels``'s filters padded to whole vectors), not an op of the model.
FREE_REMAPS = ("view", "slice", "concat")
# index remaps of one tensor (or, for concat, of its pieces): free to chain with elementwise ops
INDEX_REMAPS = ["view", "injective", "slice", "concat"]

# The classes that may take a concat in front, and only where they read its pieces in place
# (``ir.reads_pieces_in_place``: pools, 1x1 stride-1 convs): the planner checks that per edge and
# ``ConcatPerReader`` copies a shared concat for each such reader.
CONCAT_READERS = ("conv", "pool")

DEFAULT_VERTICAL: dict[str, list[str]] = {
    # anchor -> bias add / residual add / activation epilogue
    "conv": ELEMENTWISE + ["view", "slice"],
    "gemm": ELEMENTWISE + ["view"],
    # elementwise chains, and elementwise prologues of normalisations (residual add -> layer_norm)
    "binary": ELEMENTWISE + INDEX_REMAPS + ["norm", "softmax", "reduce"],
    "activation": ELEMENTWISE + INDEX_REMAPS + ["norm", "softmax", "reduce"],
    "view": INDEX_REMAPS + ELEMENTWISE + ["norm", "softmax", "reduce"],
    "injective": INDEX_REMAPS + ELEMENTWISE,
    "slice": INDEX_REMAPS + ELEMENTWISE,
    # followed like an injective op; it follows elementwise, view, injective and slice producers
    # only: not a reduction (whose schedules place consumers inside its loops, and a concat covers
    # more than its output) nor an anchor (epilogues are elementwise, views and slices). A conv or
    # a pool may take it in front: it reads the pieces where they lie (SqueezeNet's fire modules,
    # GoogLeNet's inception outputs; ConcatPerReader gives each reader of a shared one a copy)
    "concat": INDEX_REMAPS + ELEMENTWISE + list(CONCAT_READERS),
    # layer_norm -> matmul (prologue of the next projection), softmax -> dropout
    "norm": ["gemm"] + ELEMENTWISE,
    "softmax": ["dropout"] + ELEMENTWISE,
    "pool": ELEMENTWISE,
    "reduce": ELEMENTWISE + [c for c in INDEX_REMAPS if c != "concat"],
}

# Pairs a target's schedules cannot take, left out of ``vertical`` on that target (unless a
# policy sets ``target_exclusions`` false). On CUDA, dlight's Matmul rule declines a GEMM with a
# normalisation fused in front (the norm's row reductions), and the kernel falls to a generic rule
# without shared-memory tiling: ViT's pre-norm FFN (`fused_layer_norm_matmul_add_gelu`, 197x768 ->
# 3072) was the only GEMM of the zoo without it, and ViT the zoo's slowest model against PyTorch on
# an H200 (2.96x; BERT, whose layer norm feeds a residual too and so stays apart, 0.98x).
# A concat in front of a conv or a pool is measured on CPU only (its rules read the pieces in
# place); on CUDA it stays a kernel of its own, as before.
TARGET_EXCLUSIONS: dict[str, dict[str, list[str]]] = {
    "cuda": {"norm": ["gemm"], "concat": list(CONCAT_READERS)}
}

# Rough FLOPs per output element, for the cost model. Anything unlisted counts 1.
FLOPS_PER_ELEMENT: dict[str, float] = {
    # an element of one piece, chosen by its index: no arithmetic (a conv reading a fused concat
    # loops over its pieces apart, schedules.contraction._split_at_pieces)
    "concat": 0,
    "nn.gelu": 14,
    "nn.gelu_tanh": 12,
    "nn.silu": 5,
    "nn.hardswish": 5,
    "sigmoid": 4,
    "tanh": 6,
    "erf": 8,
    "exp": 4,
    "log": 4,
    "nn.softplus": 8,
    "clip": 2,
    "power": 8,
    "rsqrt": 2,
    "nn.layer_norm": 8,
    "nn.rms_norm": 6,
    "nn.group_norm": 8,
    "nn.softmax": 6,
    "nn.log_softmax": 7,
}

# How many times a reduction consumer reads each input element (mean, variance, normalise).
REDUCTION_PASSES: dict[str, int] = {
    "nn.layer_norm": 3,
    "nn.rms_norm": 2,
    "nn.group_norm": 3,
    "nn.softmax": 3,
    "nn.log_softmax": 3,
}


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Machine limits the cost model prices bytes and FLOPs with.

    Presets are fixed (not measured at compile time) so that the same model and target always
    fuse the same way; tuning records are keyed on the kernels fusion produces.
    ``Roofline.measure()`` gives this machine's numbers for reports and custom policies.
    """

    bandwidth_gbps: float
    peak_gflops: float
    launch_overhead_us: float
    cache_bytes: int

    def __post_init__(self):
        _check_fields(self, ROOFLINE_FIELDS, "roofline.")

    @classmethod
    def from_dict(cls, data: Any) -> Roofline:
        """From a JSON object with exactly the four fields (a partial roofline has no sane default)."""
        if not isinstance(data, dict):
            raise PolicyError(
                f"fusion policy key 'roofline' must be {_ROOFLINE_WORDS}, got {json_type(data)}"
            )
        unknown = sorted(set(data) - set(ROOFLINE_FIELDS))
        missing = sorted(set(ROOFLINE_FIELDS) - set(data))
        if unknown or missing:
            problem = f"unknown key(s) {unknown}" if unknown else f"missing key(s) {missing}"
            raise PolicyError(
                f"fusion policy key 'roofline': {problem}; it needs exactly {sorted(ROOFLINE_FIELDS)}"
            )
        return cls(**data)

    @classmethod
    def for_target(cls, target) -> Roofline:
        kind = getattr(getattr(target, "kind", None), "name", "llvm")
        if kind == "cuda":  # A100-class: HBM2e, fp32 CUDA cores, ~5 us launch, 40 MB L2
            return cls(
                bandwidth_gbps=1500.0, peak_gflops=19500.0, launch_overhead_us=5.0, cache_bytes=40 << 20
            )
        cores = 1
        if target is not None and "num-cores" in target.attrs:
            cores = int(target.attrs["num-cores"])
        # Per AVX2 core: 2 FMA x 8 lanes x ~3 GHz = ~96 GFLOP/s peak; ~12 GB/s of DRAM bandwidth.
        return cls(
            bandwidth_gbps=12.0 * cores, peak_gflops=96.0 * cores, launch_overhead_us=1.0, cache_bytes=1 << 20
        )

    @classmethod
    def measure(cls, size_mb: int = 64, *, tries: int = 10, target=None) -> Roofline:
        """Measure this machine (takes ~1 s): copy bandwidth with numpy, and the FMA peak with a
        kernel TVM compiles for ``target`` (:func:`tvm_fusion.fma_peak.fma_peak_gflops`; the
        host's LLVM target by default). Each is the best of ``tries``, since on a shared machine
        other tenants only ever make a try slower."""
        from .fma_peak import fma_peak_gflops  # pylint: disable=import-outside-toplevel

        src = np.ones(size_mb << 18, dtype=np.float32)
        dst = np.empty_like(src)
        best = math.inf
        for _ in range(tries):
            start = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - start)
        bandwidth = 2 * src.nbytes / best / 1e9  # read + write
        return cls(
            bandwidth_gbps=round(bandwidth, 1),
            peak_gflops=round(fma_peak_gflops(target, tries), 1),
            launch_overhead_us=1.0,
            cache_bytes=1 << 20,
        )

    def seconds(self, bytes_moved: float, flops: float) -> float:
        """Roofline time: the larger of memory time and compute time."""
        return max(bytes_moved / (self.bandwidth_gbps * 1e9), flops / (self.peak_gflops * 1e9))


@dataclasses.dataclass
class FusionPolicy:
    """Which op pairs may fuse, how deep groups get, and the cost model's threshold."""

    vertical: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {k: list(v) for k, v in DEFAULT_VERTICAL.items()}
    )
    op_classes: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {k: list(v) for k, v in OP_CLASSES.items()}
    )
    max_fusion_depth: int = 4
    anchor_classes: list[str] = dataclasses.field(default_factory=lambda: ["conv", "gemm"])
    epilogue_classes: list[str] = dataclasses.field(default_factory=lambda: [*ELEMENTWISE, "view", "slice"])
    benefit_threshold_us: float = 0.0
    use_cost_model: bool = True
    roofline: Roofline | None = None  # None: the preset for the build target
    horizontal: bool = True
    attention: bool = True
    target_exclusions: bool = True  # leave out the pairs TARGET_EXCLUSIONS names for the target

    def __post_init__(self):
        self.validate()

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FusionPolicy:
        """Build from a plain dict; missing keys keep their defaults, unknown keys are errors."""
        if not isinstance(data, dict):
            raise PolicyError(f"a fusion policy must be a JSON object, got {json_type(data)}")
        unknown = sorted(set(data) - set(POLICY_FIELDS))
        if unknown:
            raise PolicyError(f"unknown fusion policy key(s) {unknown}; valid keys: {sorted(POLICY_FIELDS)}")
        data = dict(data)
        if data.get("roofline") is not None and not isinstance(data["roofline"], Roofline):
            data["roofline"] = Roofline.from_dict(data["roofline"])
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> FusionPolicy:
        data = read_json(path, "fusion policy", PolicyError)
        try:
            return cls.from_dict(data)
        except PolicyError as err:
            raise PolicyError(f"{path}: {err}") from None

    @classmethod
    def coerce(cls, policy: FusionPolicy | dict | str | Path | None) -> FusionPolicy:
        """Accept a policy, a dict, a JSON file path, or None (the default policy)."""
        if policy is None:
            return cls()
        if isinstance(policy, FusionPolicy):
            return policy
        if isinstance(policy, dict):
            return cls.from_dict(policy)
        return cls.from_json(policy)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> FusionPolicy:
        return dataclasses.replace(self, **changes)

    def without(self, op_class: str) -> FusionPolicy:
        """This policy with one op class gone from every table: its ops then fuse with nothing.
        The baseline of an ablation (``scripts/ablate_op_class.py``)."""
        if op_class not in self.op_classes:
            raise PolicyError(f"no op class {op_class!r} to remove; classes: {sorted(self.op_classes)}")
        return self.replace(
            op_classes={k: list(v) for k, v in self.op_classes.items() if k != op_class},
            vertical={
                p: [c for c in cs if c != op_class] for p, cs in self.vertical.items() if p != op_class
            },
            anchor_classes=[c for c in self.anchor_classes if c != op_class],
            epilogue_classes=[c for c in self.epilogue_classes if c != op_class],
        )

    # -- queries --------------------------------------------------------------------------
    def validate(self) -> None:
        """Every field has its type (a JSON ``"false"`` is not false), every class name is known."""
        _check_fields(self, POLICY_FIELDS)
        known = set(self.op_classes)
        for key, names in [
            *((f"vertical[{p!r}]", [p, *c]) for p, c in self.vertical.items()),
            ("anchor_classes", self.anchor_classes),
            ("epilogue_classes", self.epilogue_classes),
        ]:
            for name in names:
                if name not in known:
                    raise PolicyError(
                        f"fusion policy key {key} names op class {name!r}, which is not in op_classes "
                        f"{sorted(known)}"
                    )

    def op_class(self, op_name: str) -> str | None:
        """The class of a Relax op name ("relax.nn.conv2d" or "nn.conv2d"), or None if unclassified."""
        name = op_name.removeprefix("relax.")
        for cls_name, ops in self.op_classes.items():
            if name in ops:
                return cls_name
        return None

    def for_target(self, target) -> FusionPolicy:
        """This policy as it applies on ``target``: without the pairs the target's schedules
        cannot take (``TARGET_EXCLUSIONS``), unless ``target_exclusions`` is false."""
        kind = getattr(getattr(target, "kind", None), "name", "llvm")
        excluded = TARGET_EXCLUSIONS.get(kind, {}) if self.target_exclusions else {}
        if not any(c in self.vertical.get(p, ()) for p, cs in excluded.items() for c in cs):
            return self
        vertical = {p: [c for c in cs if c not in excluded.get(p, ())] for p, cs in self.vertical.items()}
        return self.replace(vertical=vertical)

    def allows(self, producer_class: str | None, consumer_class: str | None) -> bool:
        if producer_class is None or consumer_class is None:
            return False
        return consumer_class in self.vertical.get(producer_class, ())

    def is_anchor(self, op_class: str | None) -> bool:
        return op_class in self.anchor_classes


# -- typed fields ---------------------------------------------------------------------------
# One table per dataclass: field -> (check, what the value must be). JSON gives strings, numbers,
# booleans, lists and objects; Python's truthiness would take "false" or "no" as true, and bool is
# an int, so every field is checked for its exact type.
def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_names(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _is_class_table(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _is_names(v) for k, v in value.items())


POLICY_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "vertical": (_is_class_table, "an object mapping each producer class to a list of consumer classes"),
    "op_classes": (_is_class_table, "an object mapping each class name to a list of Relax op names"),
    "max_fusion_depth": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "anchor_classes": (_is_names, "a list of op class names"),
    "epilogue_classes": (_is_names, "a list of op class names"),
    "benefit_threshold_us": (_is_number, "a number (microseconds)"),
    "use_cost_model": (_is_bool, "true or false"),
    "roofline": (lambda v: v is None or isinstance(v, Roofline), "null or a roofline object"),
    "horizontal": (_is_bool, "true or false"),
    "attention": (_is_bool, "true or false"),
    "target_exclusions": (_is_bool, "true or false"),
}

ROOFLINE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bandwidth_gbps": (lambda v: _is_number(v) and v > 0, "a number > 0 (GB/s)"),
    "peak_gflops": (lambda v: _is_number(v) and v > 0, "a number > 0 (GFLOP/s)"),
    "launch_overhead_us": (lambda v: _is_number(v) and v >= 0, "a number >= 0 (microseconds)"),
    "cache_bytes": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (bytes)"),
}

_ROOFLINE_WORDS = "null or an object with " + ", ".join(ROOFLINE_FIELDS)


def _check_fields(obj, table: dict, prefix: str = "") -> None:
    for name, (ok, expected) in table.items():
        value = getattr(obj, name)
        if not ok(value):
            raise PolicyError(
                f"fusion policy key '{prefix}{name}' must be {expected}, got {json_type(value)}"
            )
