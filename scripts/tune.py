#!/usr/bin/env python
"""Tune a model's fused kernels with Meta-Schedule and store the records under tuning_logs/.

    python scripts/tune.py --model resnet_block_net --target llvm --trials 64
    python scripts/tune.py --model path/to/model.onnx --target cuda --rpc 10.0.0.2:9190:a100 --trials 512

    python scripts/tune.py --model mlp_bn --trials 8 --measure   # then time tuned vs untuned builds
    python scripts/tune.py --model resnet_block_net --measure-only  # only the timing (tvm_fusion.build)

Kernels are fused with the build's own pipeline (same policy: pass --policy if the build gets
one), each task's best schedule is timed against its default schedule, and only faster ones
are applied by the build. Re-running with the same budget measures nothing new; a larger budget continues where the last
run stopped; Ctrl-C stops after the current batch (twice: at once), keeping what was measured.
"""

from __future__ import annotations

import argparse
import sys

from tvm_fusion import tuning
from tvm_fusion.benchmark import measure_speedup
from tvm_fusion.errors import TvmFusionError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="example model name (tvm_fusion.models) or an .onnx path")
    ap.add_argument("--target", default="llvm", help="llvm, cuda or a JSON target dict (default: llvm)")
    ap.add_argument(
        "--trials", type=int, default=64, help="total measured trials, split over the tasks (default 64)"
    )
    ap.add_argument("--max-trials-per-task", type=int, default=None)
    ap.add_argument("--log-root", default="tuning_logs")
    ap.add_argument(
        "--rpc", default=None, metavar="HOST:PORT:KEY", help="measure on a TVM RPC tracker's devices"
    )
    ap.add_argument("--per-iter", type=int, default=16, help="candidates measured per batch (default 16)")
    ap.add_argument(
        "--builders", type=int, default=None, help="builder worker processes (default: one per core)"
    )
    ap.add_argument("--policy", default=None, help="fusion policy file (must be the one the build uses)")
    ap.add_argument(
        "--measure",
        action="store_true",
        help="then build the model with and without the records (tvm_fusion.build) and time both",
    )
    ap.add_argument(
        "--measure-only", action="store_true", help="only time tuned vs untuned builds (no tuning)"
    )
    ap.add_argument(
        "--verify-again",
        action="store_true",
        help="re-time every task's best record against its default schedule (e.g. after a busy-machine run)",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.measure_only:
        print(measure_speedup(args.model, args.target, tuning_logs=args.log_root, policy=args.policy))
        return 0
    try:
        result = tuning.tune_model(
            args.model,
            args.target,
            trials=args.trials,
            policy=args.policy,
            max_trials_per_task=args.max_trials_per_task,
            log_root=args.log_root,
            rpc=args.rpc,
            num_trials_per_iter=args.per_iter,
            builders=args.builders,
            progress=not args.no_progress,
            verify_again=args.verify_again,
        )
        print(result)
        if args.measure:
            print(measure_speedup(args.model, args.target, tuning_logs=args.log_root, policy=args.policy))
    except TvmFusionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
