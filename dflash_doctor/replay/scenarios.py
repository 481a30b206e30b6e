"""Reproducible failure scenarios on the real demo pair (``dflash-doctor check --scenario NAME``).

Each scenario reproduces a real incident (docs/troubleshooting.md#why-drafts-get-rejected) by changing ONE thing in how
the demo pair is served, so a newcomer can see what the doctor reports for it and a test can assert that the
checks name the cause and the fix.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.workloads import Request
from dflash_doctor.models.derive import fake_quantize
from dflash_doctor.models.loading import DEMO_EAGLE3_DIR
from dflash_doctor.models.pair import Pair

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
    """``apply`` returns the loaded pair, the requests and the config as the incident serves them (it
    edits only what it owns: the quantised target is loaded for this run alone); ``expect`` names the check ids that
    must report the cause (used by the test and shown by ``--scenario list``).

    ``severity``: what the expected checks say. ``fail`` where the setup is wrong whatever the draft; ``warn``
    where it is wrong only for some drafts (a head without layer ids is right when it was trained on the
    engine's default layers), so the check names the risk and the fix without failing every such head.

    ``served_draft``: for an incident that lives in a checkpoint's files (a config.json missing a key),
    writes the draft folder as it is served into the folder it is given (inside the run directory, where
    it stays as evidence) and returns it; the pair is then loaded with that draft instead of the demo
    DFlash draft, so every check reads the files exactly as a server would."""

    name: str
    incident: str
    expect: tuple[str, ...]
    apply: Callable[[Pair, list[Request], DoctorConfig], tuple[Pair, list[Request], DoctorConfig]]
    served_draft: Callable[[Path], Path] | None = None
    severity: str = "fail"


def _template_mismatch(pair: Pair, requests, config):
    return dataclasses.replace(pair, chat_template=MISMATCHED_TEMPLATE), requests, config


def _raw_prompt(request: Request) -> Request:
    text = (
        "\n\n".join(m["content"] for m in request.messages if m["role"] == "user")
        if request.messages
        else request.prompt
    )
    return dataclasses.replace(request, messages=None, prompt=text)


def _no_template(pair: Pair, requests, config):
    return pair, [_raw_prompt(r) for r in requests], config


def _layer_offset(pair: Pair, requests, config):
    """Serve the draft with every target layer id shifted by +1 (the off-by-one of vLLM PR #42704)."""
    kind = pair.kind
    if kind.layer_ids is None or kind.with_layer_ids is None:
        raise UsageError(
            f"--scenario layer-offset needs a draft that reads target layers; a {kind.name} draft reads none."
        )
    last = pair.target.model.config.num_hidden_layers - 1
    shifted = [min(layer + 1, last) for layer in kind.layer_ids(pair.draft_model)]
    return pair.with_draft(kind.with_layer_ids(pair.draft_model, shifted)), requests, config


def _quantized_target(pair: Pair, requests, config):
    """Serve a 4-bit fake-quantised target: the target changed under the draft (AEON-7 #6, z-lab #152).

    The demo target is loaded for this run only, so its weights are quantised where they are."""
    fake_quantize(pair.target.model, bits=4, group_size=32)
    target_info = dataclasses.replace(pair.target_info, id=pair.target_info.id + " (4-bit fake-quantised)")
    return dataclasses.replace(pair, target_info=target_info), requests, config


def _k_too_large(pair: Pair, requests, config):
    return pair, requests, dataclasses.replace(config, k=(pair.default_k if pair.proposer.max_k else 16,))


def _unchanged(pair: Pair, requests, config):
    return pair, requests, config


def _demo_eagle3_without(key: str) -> Callable[[Path], Path]:
    """The built-in EAGLE-3 head served from a config.json that lacks ``key`` (its weights linked, not copied)."""

    def write(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        config = json.loads((DEMO_EAGLE3_DIR / "config.json").read_text(encoding="utf-8"))
        config.pop(key)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for weights in DEMO_EAGLE3_DIR.glob("*.safetensors"):
            (folder / weights.name).symlink_to(weights.resolve())
        return folder

    return write


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "template-mismatch",
            "the target is served with a different chat template than the draft was trained with",
            ("chat-template-parity",),
            _template_mismatch,
        ),
        Scenario(
            "no-template", "raw prompts reach the target without its chat template", ("prompt-format",), _no_template
        ),
        Scenario("layer-offset", "the draft reads target layer ids shifted by one", ("draft-config",), _layer_offset),
        Scenario(
            "quantized-target",
            "the target was quantised to 4 bits after the draft was trained",
            ("target-identity",),
            _quantized_target,
        ),
        Scenario("k-too-large", "num_speculative_tokens far past the useful range", ("speculative-k",), _k_too_large),
        Scenario(
            "eagle3-no-layer-ids",
            "the built-in EAGLE-3 head is shipped without eagle_aux_hidden_state_layer_ids, so vLLM "
            "feeds it its default target layers",
            ("eagle3-config",),
            _unchanged,
            served_draft=_demo_eagle3_without("eagle_aux_hidden_state_layer_ids"),
            severity="warn",
        ),
        Scenario(
            "eagle3-norm-switch",
            "the built-in EAGLE-3 head's config leaves out norm_before_residual, which vLLM reads as "
            "true while the head was trained with false",
            ("eagle3-config",),
            _unchanged,
            served_draft=_demo_eagle3_without("norm_before_residual"),
            severity="warn",
        ),
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
