#!/usr/bin/env python3
"""Benchmark tvm_fusion against ONNX Runtime and stock TVM; writes docs/benchmarks.{md,json,png}.

python scripts/benchmark.py            # ResNet-style net, ResNet-18 (224x224), BERT-base layer (seq 128)
python scripts/benchmark.py --quick    # small models, 5 runs: only checks that everything completes
python scripts/benchmark.py --suite cpu  # MobileNet block, ResNet-18, BERT layer (the CPU performance floor set)
"""

import sys

from tvm_fusion.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
