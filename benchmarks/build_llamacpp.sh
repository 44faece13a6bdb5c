#!/usr/bin/env bash
# Build llama.cpp's own command-line tools (llama-bench, llama-batched-bench, llama-quantize,
# llama-perplexity, and llama-server for the serving workload) from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI, so that
# the benchmarks can run llama.cpp at its best: its own quantizations and its own parallel
# decoding, not one request at a time through the Python bindings.
#
#   bash benchmarks/build_llamacpp.sh [OUT_DIR]      # default: .cache/llamacpp
#
# Needs cmake and a C++ compiler; CPU build with the host's native instructions. Prints the
# directory holding the binaries. Idempotent: a finished build is reused. llama-server is built
# last and is optional: a build without it still serves the offline and batch-1 benchmarks.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="$(realpath -m "${1:-.cache/llamacpp}")"
BIN="$OUT/build/bin"
if [[ -x "$BIN/llama-batched-bench" && -x "$BIN/llama-bench" && -x "$BIN/llama-quantize" \
      && -x "$BIN/llama-server" ]]; then
    echo "$BIN"
    exit 0
fi
mkdir -p "$OUT"
if [[ ! -d "$OUT/src" ]]; then
    python3 -m pip download --quiet --no-deps --no-binary :all: -d "$OUT/sdist" \
        "llama-cpp-python==$VERSION" >&2
    tar -xzf "$OUT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$OUT"
    mv "$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp" "$OUT/src"
    rm -rf "$OUT/llama_cpp_python-$VERSION"
fi
cmake -S "$OUT/src" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$OUT/build" -j "$(nproc)" \
    --target llama-bench llama-batched-bench llama-quantize llama-perplexity >&2
cmake --build "$OUT/build" -j "$(nproc)" --target llama-server >&2 \
    || echo "build_llamacpp.sh: llama-server did not build; serving runs without it" >&2
echo "$BIN"
