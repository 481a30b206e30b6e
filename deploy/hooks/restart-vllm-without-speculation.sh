#!/bin/sh
# `dflash-doctor watch --on-alert` hook: serve without speculation when acceptance collapses or no longer pays.
#
# vLLM runs as vllm.service and reads its speculative flags from an environment file:
#   [Service]
#   EnvironmentFile=/etc/vllm/spec.env          # VLLM_SPEC_ARGS=--speculative-config={"method":"dflash",...}
#   ExecStart=/opt/vllm/bin/vllm serve Qwen/Qwen3-8B $VLLM_SPEC_ARGS
# /etc/vllm/spec-off.env holds `VLLM_SPEC_ARGS=`; the watch's user may run exactly the two commands below
# (sudoers: `dflash-doctor ALL=(root) NOPASSWD: /usr/bin/cp /etc/vllm/spec-off.env /etc/vllm/spec.env,
# /usr/bin/systemctl restart vllm.service`). Undo by hand once `dflash-doctor check` says the pair is healthy.
# The watch runs this once per alert episode with DFLASH_DOCTOR_* in the environment (docs/production.md, "Alert -> hook");
# try it with --on-alert-dry-run first.
set -eu

case "$DFLASH_DOCTOR_ALERT" in
    collapse|fallback) ;;   # acceptance-drop, position-decay, k-changed: a human decides; drafting-stopped: already off
    *) exit 0 ;;
esac

logger -t dflash-doctor "falling back to plain decoding for $DFLASH_DOCTOR_MODEL: $DFLASH_DOCTOR_MESSAGE"
printf '%s\n' "$DFLASH_DOCTOR_ADVICE" | logger -t dflash-doctor
sudo -n /usr/bin/cp /etc/vllm/spec-off.env /etc/vllm/spec.env
sudo -n /usr/bin/systemctl restart vllm.service
