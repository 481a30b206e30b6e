"""tokenizer-parity: do the target and the draft speak the same token ids?

Verification compares token ids, so a draft whose tokenizer maps a string to another id proposes tokens
that can never be accepted; a draft trained with another pre-tokeniser (same vocabulary, other splits,
llama.cpp #3502) sees unfamiliar id sequences at serving time; a different BOS convention shifts its
whole context (llama.cpp PR #4025, transformers #31099); and vocab-size confusions
(``config.vocab_size`` vs ``len(tokenizer)`` vs ``tokenizer.vocab_size``, vLLM #7252 / #10913) either
index past the embedding or are harmless padding. For a DFlash draft the mask token must be a real,
reserved embedding row that the target never emits (z-lab #73, PR #109).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypedDict

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register
from dflash_doctor.checks.draft_facts import is_dflash, mask_token_id, output_token_ids

# Texts whose tokenisation exposes pre-tokeniser and normaliser differences: code indentation, runs of
# spaces/tabs/newlines, digit grouping, CJK (no spaces), emoji (multi-byte, ZWJ sequences), accents
# (NFC vs NFD), and chat-ish punctuation.
BUILTIN_CORPUS: tuple[str, ...] = (
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "for (int i = 0; i < n; ++i) {\n        sum += x[i] * 2;\n}",
    "    four spaces, then\t\ttwo tabs, then\n\n\nthree newlines and   trailing   ",
    "1234567890 3.14159 1,000,000 2024-05-17 0x1F 007",
    "The answer is 42. 12345678901234567890",
    "自然语言处理是人工智能的一个重要方向。日本語の文章も試す。한국어 문장.",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✅",
    "Café naïve résumé — \u00e9 vs e\u0301, ﬁ ligature, “quotes” and ‘apostrophes’.",
    "Hello world! How are you?\nI'm fine, thanks. Let's go: (a) [b] {c} <d>.",
    "<|im_start|>user\nliteral special-looking text <s> </s> [INST]<|im_end|>",
)


@register
@dataclass(frozen=True)
class TokenizerParity(Check):
    """Target and draft tokenizers map text to the same ids (and a DFlash mask id is a reserved row).

    Fails when shared token strings map to different ids, when bos/eos differ, when a tokenizer can
    produce ids beyond its model's embedding, when corpus round-trips disagree too often, or when a
    DFlash mask id is out of range, a bos/eos/pad id, or was produced by the target. Warns on added
    tokens present on one side only, add_bos/add_eos differences and pipeline (normaliser,
    pre-tokeniser, post-processor, decoder) differences.
    """

    id = "tokenizer-parity"
    title = "Tokenizer parity"
    needs = ("target_tokenizer", "draft_tokenizer|draft_config")

    max_examples: int = 5  # differing examples quoted per finding
    round_trip_warn_below: float = 1.0  # share of corpus texts with identical ids below which we warn
    round_trip_fail_below: float = 0.95  # ... and below which we fail

    def run(self, ctx: CheckContext) -> CheckResult:
        target, draft = ctx.target_tokenizer, ctx.draft_tokenizer
        findings: list[Finding] = []
        metrics: dict[str, Any] = {}
        metrics["vocab_sizes"] = {"target": vocab_sizes(target, ctx.target_config)}
        findings += vocab_size_findings("target", metrics["vocab_sizes"]["target"])
        if draft is not None:
            metrics["vocab_sizes"]["draft"] = vocab_sizes(draft, ctx.draft_config)
            findings += vocab_size_findings("draft", metrics["vocab_sizes"]["draft"])
            findings += self._compare(target, draft, ctx.corpus or [], metrics)
        elif is_dflash(ctx):
            findings.append(
                Finding(
                    "info",
                    "no draft tokenizer given: a DFlash draft embeds and decodes "
                    "with the target's, so only its mask token is checked",
                )
            )
        if is_dflash(ctx):
            findings += mask_token_findings(ctx, metrics)
        pass_summary = (
            "tokenizers agree on ids, special tokens and the corpus round-trip"
            if draft is not None
            else f"DFlash mask token {metrics.get('mask_token_id')} is a reserved row of the target embedding"
            if is_dflash(ctx)
            else (
                "the target tokenizer's ids fit its embedding (the draft ships no tokenizer: it reads the target's ids)"
            )
        )
        return CheckResult.from_findings(self.id, findings, metrics, pass_summary)

    def _compare(self, target: Any, draft: Any, workload_texts: list[str], metrics: dict[str, Any]) -> list[Finding]:
        findings: list[Finding] = []
        sizes = metrics["vocab_sizes"]
        target_rows, draft_rows = sizes["target"]["config_vocab_size"], sizes["draft"]["config_vocab_size"]
        if target_rows is not None and draft_rows is not None and target_rows != draft_rows:
            findings.append(
                Finding(
                    "fail",
                    f"embedding sizes differ: target config.vocab_size {target_rows} vs draft {draft_rows}",
                    "verification compares logits over the same vocabulary rows (vLLM #7252, #10913)",
                    "use a draft trained for this target's vocabulary (same tokenizer and vocab_size)",
                )
            )

        identity = vocab_identity(target.get_vocab(), draft.get_vocab(), self.max_examples)
        metrics["vocab_identity"] = identity
        if identity["num_different_id"]:
            findings.append(
                Finding(
                    "fail",
                    f"{identity['num_different_id']} of {identity['num_shared']} "
                    "shared token strings map to different ids",
                    "; ".join(f"{t!r}: target {a} vs draft {b}" for t, a, b in identity["different_id_examples"]),
                    "the draft was built for another tokenizer: use a draft trained with the target's tokenizer",
                )
            )
        for side, other, key in (("target", "draft", "only_in_target"), ("draft", "target", "only_in_draft")):
            if identity[f"num_{key}"]:
                findings.append(
                    Finding(
                        "warn",
                        f"{identity[f'num_{key}']} tokens exist only in the {side} tokenizer",
                        ", ".join(repr(t) for t in identity[f"{key}_examples"]),
                        f"the {other} can never propose or accept these ids; align the tokenizers (added tokens?)",
                    )
                )

        target_special, draft_special = special_tokens(target), special_tokens(draft)
        metrics["special_tokens"] = {"target": target_special, "draft": draft_special}
        for name in ("bos", "eos", "pad", "unk"):
            a, b = target_special[f"{name}_token_id"], draft_special[f"{name}_token_id"]
            if a != b:
                generation_relevant = name in ("bos", "eos")
                findings.append(
                    Finding(
                        "fail" if generation_relevant else "info",
                        f"{name} token differs: target {a} ({target_special[f'{name}_token']!r}) "
                        f"vs draft {b} ({draft_special[f'{name}_token']!r})",
                        "a draft trained with another bos/eos conditions on, and stops at, other ids"
                        if generation_relevant
                        else f"{name} never reaches the model during greedy decoding of one sequence",
                        "use the target's tokenizer files for the draft (special_tokens_map / tokenizer_config.json)",
                    )
                )
        for flag in ("add_bos", "add_eos"):
            if target_special[flag] != draft_special[flag]:
                findings.append(
                    Finding(
                        "warn",
                        f"{flag} differs: target {target_special[flag]} vs draft {draft_special[flag]}",
                        f"encoding 'a' adds {target_special['added_prefix']}/{target_special['added_suffix']} "
                        f"(target) vs {draft_special['added_prefix']}/{draft_special['added_suffix']} (draft)",
                        "make both tokenizers add the same special tokens, or the draft sees a missing or doubled BOS",
                    )
                )

        added = added_tokens_diff(target, draft, self.max_examples)
        metrics["added_tokens"] = {k: v for k, v in added.items() if k.startswith("num_")}
        if added["num_only_in_target"] or added["num_only_in_draft"] or added["num_different"]:
            findings.append(
                Finding(
                    "warn",
                    f"added tokens differ: {added['num_only_in_target']} only "
                    f"in target, {added['num_only_in_draft']} only in draft, "
                    f"{added['num_different']} with another id or special flag",
                    f"target only: {added['only_in_target']}; draft only: "
                    f"{added['only_in_draft']}; different: {added['different']}",
                    "add the same tokens (same ids, same special flag) to both tokenizers",
                )
            )

        parts_target, parts_draft = pipeline_parts(target), pipeline_parts(draft)
        differing_parts = [p for p in parts_target if parts_target[p] != parts_draft.get(p)]
        metrics["pipeline_differences"] = differing_parts
        for part in differing_parts:
            findings.append(
                Finding(
                    "warn",
                    f"tokenizer {part} differs",
                    f"target {_short_json(parts_target[part])} vs draft {_short_json(parts_draft.get(part))}",
                    "use the target's tokenizer.json for the draft: the same "
                    "vocabulary split differently is still a different input",
                )
            )

        texts = list(workload_texts) + list(BUILTIN_CORPUS)
        trip = round_trip(target, draft, texts, self.max_examples)
        metrics["round_trip"] = {k: v for k, v in trip.items() if k != "examples"}
        share = trip["identical_share"]
        if share < self.round_trip_warn_below:
            severity = "fail" if share < self.round_trip_fail_below else "warn"
            findings.append(
                Finding(
                    severity,
                    f"corpus round-trip: {trip['num_identical']}/{trip['num_texts']} "
                    f"texts ({share:.0%}) tokenise to identical ids",
                    " | ".join(trip["examples"]),
                    "the draft sees other id sequences than it was "
                    "trained on: retrain or swap in the target's tokenizer",
                )
            )
        return findings


class VocabSizes(TypedDict):
    """The three vocabulary sizes of one side, as run.json's check metrics record them."""

    config_vocab_size: int | None  # a config may not say
    len_tokenizer: int
    tokenizer_vocab_size: int


