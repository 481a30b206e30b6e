"""chat-template-parity: does the server build prompts the way the draft saw them in training?

A draft learns the target's continuation of prompts in one exact format. If serving renders another
system prompt, another generation prompt, other whitespace, or thinking tags the draft never saw, its
first tokens after the prompt are wrong and acceptance drops (thinking mismatch: z-lab #133 25% -> 60%
when fixed, #60; templates: EAGLE README, vLLM #42508, ATOM #609). The check renders canonical
conversations with both templates in transformers' sandboxed Jinja renderer (the one the server uses)
and shows the first differing bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, register, skipped
from dflash_doctor.checks.tokenizer_parity import special_tokens

USER_TEXT = "What is 17 * 23? Answer briefly."
SYSTEM_TEXT = "You are a careful assistant."
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "single-turn": [{"role": "user", "content": USER_TEXT}],
    "system+user": [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": USER_TEXT}],
    "multi-turn": [
        {"role": "user", "content": USER_TEXT},
        {"role": "assistant", "content": "391."},
        {"role": "user", "content": "And 17 * 24?"},
    ],
}
THINKING_TAGS = ("<think>", "</think>", "<thinking>", "<|channel|>analysis")
DIFF_CONTEXT_CHARS = 24


@dataclass(frozen=True)
class TemplateSide:
    """A template and the special tokens it renders with (from its tokenizer when one is known)."""

    name: str
    template: str
    tokenizer: Any = None
    bos_token: str = ""
    eos_token: str = ""

    def render(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        enable_thinking: bool | None,
        tools: list | None = None,
    ) -> str:
        """Render like ``apply_chat_template(tokenize=False)``; a template error is returned as a marker."""
        extra: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except Exception as exc:  # a template may refuse a case (e.g. no system role): that is an output too
            return f"<template error: {exc}>"
        return rendered[0]


@register
@dataclass(frozen=True)
class ChatTemplateParity(Check):
    """The served chat template renders canonical conversations byte-identically to the draft's template.

    Compares the served (target) template with the draft's shipped template and with the template the
    draft was trained with, when recorded. Any differing render fails; the findings also call out an
    injected default system prompt, thinking tags on one side only, and a BOS written by the template
    while the tokenizer adds another.
    """

    id = "chat-template-parity"
    title = "Chat template parity"
    needs = ("target_template|target_tokenizer", "draft_template|draft_training_template|draft_tokenizer")

    target_enable_thinking: bool | None = None  # pin the served side (None: render both ways on both sides)
    draft_enable_thinking: bool | None = None  # pin the draft side, e.g. how it was trained
    max_examples: int = 3  # differing renders quoted per comparison

    def run(self, ctx: CheckContext) -> CheckResult:
        target = _side("served", ctx.target_template, ctx.target_tokenizer, ctx.draft_tokenizer)
        if target is None:
            return skipped(self.id, "the target tokenizer has no chat template and none was given")
        others = [
            _side("draft", ctx.draft_template, ctx.draft_tokenizer, ctx.target_tokenizer),
            _side("draft training", ctx.draft_training_template, None, ctx.draft_tokenizer or ctx.target_tokenizer),
        ]
        others = [side for side in others if side is not None]
        if not others:
            return skipped(self.id, "the draft has no chat template and no recorded training template")

        findings: list[Finding] = []
        metrics: dict[str, Any] = {"comparisons": {}}
        for side in [target, *others]:
            findings += double_bos_findings(side)
        for other in others:
            comparison = compare_templates(target, other, self.target_enable_thinking, self.draft_enable_thinking)
            metrics["comparisons"][other.name] = {k: v for k, v in comparison.items() if k != "differences"}
            findings += self._difference_findings(target, other, comparison)
            findings += injected_system_findings(target, other)
        return CheckResult.from_findings(
            self.id, findings, metrics, "templates render every canonical conversation identically"
        )

    def _difference_findings(
        self, target: TemplateSide, other: TemplateSide, comparison: dict[str, Any]
    ) -> list[Finding]:
        differences = comparison["differences"]
        if not differences:
            return []
        first = differences[0]
        findings = [
            Finding(
                "fail",
                f"{target.name} and {other.name} templates differ in "
                f"{len(differences)}/{comparison['num_cases']} renders "
                f"(first: {first['case']} at byte {first['byte_offset']})",
                " | ".join(
                    f"{d['case']} @byte {d['byte_offset']}: {target.name} {d['a']!r} vs {other.name} {d['b']!r}"
                    for d in differences[: self.max_examples]
                ),
                f"serve with the {other.name} template (--chat-template), or retrain the draft on the served format",
            )
        ]
        thinking = [d for d in differences if d["thinking_tags_a"] != d["thinking_tags_b"]]
        if thinking:
            d = thinking[0]
            findings.append(
                Finding(
                    "fail",
                    f"thinking tags differ between {target.name} and {other.name} renders ({d['case']})",
                    f"{target.name} tags {d['thinking_tags_a']} vs {other.name} tags {d['thinking_tags_b']}",
                    "serve with the enable_thinking setting the draft was trained with (z-lab #133, #60)",
                )
            )
        return findings


def _side(name: str, template: str | None, tokenizer: Any, fallback_tokenizer: Any) -> TemplateSide | None:
    """A template side; special tokens come from its own tokenizer, else the other side's."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    source = tokenizer if tokenizer is not None else fallback_tokenizer
    return TemplateSide(
        name=name,
        template=template,
        tokenizer=tokenizer,
        bos_token=getattr(source, "bos_token", None) or "",
        eos_token=getattr(source, "eos_token", None) or "",
    )


