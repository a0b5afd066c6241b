#!/usr/bin/env python3
"""Tuning throughput on this machine vs a local RPC fleet (1 and 2 servers): writes docs/fleet.md.

    python scripts/bench_fleet.py                      # resnet_block_net, 48 trials per variant
    python scripts/bench_fleet.py --model mlp_bn --trials 16

Every variant tunes the same model from scratch with the same budget (no default-schedule check,
so only the search is timed) into its own records folder; the servers run on 127.0.0.1, so they
share this machine's cores with the builders: the numbers show the fleet path's overhead and
parallelism, not the speed of extra hardware.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from tvm_fusion import tuning


def tune_once(model: str, trials: int, logs: Path, rpc: str | None) -> tuple[float, int]:
    start = time.perf_counter()
    result = tuning.tune_model(
        model, "llvm", trials=trials, log_root=logs, rpc=rpc, check_default=False, progress=False
    )
    return time.perf_counter() - start, result.new_trials


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="resnet_block_net")
    parser.add_argument("--trials", type=int, default=48)
    parser.add_argument("--out", default="docs/fleet.md")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        seconds, trials = tune_once(args.model, args.trials, tmp / "local", None)
        rows.append(("local (LocalRunner)", 0, seconds, trials))
        for servers in (1, 2):
            with tuning.fleet.LocalFleet("bench", servers, tmp / f"fleet{servers}") as fleet:
                seconds, trials = tune_once(
                    args.model, args.trials, tmp / f"rpc{servers}", str(fleet.tracker)
                )
            rows.append(
                (f"RPC tracker, {servers} server{'s' if servers > 1 else ''}", servers, seconds, trials)
            )
            print(rows[-1], file=sys.stderr)
    local_rate = rows[0][3] / rows[0][2] * 60
    lines = [
        "# Tuning on a fleet: throughput",
        "",
        f"Measured {datetime.date.today()} with `python scripts/bench_fleet.py --model {args.model} --trials "
        f"{args.trials}` on {platform.processor() or platform.machine()} ({os.cpu_count()} cores). Each row tunes "
        "the model from scratch with the same budget (search only, no default-schedule check). The tracker and "
        "servers run on 127.0.0.1 and share this machine's cores with the builders, so this shows the overhead "
        "and parallelism of the fleet path, not the gain of extra hardware: with real servers each one measures "
        "on its own device while the builders use the local cores.",
        "",
        "| measuring on | servers | trials | wall s | trials / min | vs local |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, servers, seconds, trials in rows:
        rate = trials / seconds * 60
        lines.append(
            f"| {label} | {servers} | {trials} | {seconds:.1f} | {rate:.1f} | {rate / local_rate:.2f}x |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