def vocab_sizes(tokenizer: Any, model_config: Any) -> VocabSizes:
    """The three sizes that get confused: embedding rows, all tokens, base-vocabulary tokens."""
    return {
        "config_vocab_size": config_value(model_config, "vocab_size"),
        "len_tokenizer": len(tokenizer),
        "tokenizer_vocab_size": int(tokenizer.vocab_size),
    }


def vocab_size_findings(side: str, sizes: VocabSizes) -> list[Finding]:
    """Explain padding and added tokens; fail when the tokenizer can emit ids with no embedding row."""
    findings = []
    rows, total, base = sizes["config_vocab_size"], sizes["len_tokenizer"], sizes["tokenizer_vocab_size"]
    evidence = f"config.vocab_size {rows}, len(tokenizer) {total}, tokenizer.vocab_size {base}"
    if rows is not None and rows < total:
        findings.append(
            Finding(
                "fail",
                f"{side} tokenizer has {total} tokens but its model has only {rows} embedding rows",
                evidence,
                f"ids {rows}..{total - 1} index past the embedding: pair "
                f"the {side} model with the tokenizer it was trained with",
            )
        )
    elif rows is not None and rows > total:
        multiple = next((m for m in (256, 128, 64) if rows % m == 0), None)
        padding = f", padded to a multiple of {multiple}" if multiple else ""
        findings.append(
            Finding(
                "info",
                f"{side} embedding has {rows - total} rows the tokenizer never produces{padding}",
                evidence,
                "harmless padding for kernel efficiency; compare len(tokenizer), not config.vocab_size, between models",
            )
        )
    if total > base:
        findings.append(
            Finding(
                "info",
                f"{side} tokenizer has {total - base} added tokens on top of its {base}-token base vocabulary",
                evidence,
                "tokenizer.vocab_size excludes added tokens; len(tokenizer) is the number of ids it can produce",
            )
        )
    return findings


