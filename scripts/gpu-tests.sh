#!/usr/bin/env bash
# The GPU lane: the tests marked `gpu` (tests/test_gpu_lane.py), the commands end to end on a CUDA device with
# that machine's own CUDA torch. Run it whenever the engine (engine/, replay/) changes; CONTRIBUTING.md says when.
#
#   bash scripts/gpu-tests.sh                    on a CUDA machine with a package index: installs the project with
#                                                its test and hybrid extras next to the torch there, runs the lane
#   bash scripts/gpu-tests.sh bundle DIR [FREEZE]   on a machine with PyPI and npm: everything an offline CUDA
#                                                machine lacks (FREEZE: `python -m pip freeze` there), into DIR:
#                                                DIR/wheels (dependencies, setuptools to build the project there)
#                                                and DIR/tokenizers (the real Qwen3 tokenizer the lane loads)
#                                                (scripts/gpu_wheels.py says which wheels and why)
#   bash scripts/gpu-tests.sh offline DIR        on the offline CUDA machine, in this checkout: installs DIR's
#                                                wheels and this checkout into DIR/site (no index, no dependency
#                                                resolution, no build isolation) and runs the lane with DIR/site
#                                                ahead of the machine's own packages
#
# Extra arguments after these go to pytest. PYTHON names the interpreter (default python3). The lane imports the
# installed package, never this checkout's folders (PYTHONSAFEPATH keeps the working directory off sys.path):
# engine/, checks/ and app/ live inside dflash_doctor only once installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"

run_lane() {
    export PYTHONSAFEPATH=1
    "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "the GPU lane needs a CUDA device: torch " + torch.__version__ + " sees none")'
    # several workers share the one GPU: most of a test's time is its commands' start-up (imports, the compiled
    # divergence columns), not GPU work (12 tests took over 10 minutes on one worker on an H200)
    "$python" -m pytest -m gpu -q -p no:cacheprovider -n "${GPU_LANE_WORKERS:-4}" --durations=15 tests/test_gpu_lane.py "$@"
}

case "${1:-}" in
    bundle)
        dir="${2:?bundle needs a folder: bash scripts/gpu-tests.sh bundle DIR [FREEZE]}"
        freeze="${3:-}"
        mkdir -p "$dir/wheels"
        python3 scripts/gpu_wheels.py "$dir/wheels" ${freeze:+"$freeze"}
        DFLASH_DOCTOR_TEST_TOKENIZERS="$dir/tokenizers" bash tests/fetch_tokenizers.sh
        rm -rf "$dir/tokenizers/llama3_1"  # the lane loads the Qwen3 tokenizer only
        du -sh "$dir"/*
        ;;
    offline)
        dir="$(cd "${2:?offline needs the bundle: bash scripts/gpu-tests.sh offline DIR}" && pwd)"
        shift 2
        rm -rf "$dir/site"
        "$python" -m pip install -q --no-index --no-deps --target "$dir/site" "$dir"/wheels/*.whl
        export PYTHONPATH="$dir/site${PYTHONPATH:+:$PYTHONPATH}" DFLASH_DOCTOR_TEST_TOKENIZERS="$dir/tokenizers"
        "$python" -m pip install -q --no-index --no-deps --no-build-isolation --target "$dir/site/.project" .
        export PYTHONPATH="$dir/site/.project:$PYTHONPATH"
        export PATH="$dir/site/bin:$PATH"
        run_lane "$@"
        ;;
    *)
        "$python" -m pip install -q ".[test,hybrid]"
        run_lane "$@"
        ;;
esac
