#!/usr/bin/env bash
# pyright (basic mode, pyrightconfig.json) over dflash_doctor/, engine/, checks/ and app/.
# engine/, checks/ and app/ are mapped into the package by pyproject's package-dir, which a static
# checker cannot follow through the editable install; build/typecheck/ holds links that spell the
# package as it is imported (dflash_doctor/engine -> engine/ ...), and pyrightconfig.json's
# extraPaths points there.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck/dflash_doctor
rm -rf build/typecheck && mkdir -p "$tree"
for item in dflash_doctor/*; do ln -s "$PWD/$item" "$tree/"; done
for folder in engine checks app; do ln -s "$PWD/$folder" "$tree/$folder"; done
exec .venv/bin/pyright "$@"