def vocab_identity(target_vocab: dict[str, int], draft_vocab: dict[str, int], max_examples: int) -> dict[str, Any]:
    """Compare string -> id over whole vocabularies (added tokens included)."""
    shared = target_vocab.keys() & draft_vocab.keys()
    different = sorted((t for t in shared if target_vocab[t] != draft_vocab[t]), key=lambda t: target_vocab[t])
    only_target = sorted(target_vocab.keys() - draft_vocab.keys(), key=lambda t: target_vocab[t])
    only_draft = sorted(draft_vocab.keys() - target_vocab.keys(), key=lambda t: draft_vocab[t])
    return {
        "num_shared": len(shared),
        "num_different_id": len(different),
        "num_only_in_target": len(only_target),
        "num_only_in_draft": len(only_draft),
        "different_id_examples": [(t, target_vocab[t], draft_vocab[t]) for t in different[:max_examples]],
        "only_in_target_examples": only_target[:max_examples],
        "only_in_draft_examples": only_draft[:max_examples],
    }


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """bos/eos/pad/unk tokens and ids, and which special ids encoding actually adds.

    add_bos/add_eos are measured by encoding a one-letter text with and without special tokens,
    because tokenizers declare them in different places (flags, or a TemplateProcessing
    post-processor as in Llama-3).
    """
    facts: dict[str, Any] = {}
    for name in ("bos", "eos", "pad", "unk"):
        facts[f"{name}_token"] = getattr(tokenizer, f"{name}_token", None)
        facts[f"{name}_token_id"] = getattr(tokenizer, f"{name}_token_id", None)
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    start = _find_sub(full, plain)
    prefix, suffix = (full[:start], full[start + len(plain) :]) if start >= 0 else (full, [])
    facts["added_prefix"], facts["added_suffix"] = prefix, suffix
    facts["add_bos"] = bool(prefix) and facts["bos_token_id"] in prefix
    facts["add_eos"] = bool(suffix) and facts["eos_token_id"] in suffix
    return facts


