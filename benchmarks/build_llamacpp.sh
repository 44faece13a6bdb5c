#!/usr/bin/env bash
# Build llama.cpp's own command-line tools (llama-bench, llama-batched-bench, llama-quantize,
# llama-perplexity, and llama-server for the serving workload) from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI, so that
# the benchmarks can run llama.cpp at its best: its own quantizations and its own parallel
# decoding, not one request at a time through the Python bindings.
#
#   bash benchmarks/build_llamacpp.sh [OUT_DIR]      # default: .cache/llamacpp
#
# Needs cmake and a C++ compiler; CPU build with the host's native instructions, but AMX unless
# LLAMACPP_AMX=1: on the Xeon of the 2026-12-02 report (AMX reported, tiles usable by a probe of
# our own) llama.cpp's AMX matmul died with a general-protection fault in its ldtilecfg on
# every batched call (prompts, parallel decoding, llama-server), only its F32 file surviving.
# Prints the directory holding the binaries. Idempotent: a finished build with the same flags
# is reused. llama-server is built last and is optional: a build without it still serves the
# offline and batch-1 benchmarks.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="$(realpath -m "${1:-.cache/llamacpp}")"
BIN="$OUT/build/bin"
mkdir -p "$OUT"
FLAGS=""
if grep -q amx_tile /proc/cpuinfo && [[ "${LLAMACPP_AMX:-0}" != 1 ]]; then
    FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
if [[ -x "$BIN/llama-batched-bench" && -x "$BIN/llama-bench" && -x "$BIN/llama-quantize" \
      && -x "$BIN/llama-server" && "$(cat "$OUT/build/kvslim-flags" 2>/dev/null)" == "$FLAGS" ]]; then
    echo "$BIN"
    exit 0
fi
if [[ ! -d "$OUT/src" ]]; then
    python3 -m pip download --quiet --no-deps --no-binary :all: -d "$OUT/sdist" \
        "llama-cpp-python==$VERSION" >&2
    tar -xzf "$OUT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$OUT"
    mv "$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp" "$OUT/src"
    rm -rf "$OUT/llama_cpp_python-$VERSION"
fi
cmake -S "$OUT/src" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" >&2
cmake --build "$OUT/build" -j "$(nproc)" \
    --target llama-bench llama-batched-bench llama-quantize llama-perplexity >&2
cmake --build "$OUT/build" -j "$(nproc)" --target llama-server >&2 \
    || echo "build_llamacpp.sh: llama-server did not build; serving runs without it" >&2
echo "$FLAGS" > "$OUT/build/kvslim-flags"
echo "$BIN"
