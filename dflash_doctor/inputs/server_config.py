"""Read how a serving engine is configured for speculation: vLLM, SGLang or llama.cpp settings.

``--engine-config FILE`` accepts what people already have at hand: a vLLM ``speculative_config`` JSON,
a larger vLLM JSON that contains one (engine args, a saved config), or a launch command line / flags
text for SGLang (``--speculative-num-draft-tokens 16 --attention-backend fa3``), vLLM
(``--speculative-config '{...}'``) or llama-server (``--spec-type draft-dflash --spec-draft-n-max 15``).
``--engine-config http://HOST:PORT`` reads a running llama-server instead: ``/props`` and ``/metrics``.
Everything is normalised into one dict so the rules in rules.toml can ask about K and attention backends
without caring which engine wrote them.

The engines count K differently (docs/engines.md#how-each-engine-counts-k): vLLM's ``num_speculative_tokens`` is the
number of drafted tokens (B - 1 for a DFlash block of B), SGLang's ``--speculative-num-draft-tokens``
counts the block including its root (B), llama.cpp's ``--spec-draft-n-max`` counts drafted tokens like
vLLM but defaults to 3 (common/common.h) and is clamped to B - 1 for DFlash (common/speculative.cpp).
``drafted_tokens`` is the engine-independent count.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from dflash_doctor.errors import UsageError

_SGLANG_MARKERS = ("--speculative-num-draft-tokens", "--speculative-algorithm", "--speculative-draft-model-path")
_VLLM_MARKERS = ("--speculative-config", "--speculative_config")
_LLAMACPP_MARKERS = ("--spec-type", "--spec-draft-n-max", "--spec-draft-model", "--model-draft")
LLAMACPP_DEFAULT_N_MAX = 3  # llama.cpp common/common.h common_params_speculative_draft::n_max


def is_server_url(spec: str | Path) -> bool:
    """``--engine-config`` names a running server (read by :mod:`dflash_doctor.serving.server_settings`), not a file."""
    return str(spec).startswith(("http://", "https://"))


def parse_server_config(path: str | Path) -> dict[str, Any]:
    """Parse ``--engine-config FILE`` (JSON or flags text) into the normalised engine dict."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(
            f"--engine-config {path} does not exist; pass a vLLM "
            "speculative_config JSON or a file with SGLang launch flags."
        )
    text = path.read_text(encoding="utf-8")
    return parse_server_config_text(text, source=str(path))


def parse_server_config_text(text: str, source: str = "<text>") -> dict[str, Any]:
    """Parse JSON (vLLM) or command-line flags (SGLang or vLLM) into the normalised engine dict."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"--engine-config {source} looks like JSON but does not parse ({exc}); fix the file."
            ) from None
        return _from_vllm_json(data, source)
    flags = _parse_flags(text, source)
    if any(marker.lstrip("-").replace("-", "_") in flags for marker in _VLLM_MARKERS):
        return _from_vllm_flags(flags, source)
    if any(marker.lstrip("-").replace("-", "_") in flags for marker in _SGLANG_MARKERS):
        return _from_sglang_flags(flags, source)
    if any(marker.lstrip("-").replace("-", "_") in flags for marker in _LLAMACPP_MARKERS):
        n_max = _int_or_none(flags.get("spec_draft_n_max"), "--spec-draft-n-max", source)
        return llamacpp_settings(
            flags.get("spec_type"),
            flags.get("spec_draft_model") or flags.get("model_draft"),
            LLAMACPP_DEFAULT_N_MAX if n_max is None else n_max,
            source,
        )
    raise UsageError(
        f"--engine-config {source} has neither a vLLM speculative_config nor SGLang --speculative-* flags; "
        "pass the JSON given to --speculative-config, the SGLang launch flags or llama-server's --spec-* flags."
    )


def _parse_flags(text: str, source: str) -> dict[str, Any]:
    """``--name value`` / ``--name=value`` / bare ``--flag`` into {name_with_underscores: value or True}."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise UsageError(f"--engine-config {source} is not valid shell-style flags ({exc}); fix the quoting.") from None
    flags: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            continue
        name, has_value, value = token[2:].partition("=")
        if not has_value:
            if i < len(tokens) and not tokens[i].startswith("--"):
                value = tokens[i]
                i += 1
            else:
                value = True
        flags[name.replace("-", "_")] = value
    return flags


def _int_or_none(value: Any, name: str, source: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"--engine-config {source}: {name} = {value!r} is not an integer; fix the value.") from None


def _normalise_method(method: Any) -> str | None:
    return None if method is None else str(method).lower()


