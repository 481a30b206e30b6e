"""Model resolution: local dirs, hub ids from the local Hugging Face cache (offline), GGUF conversion cache."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models import loading
from dflash_doctor.models.draft_kinds import LoadOptions, detect_draft_kind, get_draft_kind
from dflash_doctor.errors import UsageError
from gguf_conversion import record_dequantise
from hub_cache import hub_snapshot, offline_hub_cache
from tiny_models import tiny_target, tiny_tokenizer


COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLDER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def test_hub_id_resolves_from_the_local_cache_without_network(tmp_path, monkeypatch):
    offline_hub_cache(monkeypatch, tmp_path)
    snapshot = hub_snapshot(tmp_path, "z-lab/tiny-DFlash", COMMIT, {"config.json": json.dumps({"dflash_config": {}})})
    assert loading.resolve_model_dir("z-lab/tiny-DFlash") == snapshot
    assert detect_draft_kind(read_config_json(snapshot)).name == "dflash"
    assert loading.hub_commit(snapshot) == COMMIT


def test_hub_id_at_a_revision_resolves_that_snapshot_by_tag_or_commit(tmp_path, monkeypatch):
    offline_hub_cache(monkeypatch, tmp_path)
    latest = hub_snapshot(tmp_path, "org/model", COMMIT, {"config.json": "{}"})
    tagged = hub_snapshot(tmp_path, "org/model", OLDER_COMMIT, {"config.json": "{}"}, refs=("v1.0",))
    assert loading.resolve_model_dir("org/model") == latest
    assert loading.resolve_model_dir("org/model@v1.0") == tagged
    assert loading.resolve_model_dir(f"org/model@{OLDER_COMMIT}") == tagged
    assert loading.hub_commit(loading.resolve_model_dir("org/model@v1.0")) == OLDER_COMMIT


def test_a_local_folder_is_no_hub_snapshot(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert loading.hub_commit(loading.resolve_model_dir(str(tmp_path))) is None


def test_unknown_hub_id_names_the_hf_download_command(tmp_path, monkeypatch):
    offline_hub_cache(monkeypatch, tmp_path)
    with pytest.raises(UsageError, match=r"\(`hf download org/missing`\)"):
        loading.resolve_model_dir("org/missing")


def test_a_revision_missing_from_the_cache_names_the_download_of_that_revision(tmp_path, monkeypatch):
    offline_hub_cache(monkeypatch, tmp_path)
    hub_snapshot(tmp_path, "org/model", COMMIT, {"config.json": "{}"})
    with pytest.raises(UsageError, match=r"'org/model@v2'.*`hf download org/model --revision v2`"):
        loading.resolve_model_dir("org/model@v2")


def test_the_suggested_download_command_exists_in_the_installed_huggingface_hub():
    """The hint is only useful if the command it names is installed beside this tool (huggingface_hub's
    console scripts: ``hf`` replaced ``huggingface-cli``)."""
    from importlib.metadata import entry_points

    assert "hf" in {
        script.name for script in entry_points(group="console_scripts") if script.value.startswith("huggingface_hub")
    }


def test_gguf_is_converted_once_and_again_only_when_the_file_changes(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake bytes")
    log = tmp_path / "conversions.log"
    monkeypatch.setenv("DFLASH_DOCTOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_dequantise_gguf", lambda path, out: record_dequantise(path, out, log))

    first = loading.resolve_model_dir(str(gguf))
    assert loading.resolve_model_dir(str(gguf)) == first and len(log.read_text().splitlines()) == 1
    assert json.loads((first / "source.json").read_text())["gguf"] == str(gguf)

    stat = gguf.stat()
    gguf.write_bytes(b"GGUF fake BYTES")  # same size, new content
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime: the bytes still tell
    changed = loading.resolve_model_dir(str(gguf))
    assert changed != first and len(log.read_text().splitlines()) == 2
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: converted again, to be safe
    assert loading.resolve_model_dir(str(gguf)) not in (first, changed)


CONVERT_IN_A_PROCESS = """
import sys, time
from pathlib import Path
from dflash_doctor.models import loading
from gguf_conversion import record_dequantise

gguf, log, ready = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
loading._dequantise_gguf = lambda path, out: record_dequantise(path, out, log, seconds=1.0)
(ready / sys.argv[4]).touch()
while len(list(ready.iterdir())) < 2:  # both processes imported: start together
    time.sleep(0.01)
print(loading.resolve_model_dir(str(gguf)))
"""


def test_two_processes_loading_one_new_gguf_convert_it_once(tmp_path):
    """The ranks of --devices resolve the target at the same moment: one converts, the other waits for the
    lock and reads the finished entry (without the lock both converted into the same temporary folder)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake bytes")
    log, ready = tmp_path / "conversions.log", tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "DFLASH_DOCTOR_CACHE": str(tmp_path / "cache")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_IN_A_PROCESS, str(gguf), str(log), str(ready), name],
            cwd=Path(__file__).parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert outputs[0][0] == outputs[1][0] and Path(outputs[0][0].strip(), ".complete").is_file()
    assert len(log.read_text().splitlines()) == 1


def test_a_folder_without_config_is_refused_with_the_fix(tmp_path):
    with pytest.raises(UsageError, match="no config.json"):
        loading.resolve_model_dir(str(tmp_path))


def test_weights_fingerprint_is_the_same_in_float32_and_bfloat16_and_moves_with_the_weights():
    """A draft trained against a bf16 copy of its target must recognise the float32 target (and the
    reverse); a fine-tune that moves the weights must not."""
    import torch

    model = tiny_target()
    recorded = loading.weights_fingerprint(model)
    assert loading.weights_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == recorded
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for param in tuned.parameters():
            param.add_(torch.randn_like(param) * 1e-2)
    assert loading.weights_fingerprint(tuned) != recorded


def test_an_autoregressive_draft_without_a_tokenizer_records_that_only_vocab_sizes_were_compared(tmp_path):
    """The vocabulary check falls back to vocab_size when a tokenizer does not load; run.json's draft facts
    say so (it used to be skipped without a trace), and a draft with its tokenizer records the full check."""
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    target.save_pretrained(tmp_path / "bare")  # an AR draft shipped without tokenizer files
    target.save_pretrained(tmp_path / "full")
    tiny_tokenizer().save_pretrained(tmp_path / "full")
    kind = get_draft_kind("autoregressive")
    options = LoadOptions(dtype="float32", device="cpu")
    bare = kind.facts(kind.load(tmp_path / "bare", tmp_path / "target", target.config, options))
    assert bare["vocabulary_check"].startswith("vocab_size only: the draft tokenizer in ")
    full = kind.facts(kind.load(tmp_path / "full", tmp_path / "target", target.config, options))
    assert full["vocabulary_check"] == loading.VOCABULARY_COMPARED
