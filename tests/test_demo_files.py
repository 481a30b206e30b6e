"""The shipped demo drafts are consistent with what the project installs: a first run on a fresh install gets no
warning caused by the demo's own files, and no file of the demo names the machine it was made on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dflash_doctor.checks.base import CheckContext
from dflash_doctor.checks.environment import EnvironmentCheck
from dflash_doctor.inputs.machine import collect_environment
from dflash_doctor.models.loading import DEMO_DRAFT_DIR, DEMO_EAGLE3_DIR

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _transformers_floor() -> str:
    """The lowest transformers the project's dependencies admit (its ``>=`` bound)."""
    text = PYPROJECT.read_text(encoding="utf-8")
    requirement = next(
        Requirement(line.strip().strip('",')) for line in text.splitlines() if line.strip().startswith('"transformers')
    )
    return next(spec.version for spec in requirement.specifier if spec.operator == ">=")


@pytest.mark.parametrize("draft_dir, kind", [(DEMO_DRAFT_DIR, "dflash"), (DEMO_EAGLE3_DIR, "eagle3")])
def test_the_demo_raises_no_environment_warning_on_any_admitted_transformers(draft_dir, kind):
    """The environment check on each demo draft's own config, with the installed environment and with every
    transformers release from the project's floor on (minors a fresh install may pick): pass, nothing to pin."""
    draft_config = json.loads((draft_dir / "config.json").read_text(encoding="utf-8"))
    floor = tuple(int(part) for part in _transformers_floor().split(".")[:2])
    installed = collect_environment()
    versions = (
        [installed["transformers"]] + [f"{floor[0]}.{minor}.0" for minor in range(floor[1], floor[1] + 8)] + ["6.0.0"]
    )
    for version in versions:
        ctx = CheckContext(
            draft_config=draft_config, draft_kind=kind, environment={**installed, "transformers": version}
        )
        result = EnvironmentCheck().run(ctx)
        assert result.status == "pass", (version, [f.message for f in result.findings if f.severity != "info"])


def test_no_demo_file_names_a_development_machines_path():
    for path in sorted(DEMO_DRAFT_DIR.parent.rglob("*")):
        if path.suffix in (".json", ".md"):
            text = path.read_text(encoding="utf-8")
            assert not re.search(r"(?<![\w.])/(home|work|tmp|root|Users)/", text), path
