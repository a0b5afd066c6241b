#!/usr/bin/env bash
# Packs TVM (and what it needs beyond a PyTorch image) into .gpu/ for a GPU machine that cannot reach
# a package registry and takes at most 64 MiB of files: the cp312 wheels are unpacked, trimmed
# (CUTLASS headers, the web runtime and TVM's C++ sources are not needed to build and run), the
# 250 MB compiler library is xz-compressed with the x86 filter, and .gpu/setup.sh unpacks it all
# under /tmp/site there.  Usage (here):  scripts/device_bundle.sh [PYTHON_VERSION]   (default 3.12)
# There:  source .gpu/setup.sh && python scripts/gpu_check.py ...
# .gpu/ is ~65 MB: keep it out of git (.git/info/exclude) and move tuning_logs/ aside before a run
# so the working tree fits.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-3.12}"
PY_TAG="cp${PY/./}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --abi "$PY_TAG" --abi abi3 --abi none \
    -d "$WORK/wheels" \
    "apache-tvm==$(python3 -c 'import importlib.metadata as m; print(m.version("apache-tvm"))' 2>/dev/null || echo 0.27.0.post1)" \
    apache-tvm-ffi==0.1.14.post0 xgboost-cpu

mkdir -p "$WORK/site"
for wheel in "$WORK"/wheels/*.whl; do unzip -q -o "$wheel" -d "$WORK/site"; done
rm -rf "$WORK"/site/tvm/3rdparty/cutlass "$WORK"/site/tvm/web "$WORK"/site/tvm/src "$WORK"/site/xgboost/include
mv "$WORK/site/tvm/lib/libtvm_compiler.so" "$WORK/libtvm_compiler.so"

rm -rf .gpu && mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
tar -C "$WORK/site" -cf - . | xz --x86 --lzma2=preset=9e -T1 > .gpu/bundle.tar.xz
xz --x86 --lzma2=preset=9e,dict=256MiB -T1 -c "$WORK/libtvm_compiler.so" > .gpu/lt.xz
cat > .gpu/setup.sh <<'EOF'
# source me on the GPU machine: TVM under /tmp/site, on PYTHONPATH
if [ ! -f /tmp/site/tvm/lib/libtvm_compiler.so ]; then
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/bundle.tar.xz \
        && xz -dc .gpu/lt.xz > /tmp/site/tvm/lib/libtvm_compiler.so
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
EOF
du -sh .gpu/*
