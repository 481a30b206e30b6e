"""No credential is written anywhere: a source URL's ``user:password@`` reaches the server as an
Authorization header and nowhere else (not run.json, units.parquet, windows.parquet, the terminal or an
error sentence)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.inputs.config import build_config
from telemetry_fixtures import DATA, MetricsExporter

SECRET = "s3cr3t-Passw0rd"
#: userinfo forms: user and password, percent-encoded, user only (a token as the user name), empty user
USERINFOS = [f"alice:{SECRET}", f"alice:{SECRET}%40x", f"{SECRET}", f":{SECRET}", f"al%20ice:{SECRET}"]


def _all_bytes(folder: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file())


@pytest.mark.parametrize("userinfo", USERINFOS)
def test_watch_never_writes_url_credentials(tmp_path, userinfo):
    with MetricsExporter((DATA / "vllm_metrics_good_1.txt").read_text()) as exporter:
        url = exporter.url.replace("http://", f"http://{userinfo}@")
        out = tmp_path / "w"
        result = CliRunner().invoke(app, ["watch", url, "--once", "--out", str(out)])
    assert result.exit_code in (0, 1), result.output
    assert SECRET not in result.output
    assert out.is_dir() and SECRET.encode() not in _all_bytes(out)
    assert b"alice" not in _all_bytes(out)


@pytest.mark.parametrize("userinfo", USERINFOS)
def test_an_unreachable_source_is_named_without_its_credentials(tmp_path, userinfo):
    with MetricsExporter("") as exporter:
        exporter.failing = True
        url = exporter.url.replace("http://", f"http://{userinfo}@")
        result = CliRunner().invoke(app, ["watch", url, "--once", "--out", str(tmp_path / "w")])
    assert result.exit_code != 0
    assert SECRET not in result.output and "Traceback" not in result.output
    assert SECRET.encode() not in _all_bytes(tmp_path)


@pytest.mark.parametrize("userinfo", USERINFOS)
def test_a_bad_source_url_is_refused_without_its_credentials(tmp_path, userinfo):
    result = CliRunner().invoke(
        app, ["watch", f"ftp://{userinfo}@127.0.0.1:1/metrics", "--once", "--out", str(tmp_path / "w")]
    )
    assert result.exit_code == 2 and SECRET not in result.output


@pytest.mark.parametrize("userinfo", USERINFOS)
def test_run_json_config_holds_the_engine_url_without_credentials(userinfo):
    config = build_config(None, engine=f"http://{userinfo}@127.0.0.1:8000/v1")
    assert SECRET not in str(config.as_dict())
    assert config.engine is not None and SECRET in config.engine  # the request itself still carries them