def _find_sub(sequence: list[int], sub: list[int]) -> int:
    for i in range(len(sequence) - len(sub) + 1):
        if sequence[i : i + len(sub)] == sub:
            return i
    return -1


def added_tokens_diff(target: Any, draft: Any, max_examples: int) -> dict[str, Any]:
    """Added tokens by content: present on one side only, or with another id / special flag."""

    def table(tokenizer: Any) -> dict[str, tuple[int, bool]]:
        return {tok.content: (idx, bool(tok.special)) for idx, tok in tokenizer.added_tokens_decoder.items()}

    a, b = table(target), table(draft)
    only_a = sorted(a.keys() - b.keys(), key=lambda t: a[t][0])
    only_b = sorted(b.keys() - a.keys(), key=lambda t: b[t][0])
    different = sorted((t for t in a.keys() & b.keys() if a[t] != b[t]), key=lambda t: a[t][0])
    return {
        "num_only_in_target": len(only_a),
        "num_only_in_draft": len(only_b),
        "num_different": len(different),
        "only_in_target": [(t, a[t][0]) for t in only_a[:max_examples]],
        "only_in_draft": [(t, b[t][0]) for t in only_b[:max_examples]],
        "different": [(t, a[t], b[t]) for t in different[:max_examples]],
    }


PIPELINE_PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model_type")


