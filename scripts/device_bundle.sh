#!/usr/bin/env bash
# Packs TVM (and what it needs beyond a PyTorch image) into .gpu/ for a GPU machine that cannot reach
# a package registry and takes at most 64 MiB of files: the versions this checkout's venv runs, as
# wheels for that machine's Python, unpacked and trimmed (CUTLASS headers, the web runtime and
# TVM's C++ sources are not needed to build and run), the 250 MB compiler library xz-compressed
# with the x86 filter; .gpu/setup.sh unpacks it all under /tmp/site there.
#   here:   scripts/device_bundle.sh [PYTHON_VERSION]     (default 3.12; PYTHON=... the venv to copy)
#   there:  source .gpu/setup.sh && python scripts/gpu_check.py ...
# .gpu/ is ~65 MB and git-ignored (.git/info/exclude); move tuning_logs/ (60 MB) aside by hand for a
# call so the working tree fits the transfer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-3.12}"
[[ "$PY" =~ ^3\.[0-9]+$ ]] || { echo "error: expected a Python version like 3.12, got '$PY'" >&2; exit 2; }
PY_TAG="cp${PY/./}"
HOST_PYTHON="${PYTHON:-.venv/bin/python}"
version() { "$HOST_PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
TVM_VERSION="$(version apache-tvm)"
FFI_VERSION="$(version apache-tvm-ffi)"
XGB_VERSION="$(version xgboost-cpu)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --abi "$PY_TAG" --abi abi3 --abi none \
    -d "$WORK/wheels" \
    "apache-tvm==$TVM_VERSION" "apache-tvm-ffi==$FFI_VERSION" "xgboost-cpu==$XGB_VERSION"

mkdir -p "$WORK/site"
for wheel in "$WORK"/wheels/*.whl; do unzip -q -o "$wheel" -d "$WORK/site"; done
rm -rf "$WORK"/site/tvm/3rdparty/cutlass "$WORK"/site/tvm/web "$WORK"/site/tvm/src "$WORK"/site/xgboost/include
mv "$WORK/site/tvm/lib/libtvm_compiler.so" "$WORK/libtvm_compiler.so"

rm -rf .gpu && mkdir -p .gpu
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
tar -C "$WORK/site" -cf - . | xz --x86 --lzma2=preset=9e -T1 > .gpu/bundle.tar.xz
xz --x86 --lzma2=preset=9e,dict=256MiB -T1 -c "$WORK/libtvm_compiler.so" > .gpu/lt.xz
STAMP="$(cat .gpu/bundle.tar.xz .gpu/lt.xz | sha256sum | cut -c1-16)"
# setup.sh unpacks once per bundle (the stamp names it) and writes the library through a temporary
# file, so a call cut short never leaves a truncated library that the next call would trust
cat > .gpu/setup.sh <<EOF
# source me on the GPU machine: TVM $TVM_VERSION under /tmp/site, on PYTHONPATH
if [ "\$(cat /tmp/site/.bundle 2>/dev/null)" != "$STAMP" ]; then
    rm -rf /tmp/site && mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/bundle.tar.xz \\
        && xz -dc .gpu/lt.xz > /tmp/site/tvm/lib/libtvm_compiler.so.part \\
        && mv /tmp/site/tvm/lib/libtvm_compiler.so.part /tmp/site/tvm/lib/libtvm_compiler.so \\
        && echo "$STAMP" > /tmp/site/.bundle
fi
export PYTHONPATH=/tmp/site:\$PWD\${PYTHONPATH:+:\$PYTHONPATH} PYTHONUNBUFFERED=1
EOF
du -sh .gpu/*
