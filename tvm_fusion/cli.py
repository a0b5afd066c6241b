"""``tvm-fusion`` command line: demo (default), build, tune, explain, run.

Every user-facing failure prints one ``error: ...`` line naming the file, node or target at
fault and exits with status 2 (1 for an unexpected internal error, with the traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from . import models, tuning
from .api import build
from .benchmark import measure_speedup
from .demo import run_demo
from .errors import TvmFusionError
from .frontend import as_imported
from .loaded import load, read_inputs
from .passes import explain
from .pipeline import pipeline_stages, run_passes
from .policy import FusionPolicy
from .shape_cache import parse_bucket
from .targets import parse_target


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="an .onnx file, or the name of a bundled example (see `tvm-fusion examples`)"
    )
    parser.add_argument("--target", default="llvm", help="llvm | cuda | a JSON target dict (default: llvm)")
    parser.add_argument("--arch", default=None, help="CUDA arch for --target cuda (default sm_80)")
    parser.add_argument("--policy", default=None, help="a JSON file with a FusionPolicy (see README)")
    parser.add_argument(
        "--name", default=None, help="model name for tuning_logs/<name>/ (default: file stem)"
    )


def _add_pipeline_switches(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-fold-bn", dest="fold_batch_norm", action="store_false", help="keep BatchNorm ops"
    )
    parser.add_argument(
        "--no-horizontal",
        dest="horizontal",
        action="store_const",
        const=False,
        default=None,
        help="disable horizontal fusion",
    )
    parser.add_argument(
        "--no-attention",
        dest="attention",
        action="store_const",
        const=False,
        default=None,
        help="do not fuse attention blocks (FuseAttention)",
    )
    parser.add_argument(
        "--layout",
        default="auto",
        help="auto (NHWC on CUDA; on CPU as-model) | as-model (NHWC for a model that is channels-last "
        "between its convs, as ConvNeXt, else NCHW, also on CUDA) | NCHW | NHWC | NCHW8c | off",
    )
    parser.add_argument(
        "--no-fusion", dest="fusion", action="store_false", help="one kernel per op (baseline)"
    )


def _pipeline_options(args) -> dict:
    layout = {"auto": True, "off": False, "none": False}.get(str(args.layout).lower(), args.layout)
    return {
        "fold_batch_norm": args.fold_batch_norm,
        "horizontal": args.horizontal,
        "attention": args.attention,
        "layout": layout,
        "fusion": args.fusion,
    }


def cmd_build(args) -> int:
    target = parse_target(args.target, cuda_arch=args.arch)
    imported = as_imported(args.model, args.name)
    tuning_logs = None if args.no_tuning_logs else args.tuning_logs
    buckets = [parse_bucket(b) for b in args.shape_bucket] or None
    result = build(
        imported,
        target,
        args.policy,
        tuning_logs=tuning_logs,
        shape_buckets=buckets,
        device_key=args.device_key,
        **_pipeline_options(args),
        **({} if args.conv_algorithm == "auto" else {"conv_algorithms": args.conv_algorithm}),
        **({"strassen": {"on": True, "always": "always"}[args.strassen]} if args.strassen != "off" else {}),
    )
    out = Path(args.output or f"{imported.name}.{target.kind.name}.so")
    result.export(out)
    print(result.describe())
    print(f"  ops by type before: {dict(sorted(result.summary.op_histogram.items()))}")
    print(f"wrote {out} and {out}.json")
    return 0


def cmd_explain(args) -> int:
    target = parse_target(args.target, cuda_arch=args.arch)
    imported = as_imported(args.model, args.name)
    stages = pipeline_stages(target, args.policy, **_pipeline_options(args))
    mod = run_passes(imported.mod, stages.rewrite, target, imported.name)  # what the fusion policy sees
    policy = FusionPolicy.coerce(args.policy)
    if args.attention is False:
        policy = policy.replace(attention=False)
    print(explain(mod, policy, target))
    return 0


UNLIMITED_TRIALS = 1_000_000  # with --minutes alone: time, not trials, ends the search


def cmd_tune(args) -> int:
    target = parse_target(args.target, cuda_arch=args.arch)
    imported = as_imported(args.model, args.name)
    result = tuning.tune_model(
        imported,
        target,
        policy=args.policy,
        trials=args.trials if args.trials is not None else (UNLIMITED_TRIALS if args.minutes else 64),
        time_budget_s=None if args.minutes is None else args.minutes * 60,
        log_root=args.tuning_logs,
        rpc=args.rpc,
        builders=args.builders,
        max_trials_per_task=args.trials_per_task,
        options=_pipeline_options(args),
        verify_again=args.verify_again,
        in_model=args.in_model,
    )
    print(result)
    if args.measure:
        print(
            measure_speedup(
                imported,
                target,
                tuning_logs=args.tuning_logs,
                policy=args.policy,
                options=_pipeline_options(args),
            )
        )
    return 0


def cmd_fleet(args) -> int:
    host, _, port = args.tracker.rpartition(":")
    if not host or not port.isdigit():
        raise TvmFusionError(f"bad RPC tracker {args.tracker!r}: expected 'host:port', e.g. '127.0.0.1:9190'")
    print(tuning.fleet_report(host, int(port)))
    return 0


def cmd_run(args) -> int:
    model = load(args.module)
    if not model.from_sidecar:
        print(f"note: no {args.module}.json: inputs as the module declares them", file=sys.stderr)
    feeds = read_inputs(args.inputs, model.inputs) if args.inputs else model.random_inputs()
    out = model(**feeds)
    outs = out if isinstance(out, list) else [out]
    for i, o in enumerate(outs):
        print(f"output {i}: shape {list(o.shape)} dtype {o.dtype} mean {float(np.mean(o)):.6g}")
    lat = model.latency_ms(*[feeds[s.name] for s in model.inputs], number=args.number, repeat=args.repeat)
    print(f"latency: median {np.median(lat):.3f} ms over {len(lat)} repeats")
    return 0


def cmd_examples(_args) -> int:
    for name, fn in models.EXAMPLES.items():
        print(f"{name:20s} {(fn.__doc__ or '').strip().splitlines()[0]}")
    return 0


def cmd_demo(args) -> int:
    return run_demo(out_dir=args.out_dir, target=args.target)


class _Parser(argparse.ArgumentParser):
    """argparse with our error format: one ``error: ...`` line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tvm-fusion", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="build, export, reload and check the bundled example models (default)")
    demo.add_argument("--out-dir", default="out")
    demo.add_argument("--target", default="llvm")
    demo.set_defaults(func=cmd_demo)

    b = sub.add_parser("build", help="optimise and compile a model to a .so (+ .json metadata)")
    _add_model_args(b)
    _add_pipeline_switches(b)
    b.add_argument("-o", "--output", default=None, help="output .so path (default <name>.<target>.so)")
    b.add_argument(
        "--tuning-logs", default="tuning_logs", help="root of stored tuning records (default tuning_logs)"
    )
    b.add_argument("--no-tuning-logs", action="store_true", help="ignore stored tuning records")
    b.add_argument(
        "--device-key",
        default=None,
        help="use the records tuned on the RPC servers under this key (tune --rpc host:port:KEY)",
    )
    b.add_argument(
        "--conv-algorithm",
        choices=["auto", "direct", "winograd2", "winograd4"],
        default="auto",
        help="3x3 stride-1 convs on CPU: auto (tuning's choice, else the cost rule) or one for all; "
        "direct has the smallest rounding error (F(4)'s is 2-4x the direct conv's)",
    )
    b.add_argument(
        "--strassen",
        choices=["off", "on", "always"],
        default="off",
        help="float32 matmuls by a constant weight on CPU by one level of Strassen (7 block products "
        "instead of 8; BERT-base ~3%% faster): off (default: its error is relative to whole blocks, "
        "so a model that normalizes near-zero rows, e.g. Swin V2's cosine attention, amplifies it), "
        "on (where the measured size rule says) or always (every eligible matmul)",
    )
    b.add_argument(
        "--shape-bucket",
        action="append",
        default=[],
        metavar="DIM=N[,DIM=N]",
        help="add an entry specialised for these symbolic dims (repeatable), e.g. batch=1,seq=128",
    )
    b.set_defaults(func=cmd_build)

    e = sub.add_parser(
        "explain", help="show the fusion groups the policy forms and why candidates were rejected"
    )
    _add_model_args(e)
    _add_pipeline_switches(e)
    e.set_defaults(func=cmd_explain)

    t = sub.add_parser("tune", help="tune the fused kernels with Meta-Schedule and store the records")
    _add_model_args(t)
    _add_pipeline_switches(t)
    t.add_argument(
        "--trials", type=int, default=None, help="total measured trials (default 64; no limit with --minutes)"
    )
    t.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-time budget: each kernel gets a share by its FLOPs; a re-run goes on where it stopped",
    )
    t.add_argument(
        "--trials-per-task",
        type=int,
        default=None,
        help="cap per fused kernel (default: trials spread evenly)",
    )
    t.add_argument("--tuning-logs", default="tuning_logs", help="where records go (default tuning_logs)")
    t.add_argument(
        "--rpc",
        default=None,
        metavar="HOST:PORT:KEY",
        help="measure on every server registered under KEY at this TVM RPC tracker (records go to <target-key>@KEY)",
    )
    t.add_argument(
        "--builders",
        type=int,
        default=None,
        help="local processes building candidates (default: one per core)",
    )
    t.add_argument(
        "--measure", action="store_true", help="afterwards, time the tuned build against the untuned one"
    )
    t.add_argument(
        "--verify-again",
        action="store_true",
        help="re-time each kernel's best record against its default schedule (after a run on a busy machine)",
    )
    t.add_argument(
        "--in-model",
        action="store_true",
        help="afterwards, choose each kernel's schedule by its time inside the whole model: among "
        "its 3 best records and a grid of plan x accumulator choices, winners confirmed in one more "
        "build (up to 14 more builds)",
    )
    t.set_defaults(func=cmd_tune)

    f = sub.add_parser("fleet", help="list the servers per device key at a TVM RPC tracker")
    f.add_argument("tracker", metavar="HOST:PORT", help="the tracker's address, e.g. 127.0.0.1:9190")
    f.set_defaults(func=cmd_fleet)

    r = sub.add_parser("run", help="load an exported .so and run it on random (or .npz) inputs")
    r.add_argument("module")
    r.add_argument("--inputs", default=None, help="an .npz file with one array per input name")
    r.add_argument("--number", type=_positive_int, default=10, help="runs per timing (default 10)")
    r.add_argument("--repeat", type=_positive_int, default=5, help="timings (default 5)")
    r.set_defaults(func=cmd_run)

    x = sub.add_parser("examples", help="list the bundled example models")
    x.set_defaults(func=cmd_examples)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo", *(argv or [])])
    try:
        return args.func(args)
    except TvmFusionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
