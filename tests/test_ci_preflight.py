"""`.ci/run` refuses a full disk in one sentence before it installs anything (a CI run on a full disk died inside
ensurepip with exit status 1 and no word about space)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_refuses_a_disk_without_room_for_the_run_before_installing_anything(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # `df` as POSIX prints it, for a disk with 3 GiB free; every other command would show up in the log.
    (fake_bin / "df").write_text(
        "#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
        "echo '/dev/vda 264000000 260854272 3145728 99% /'\n"
    )
    log = tmp_path / "called"
    for name in ("apt-get", "python3", "bash"):
        (fake_bin / name).write_text(f"#!/bin/sh\necho {name} >> {log}\n")
    for tool in fake_bin.iterdir():
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    result = subprocess.run(
        ["/bin/bash", str(REPO / ".ci" / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        ".ci/run: only 3 GiB free on the file system of ., and a run "
        "needs about 10 GiB there; free some disk and run it again."
    ]
    assert not log.exists()
