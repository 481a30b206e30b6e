#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (CPU) from source for the tests marked `llamacpp`: the llama.cpp that
# the PyPI sdist of llama-cpp-python vendors (vendor/llama.cpp, MIT), never a downloaded binary. The same
# source tree gives convert_hf_to_gguf.py, which writes the demo pair's GGUF files (tests/llama_server.py).
# The result lands in .llama-cpp/<version>/ (gitignored); a second run with that version's binary already
# built does nothing. Only the llama-server target is compiled; the web UI is neither built nor fetched.
# The build costs about 10 CPU-minutes (measured twice on this project's 2 cores; docs/llamacpp.md).
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
root=".llama-cpp/$version"
if [[ -x "$root/bin/llama-server" && -f "$root/llama.cpp/convert_hf_to_gguf.py" ]]; then
    exit 0
fi
rm -rf "$root"
mkdir -p "$root"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Only pip's download is needed (PyPI only), so this runs before and beside setup-dev.sh's .venv: the
# system Python's pip, or, where it has none, pip in a throwaway environment.
python=python3
if ! python3 -m pip --version >/dev/null 2>&1; then
    python3 -m venv "$work/pip"
    python="$work/pip/bin/python"
fi
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$root/llama.cpp"
# GGML_NATIVE=OFF: the portable x86-64 baseline (SSE4.2, AVX2, FMA, F16C, BMI2), not every extension the build
# host's CPUID reports. CI once saw every llama-server start die with SIGSEGV before answering (even without a
# draft) while the same source built natively on an AMD EPYC with AVX-512 ran 25 starts cleanly; the cause was
# not found, and the host-specific AVX-512 / AMX kernels a native build selects are the part that differs
# between hosts. A 135M-parameter test model loses little without them.
cmake -S "$root/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
cmake --build "$root/build" --target llama-server -j "$(nproc)"
mkdir -p "$root/bin"
cp "$root/build/bin/llama-server" "$root/bin/llama-server"
rm -rf "$root/build"
