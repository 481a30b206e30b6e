"""A newcomer's first run: the demo target's GGUF converts from an empty cache.

The conversion runs once per machine, so a warm cache hides whatever it needs (it once needed an
undeclared package, accelerate). `.ci/run` uses an empty home directory, so CI converts on every run;
this test converts into an empty cache even on a warm machine and checks that the result is the very
target the demo draft was trained against.
"""

from __future__ import annotations

import pytest

from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models import loading

pytestmark = pytest.mark.integration


def test_the_demo_gguf_converts_from_an_empty_cache_into_the_drafts_target(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("DFLASH_DOCTOR_CACHE", str(tmp_path / "cache"))
    model_dir = loading.resolve_model_dir(str(loading.demo_target_path()))
    assert model_dir.is_relative_to(tmp_path) and (model_dir / ".complete").is_file()

    recorded = read_config_json(loading.DEMO_DRAFT_DIR)["dflash_doctor"]["target_weights_fingerprint"]
    assert loading.weights_fingerprint(loading.load_causal_lm(model_dir)) == recorded
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
