"""tvm_fusion: fusion, BatchNorm-folding and layout passes for Apache TVM Relax."""

__version__ = "0.1.0"
