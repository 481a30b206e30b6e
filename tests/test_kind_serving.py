"""Each kind's serving (models/kind_serving.py) is declared once, held by its registry entry, and read by the
head-to-head's engine settings without torch."""

from __future__ import annotations

import json

import pytest

from dflash_doctor.models import draft_kinds, kind_serving
from dflash_doctor.models.draft_kinds import AUTO, DraftKind, get_draft_kind, kind_names, register_draft_kind
from dflash_doctor.models.kind_serving import KindServing
from dflash_doctor.report.head_to_head import engine_settings
from test_light_install import without_model_stack


def test_every_registered_kind_holds_the_serving_the_views_read():
    names = [name for name in kind_names() if name != AUTO]
    assert len(names) >= 6
    for name in names:
        kind = get_draft_kind(name)
        assert kind_serving.kind_serving(name) is kind.serving, name
        assert kind.serving.has_checkpoint == (kind.from_spec is None), name


def test_the_head_to_head_settings_read_the_serving_without_the_model_stack():
    result = without_model_stack(
        "from dflash_doctor.report.head_to_head import engine_settings\n"
        "print(engine_settings('eagle3', 'x', {}, 3)['SGLang'])\n"
        "print(engine_settings('autoregressive', 'x', {}, 3)['vLLM'])\n"
    )
    assert result.returncode == 0, result.stderr
    sglang, vllm = result.stdout.splitlines()
    assert sglang == (
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
    )
    assert json.loads(vllm.split("'")[1])["method"] == "draft_model"


def _kind(name: str, serving: KindServing) -> DraftKind:
    return DraftKind(
        name=name,
        description="a plugin's kind",
        detect=lambda config: False,
        load=lambda draft_dir, target_dir, target_config, options: None,
        build=lambda model, target, sampling: None,
        serving=serving,
    )


@pytest.fixture
def own_tables(monkeypatch):
    """The two registries as copies, so a kind registered here leaves the session's tables as they were."""
    monkeypatch.setattr(draft_kinds, "_KINDS", dict(draft_kinds._KINDS))
    monkeypatch.setattr(kind_serving, "_SERVING", dict(kind_serving._SERVING))


def test_a_kind_registered_elsewhere_brings_its_serving_to_the_views(own_tables):
    serving = KindServing(
        name="medusa", vllm_method="medusa", sglang="--speculative-algorithm MEDUSA --n {k_with_anchor}"
    )
    register_draft_kind(_kind("medusa", serving), before="autoregressive")
    settings = engine_settings("medusa", "x", {}, 3)
    assert settings["SGLang"] == "--speculative-algorithm MEDUSA --n 4"
    assert json.loads(settings["vLLM"].split("'")[1]) == {
        "method": "medusa",
        "model": "DRAFT",
        "num_speculative_tokens": 3,
    }
    assert "serve it with vLLM" in settings["llama.cpp"]


def test_a_serving_that_disagrees_with_its_kind_is_refused_before_anything_registers(own_tables):
    with pytest.raises(ValueError, match="its serving declares the kind 'other'"):
        register_draft_kind(_kind("medusa", KindServing(name="other", vllm_method="medusa")))
    with pytest.raises(ValueError, match="from_spec exactly when its serving has no checkpoint"):
        register_draft_kind(_kind("medusa", KindServing(name="medusa", vllm_method="medusa", has_checkpoint=False)))
    assert "medusa" not in kind_names() and kind_serving.kind_serving("medusa") is None
    with pytest.raises(ValueError, match="'eagle3' already has another serving declaration"):
        kind_serving.register_kind_serving(KindServing(name="eagle3", vllm_method="eagle"))
