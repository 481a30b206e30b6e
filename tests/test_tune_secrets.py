"""A launched server's output is copied to ``server-k<K>.log`` without the secrets it printed: the
--engine-api-key value, every key/token value of the launch command and every URL's userinfo (real engines
print their arguments, key included)."""

from __future__ import annotations

import io
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.tune.secrets import LINE_PIECE_BYTES, copy_redacted, known_secrets, redact
from dflash_doctor.tune.servers import ServerPlan, serving
from tune_fixtures import write_sweep_run, write_workload

TESTS = Path(__file__).resolve().parent
KEY = "sk-printed-9f3e"
URL_PASSWORD = "pw-in-url-77c"

#: (launch command, --engine-api-key, text the server printed, secrets that must be gone)
LOG_CASES = [
    ("vllm serve t --api-key sk-AAAA1111", None, "non-default args: {'api_key': ['sk-AAAA1111']}", ["sk-AAAA1111"]),
    ("vllm serve t --api-key=sk-BBBB2222", None, "api_key=sk-BBBB2222 model=t", ["sk-BBBB2222"]),
    ("HF_TOKEN=hf_CCCC3333 vllm serve t", None, "token hf_CCCC3333 loaded", ["hf_CCCC3333"]),
    ("llama-server -m m.gguf", "sk-DDDD4444", "args: --api-key sk-DDDD4444 --port 8000", ["sk-DDDD4444"]),
    ("serve --hf-token 'hf_EEEE5555'", None, "using hf_EEEE5555", ["hf_EEEE5555"]),
    (
        "serve --model-url http://bob:FFFF6666@hub:1/m",
        None,
        "fetching http://bob:FFFF6666@hub:1/m",
        ["FFFF6666", "bob:"],
    ),
    ("serve", None, "upstream https://carol:GGGG7777@10.0.0.1/v1 ready", ["GGGG7777"]),
    ("serve", None, "MY_SECRET=HHHH8888 OPENAI_API_KEY=IIII9999", ["HHHH8888", "IIII9999"]),
    (
        "serve --token JJJJ0000",
        "KKKK1111",
        "got --token JJJJ0000, key KKKK1111, again JJJJ0000",
        ["JJJJ0000", "KKKK1111"],
    ),
]


@pytest.mark.parametrize(("command", "api_key", "printed", "gone"), LOG_CASES)
def test_a_server_log_loses_every_secret_the_tool_knows(tmp_path, command, api_key, printed, gone):
    log = tmp_path / "server-k2.log"
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read())"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    copier = copy_redacted(server.stdout, log, known_secrets(command, api_key))
    server.stdin.write(f"INFO start\n{printed}\nINFO ready\n".encode())
    server.stdin.close()
    server.wait()
    copier.join(timeout=10)
    text = log.read_text()
    assert "INFO start" in text and "INFO ready" in text
    for secret in gone:
        assert secret not in text, text


def test_redact_hides_url_userinfo_in_launch_commands():
    assert redact("serve --upstream http://bob:pw@h:1/x") == "serve --upstream http://***@h:1/x"


def test_tune_copies_server_output_without_the_keys_it_printed(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = f"{sys.executable} {TESTS / 'fake_spec_engine.py'} --port {port} --k"
    prefix = f"echo serving with --api-key {KEY} from http://bob:{URL_PASSWORD}@hub:1/m; MY_API_KEY={KEY}"
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "tune",
            "--launch",
            f"{prefix} {engine} {{k}}",
            "--launch-baseline",
            f"{prefix} {engine} 0",
            "--engine",
            f"http://127.0.0.1:{port}",
            "--k",
            "0,2",
            "--workload",
            str(write_workload(tmp_path)),
            "--max-new-tokens",
            "8",
            "--start-timeout",
            "60",
            "--sweep",
            str(write_sweep_run(tmp_path, [2])),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    logs = sorted(out.glob("server-k*.log"))
    assert logs and any("serving with" in log.read_text() for log in logs)
    for path in out.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert KEY.encode() not in data and URL_PASSWORD.encode() not in data, path
    assert KEY not in result.output and URL_PASSWORD not in result.output


def test_a_running_server_log_holds_no_secret_before_the_server_stops(tmp_path):
    """Redacted while copied: a tune killed mid-run (SIGKILL: no clean-up runs) leaves no key on disk either."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = f"echo serving with --api-key {KEY}; {sys.executable} {TESTS / 'fake_spec_engine.py'} --port {port} --k 2"
    log = tmp_path / "server-k2.log"
    with serving(ServerPlan(k=2, url=f"http://127.0.0.1:{port}", command=command), log, start_timeout_s=60):
        deadline = time.monotonic() + 10
        while "serving with" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
    assert "serving with --api-key ***" in text and KEY not in text, text


def _copied(tmp_path: Path, output: bytes, secrets: list[str]) -> str:
    log = tmp_path / "server.log"
    copy_redacted(io.BytesIO(output), log, secrets).join(timeout=30)
    return log.read_text(encoding="utf-8")


def test_a_key_across_the_cut_of_a_long_line_is_still_redacted(tmp_path):
    """A line longer than LINE_PIECE_BYTES is copied piece by piece; a key straddling the cut stays whole."""
    for before in range(LINE_PIECE_BYTES - len(KEY), LINE_PIECE_BYTES + 1):
        copied = _copied(tmp_path, b"x" * before + KEY.encode() + b" tail\nnext line\n", [KEY])
        assert KEY not in copied and copied == "x" * before + "*** tail\nnext line\n"


SECRETS = ["SECRETKEY-ONE-0001", "sk-TWO2", "PASSWORD-THREE-33333333"]
SECRET_FUZZ_CASES = 400


def test_fuzzed_long_lines_lose_every_secret_and_keep_everything_else(tmp_path, monkeypatch):
    """Seeded random lines (pieces of 16 bytes here) with the secrets planted anywhere, also across cuts and
    side by side: the log is the output with each secret replaced, byte for byte."""
    monkeypatch.setattr("dflash_doctor.tune.secrets.LINE_PIECE_BYTES", 16)
    rng = random.Random(4)
    for _ in range(SECRET_FUZZ_CASES):
        parts = [rng.choice(["ab", "ba ", "aab", "\n", *SECRETS]) for _ in range(rng.randint(1, 30))]
        output = "".join(parts)
        expected = output
        for value in sorted(SECRETS, key=len, reverse=True):
            expected = expected.replace(value, "***")
        assert _copied(tmp_path, output.encode(), sorted(SECRETS, key=len, reverse=True)) == expected, output