def _from_vllm_json(data: dict[str, Any], source: str) -> dict[str, Any]:
    speculative = data.get("speculative_config", data)
    if isinstance(speculative, str):
        try:
            speculative = json.loads(speculative)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"--engine-config {source}: speculative_config is a string that is not JSON ({exc}); fix it."
            ) from None
    if not isinstance(speculative, dict) or not ({"num_speculative_tokens", "method", "model"} & speculative.keys()):
        raise UsageError(
            f"--engine-config {source} has no speculative_config (num_speculative_tokens "
            "/ method / model); pass the vLLM speculative_config JSON."
        )
    outer = data if "speculative_config" in data else {}
    attention = (
        outer.get("attention_backend")
        or (outer.get("attention_config") or {}).get("backend")
        or (outer.get("env") or {}).get("VLLM_ATTENTION_BACKEND")
    )
    compilation = outer.get("compilation_config") or {}
    cudagraph_mode = str(compilation.get("cudagraph_mode", "")).upper() if isinstance(compilation, dict) else ""
    cuda_graphs = not outer.get("enforce_eager", False) and cudagraph_mode != "NONE"
    return _vllm_result(speculative, attention, cuda_graphs, source)


def _from_vllm_flags(flags: dict[str, Any], source: str) -> dict[str, Any]:
    raw = flags.get("speculative_config")
    try:
        speculative = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        speculative = None
    if not isinstance(speculative, dict):
        raise UsageError(
            f"--engine-config {source}: --speculative-config must be "
            "followed by a JSON object; quote it with single quotes."
        )
    cuda_graphs = not flags.get("enforce_eager", False)
    return _vllm_result(speculative, flags.get("attention_backend"), cuda_graphs, source)


def _vllm_result(speculative: dict[str, Any], attention: Any, cuda_graphs: bool, source: str) -> dict[str, Any]:
    k = _int_or_none(speculative.get("num_speculative_tokens"), "num_speculative_tokens", source)
    return {
        "engine": "vllm",
        "source": source,
        "method": _normalise_method(speculative.get("method")),
        "draft_model": speculative.get("model"),
        "num_speculative_tokens": k,
        "drafted_tokens": k,
        "attention_backend": None if attention is None else str(attention).upper(),
        "draft_attention_backend": None if attention is None else str(attention).upper(),
        "cuda_graphs": bool(cuda_graphs),
        "draft_sample_method": _draft_sample_method(speculative.get("draft_sample_method"), source),
    }


def _draft_sample_method(value: Any, source: str) -> str:
    """vLLM's ``draft_sample_method``: ``greedy`` (its default) or ``probabilistic``."""
    method = "greedy" if value is None else str(value).lower()
    if method not in ("greedy", "probabilistic"):
        raise UsageError(
            f"--engine-config {source}: draft_sample_method {value!r} is not greedy or probabilistic; fix the value."
        )
    return method


def _from_sglang_flags(flags: dict[str, Any], source: str) -> dict[str, Any]:
    num_draft_tokens = _int_or_none(flags.get("speculative_num_draft_tokens"), "--speculative-num-draft-tokens", source)
    attention = flags.get("attention_backend")
    draft_attention = flags.get("speculative_draft_attention_backend") or attention
    return {
        "engine": "sglang",
        "source": source,
        "method": _normalise_method(flags.get("speculative_algorithm")),
        "draft_model": flags.get("speculative_draft_model_path"),
        "speculative_num_draft_tokens": num_draft_tokens,
        "drafted_tokens": None if num_draft_tokens is None else num_draft_tokens - 1,
        "dflash_block_size": _int_or_none(
            flags.get("speculative_dflash_block_size"), "--speculative-dflash-block-size", source
        ),
        "attention_backend": None if attention is None else str(attention).lower(),
        "draft_attention_backend": None if draft_attention is None else str(draft_attention).lower(),
        "cuda_graphs": not flags.get("disable_cuda_graph", False),
        "draft_sample_method": "greedy",  # SGLang scores drafts by their argmax
    }


def llamacpp_settings(spec_type: Any, draft_model: Any, n_max: int | None, source: str) -> dict[str, Any]:
    """llama-server's settings; ``spec_type`` as given to ``--spec-type`` (``draft-dflash``, ``draft-simple``...)."""
    kind = None if spec_type is None else str(spec_type).lower()
    return {
        "engine": "llamacpp",
        "source": source,
        "method": None if kind is None else kind.removeprefix("draft-"),
        "draft_model": draft_model,
        "spec_draft_n_max": n_max,
        "drafted_tokens": n_max,
        "draft_sample_method": "greedy",  # llama.cpp drafts each position's most likely token (top-k 10, first)
    }