@dataclass(frozen=True)
class RenderCase:
    """One canonical input: a conversation, the generation-prompt flag, enable_thinking and tools."""

    conversation: str
    add_generation_prompt: bool
    enable_thinking: bool | None = None
    tools: tuple[dict[str, Any], ...] | None = None

    def render(self, side: TemplateSide) -> str:
        return side.render(
            CONVERSATIONS[self.conversation],
            self.add_generation_prompt,
            self.enable_thinking,
            list(self.tools) if self.tools else None,
        )


def render_cases(a: TemplateSide, b: TemplateSide) -> list[RenderCase]:
    """The canonical cases both sides are rendered on.

    Every conversation is rendered with and without the generation prompt; tools only when either
    template mentions them; enable_thinking both ways when either template reads it.
    """
    uses_thinking = any("enable_thinking" in side.template for side in (a, b))
    thinking_values: tuple[bool | None, ...] = (True, False) if uses_thinking else (None,)
    cases = [
        RenderCase(conversation, generation_prompt, thinking)
        for conversation in CONVERSATIONS
        for generation_prompt in (True, False)
        for thinking in thinking_values
    ]
    if any("tools" in side.template for side in (a, b)):
        cases.append(RenderCase("single-turn", True, thinking_values[0], (TOOL,)))
    return cases


def _label(case_a: RenderCase, case_b: RenderCase, a: TemplateSide, b: TemplateSide) -> str:
    name = ("tools" if case_a.tools else case_a.conversation) + f" gen={case_a.add_generation_prompt}"
    if case_a.enable_thinking == case_b.enable_thinking:
        return name + ("" if case_a.enable_thinking is None else f" thinking={case_a.enable_thinking}")
    return name + f" thinking {a.name}={case_a.enable_thinking} {b.name}={case_b.enable_thinking}"


def compare_templates(
    a: TemplateSide, b: TemplateSide, thinking_a: bool | None = None, thinking_b: bool | None = None
) -> dict[str, Any]:
    """Render every case with both sides; list the cases whose outputs differ, with the first differing bytes.

    ``thinking_a`` / ``thinking_b`` pin one side's enable_thinking (e.g. the draft's training setting)
    whatever the case says, which is how a serving/training thinking mismatch is reproduced.
    """
    differences = []
    pairs = []
    for case in render_cases(a, b):
        case_a = case if thinking_a is None else replace(case, enable_thinking=thinking_a)
        case_b = case if thinking_b is None else replace(case, enable_thinking=thinking_b)
        if (case_a, case_b) not in pairs:
            pairs.append((case_a, case_b))
    for case_a, case_b in pairs:
        text_a, text_b = case_a.render(a), case_b.render(b)
        if text_a != text_b:
            differences.append(
                {
                    "case": _label(case_a, case_b, a, b),
                    **first_difference(text_a, text_b),
                    "thinking_tags_a": _tags(text_a),
                    "thinking_tags_b": _tags(text_b),
                }
            )
    return {
        "num_cases": len(pairs),
        "num_different": len(differences),
        "differences": differences,
        "different_cases": [d["case"] for d in differences],
    }


def _tags(text: str) -> dict[str, int]:
    return {tag: text.count(tag) for tag in THINKING_TAGS if tag in text}


def first_difference(a: str, b: str) -> dict[str, Any]:
    """Where two renders first differ: UTF-8 byte offset, and a window of each starting a little before."""
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, index - DIFF_CONTEXT_CHARS)
    return {
        "byte_offset": len(a[:index].encode("utf-8")),
        "a": a[start : index + DIFF_CONTEXT_CHARS],
        "b": b[start : index + DIFF_CONTEXT_CHARS],
    }


def injected_system_prompt(side: TemplateSide) -> str | None:
    """The system section a template writes when the conversation has none, or None.

    Role headers name the role ("<|im_start|>system", "<|start_header_id|>system"), so a single-turn
    render that mentions "system" carries a default system prompt; the evidence is everything the
    render puts before the user's text.
    """
    rendered = side.render(CONVERSATIONS["single-turn"], False, None)
    user_at = rendered.find(USER_TEXT)
    if user_at < 0 or "system" not in rendered[:user_at]:
        return None
    return rendered[:user_at]


def injected_system_findings(target: TemplateSide, other: TemplateSide) -> list[Finding]:
    """Call out default system prompts; warn when only one side injects one (or they inject different ones)."""
    injected = {side.name: injected_system_prompt(side) for side in (target, other)}
    findings = []
    for side in (target, other):
        text = injected[side.name]
        if text is None:
            continue
        same = injected[target.name] == injected[other.name]
        findings.append(
            Finding(
                "info" if same else "warn",
                f"{side.name} template injects a default system prompt when the conversation has none",
                repr(text[:200]),
                "harmless when both sides inject the same text"
                if same
                else "train and serve with the same default system prompt, or pass an explicit system message",
            )
        )
    return findings


def double_bos_findings(side: TemplateSide) -> list[Finding]:
    """Warn when the template writes BOS and the side's tokenizer adds another on encode."""
    if side.tokenizer is None or not side.bos_token:
        return []
    rendered = side.render(CONVERSATIONS["single-turn"], True, None)
    if not rendered.startswith(side.bos_token) or not special_tokens(side.tokenizer)["add_bos"]:
        return []
    return [
        Finding(
            "warn",
            f"{side.name} template writes {side.bos_token!r} and its tokenizer adds another: double BOS",
            f"render starts with {rendered[:40]!r}; tokenizer.encode adds bos id {side.tokenizer.bos_token_id}",
            "encode rendered chats with add_special_tokens=False (as "
            "apply_chat_template does), or drop bos_token from the template",
        )
    ]
