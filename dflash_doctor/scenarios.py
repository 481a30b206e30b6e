"""Reproducible failure scenarios on the real demo pair (``dflash-doctor check --scenario NAME``).

Each scenario reproduces a real incident (REFERENCE.md section 2) by changing ONE thing in how the demo
pair is served, so a newcomer can see what the doctor reports for it and a test can assert that the
checks name the cause and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

from dflash_doctor.config import DoctorConfig
from dflash_doctor.errors import UsageError
from dflash_doctor.workloads import Request

# A ChatML template as a different deployment might ship it: another default system prompt. The draft
# was trained on prompts carrying SmolLM2's own default system prompt (vLLM #42508, ATOM #609).
MISMATCHED_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a concise assistant. Answer in as few words as possible.<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Scenario:
    """``apply`` edits the loaded engine, the requests and the config before the run; ``expect`` names the
    check ids that must report the cause (used by the test and shown by ``--scenario list``)."""

    name: str
    incident: str
    expect: tuple[str, ...]
    apply: Callable  # (engine, requests, config) -> (requests, config)


def _template_mismatch(engine, requests, config):
    engine.chat_template = MISMATCHED_TEMPLATE
    return requests, config


def _raw_prompt(request: Request) -> Request:
    text = "\n\n".join(m["content"] for m in request.messages if m["role"] == "user") if request.messages else request.prompt
    return dataclasses.replace(request, messages=None, prompt=text)


def _no_template(engine, requests, config):
    return [_raw_prompt(r) for r in requests], config


def _layer_offset(engine, requests, config):
    """Load the draft with every target layer id shifted by +1 (the off-by-one of vLLM PR #42704)."""
    from dflash_doctor.engine.proposers.dflash import DFlashProposer

    draft = copy.copy(engine.draft_model)
    cfg = draft.config
    last = engine.target.model.config.num_hidden_layers - 1
    draft.config = dataclasses.replace(cfg, target_layer_ids=[min(l + 1, last) for l in cfg.target_layer_ids])
    engine.draft_model = draft
    engine.proposer = DFlashProposer(draft, engine.target)
    engine.target.hidden_state_indices = engine.proposer.needs.hidden_state_indices
    engine.models_meta["draft"]["target_layer_ids"] = list(draft.config.target_layer_ids)
    return requests, config


def _quantized_target(engine, requests, config):
    """Serve a 4-bit fake-quantised target: the target changed under the draft (AEON-7 #6, z-lab #152)."""
    from dflash_doctor.derive import fake_quantize

    fake_quantize(engine.target.model, bits=4, group_size=32)
    engine.models_meta["target"]["id"] += " (4-bit fake-quantised)"
    return requests, config


def _k_too_large(engine, requests, config):
    return requests, dataclasses.replace(config, k=(engine.proposer.max_k or 16,))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("template-mismatch", "the target is served with a different chat template than the draft was trained with",
                 ("chat-template-parity",), _template_mismatch),
        Scenario("no-template", "raw prompts reach the target without its chat template", ("prompt-format",), _no_template),
        Scenario("layer-offset", "the draft reads target layer ids shifted by one", ("draft-config",), _layer_offset),
        Scenario("quantized-target", "the target was quantised to 4 bits after the draft was trained",
                 ("target-identity",), _quantized_target),
        Scenario("k-too-large", "num_speculative_tokens far past the useful range", ("speculative-k",), _k_too_large),
    )
}


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        import difflib

        close = difflib.get_close_matches(name, SCENARIOS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"unknown scenario {name!r}{hint}; `--scenario list` shows {', '.join(SCENARIOS)}.")
    return SCENARIOS[name]


def check_demo_pair(config: DoctorConfig) -> None:
    """Scenarios are defined on the demo pair; refuse them with other models."""
    if config.target or config.draft:
        raise UsageError("--scenario reproduces incidents on the built-in demo pair; drop --target/--draft to use it.")