def pipeline_parts(tokenizer: Any) -> dict[str, Any]:
    """The fast tokenizer's pipeline stages from its tokenizer.json (None where it has no backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {part: None for part in PIPELINE_PARTS}
    spec = json.loads(backend.to_str())
    parts = {part: spec.get(part) for part in PIPELINE_PARTS[:-1]}
    parts["model_type"] = (spec.get("model") or {}).get("type")
    return parts


def _short_json(value: Any, limit: int = 240) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


def round_trip(target: Any, draft: Any, texts: list[str], max_examples: int) -> dict[str, Any]:
    """Encode every text with both tokenizers (no special tokens); count identical id sequences.

    Each example shows the text and the first differing tokens, as token strings, on both sides.
    """
    identical = 0
    examples = []
    for text in texts:
        ids_a = target.encode(text, add_special_tokens=False)
        ids_b = draft.encode(text, add_special_tokens=False)
        if ids_a == ids_b:
            identical += 1
            continue
        if len(examples) < max_examples:
            first = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            pieces_a = target.convert_ids_to_tokens(ids_a[first : first + 4])
            pieces_b = draft.convert_ids_to_tokens(ids_b[first : first + 4])
            examples.append(
                f"{text[:40]!r}: token {first}: target {ids_a[first : first + 4]} "
                f"{pieces_a} vs draft {ids_b[first : first + 4]} {pieces_b}"
            )
    total = len(texts)
    return {
        "num_texts": total,
        "num_identical": identical,
        "identical_share": identical / total if total else 1.0,
        "examples": examples,
    }


def mask_token_findings(ctx: CheckContext, metrics: dict[str, Any]) -> list[Finding]:
    """A DFlash mask id must index a real embedding row that no prompt or output ever contains."""
    mask = mask_token_id(ctx.draft_config)
    if mask is None:
        return [
            Finding(
                "warn",
                "DFlash draft config records no mask_token_id",
                "dflash_config.mask_token_id is missing from the draft's config.json",
                "set dflash_config.mask_token_id to the reserved row the draft was trained with",
            )
        ]
    tokenizer = ctx.target_tokenizer
    rows = config_value(ctx.target_config, "vocab_size") or len(tokenizer)
    metrics["mask_token_id"] = mask
    if not 0 <= mask < rows:
        return [
            Finding(
                "fail",
                f"mask token id {mask} is outside the target embedding (0..{rows - 1})",
                f"target vocab_size {rows}",
                "set dflash_config.mask_token_id to a reserved row below the target's vocab_size",
            )
        ]
    findings = []
    reserved_ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    config_eos = config_value(ctx.target_config, "eos_token_id")
    for eos in config_eos if isinstance(config_eos, list) else [config_eos]:
        if eos is not None and mask == eos:
            reserved_ids["config eos"] = eos
    for name, token_id in reserved_ids.items():
        if token_id is not None and mask == token_id:
            findings.append(
                Finding(
                    "fail",
                    f"mask token id {mask} is the target's {name} token",
                    f"{name}_token_id = {token_id}",
                    "pick a reserved row that is not bos/eos/pad (e.g. Qwen3 151669, Llama-3.1 128002)",
                )
            )
    produced = output_token_ids(ctx)
    if produced is not None and mask in produced:
        findings.append(
            Finding(
                "fail",
                f"mask token id {mask} was produced by the target in this run's outputs",
                "a mask id the model emits collides with real text (z-lab #73)",
                "pick a reserved row the target never generates",
            )
        )
    if mask >= len(tokenizer):
        findings.append(
            Finding(
                "info",
                f"mask token id {mask} is a padding row of the target embedding",
                f"len(tokenizer) {len(tokenizer)} <= {mask} < vocab_size {rows}: the tokenizer never produces it",
            )
        )
    else:
        added = tokenizer.added_tokens_decoder.get(mask)
        text = tokenizer.convert_ids_to_tokens(mask)
        if added is not None and added.special:
            findings.append(Finding("info", f"mask token id {mask} is the reserved special token {text!r}"))
        else:
            findings.append(
                Finding(
                    "warn",
                    f"mask token id {mask} is the ordinary token {text!r}",
                    "text can produce this id, so a prompt or output can contain the mask",
                    "use a reserved special token or a padding row as the mask",
                )
            )
    return findings
