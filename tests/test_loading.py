"""Model resolution: local dirs, hub ids from the local Hugging Face cache (offline), GGUF conversion cache."""

import copy
import json

import pytest

from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models import loading
from dflash_doctor.models.draft_kinds import detect_draft_kind
from dflash_doctor.errors import UsageError


def _fake_hub_cache(root, repo_id, files):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_hub_id_resolves_from_the_local_cache_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = _fake_hub_cache(tmp_path, "z-lab/tiny-DFlash", {"config.json": json.dumps({"dflash_config": {}})})
    assert loading.resolve_model_dir("z-lab/tiny-DFlash") == snapshot
    assert detect_draft_kind(read_config_json(snapshot)).name == "dflash"


def test_unknown_hub_id_names_the_download_command(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match="huggingface-cli download org/missing"):
        loading.resolve_model_dir("org/missing")


def test_gguf_is_converted_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake bytes")
    monkeypatch.setenv("DFLASH_DOCTOR_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(path):
        calls.append(path)
        out = loading.cache_dir() / "gguf" / loading.file_sha256(path)[:20]
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / ".complete").touch()
        return out

    real_convert = loading._convert_gguf
    monkeypatch.setattr(loading, "_convert_gguf", lambda path: real_convert(path) if calls else fake_convert(path))
    first = loading.resolve_model_dir(str(gguf))
    second = loading.resolve_model_dir(str(gguf))  # the real converter finds the complete cache entry
    assert first == second and len(calls) == 1


def test_a_folder_without_config_is_refused_with_the_fix(tmp_path):
    with pytest.raises(UsageError, match="no config.json"):
        loading.resolve_model_dir(str(tmp_path))


def test_weights_fingerprint_is_the_same_in_float32_and_bfloat16_and_moves_with_the_weights():
    """A draft trained against a bf16 copy of its target must recognise the float32 target (and the
    reverse); a fine-tune that moves the weights must not."""
    import torch

    from tests.tiny_models import tiny_target

    model = tiny_target()
    recorded = loading.weights_fingerprint(model)
    assert loading.weights_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == recorded
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for param in tuned.parameters():
            param.add_(torch.randn_like(param) * 1e-2)
    assert loading.weights_fingerprint(tuned) != recorded
