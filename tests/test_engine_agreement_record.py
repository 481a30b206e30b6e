"""The engine-agreement probe is typed at the run.json boundary, and run.json is unchanged by the typing.

``data/engine_agreement_run/run.json`` was written by the code before the probe was typed (the dict it
stored under ``probes.engine_agreement``; ``check_result.json`` is what that code's check made of it): a DFlash stand-in
server running the draft with causal block attention, three turns in two classes, one output and one prompt that differ,
every simulated setup. The current reader must read it into the typed record and write it back byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from rich.console import Console

from dflash_doctor.checks import CheckContext, get_check
from dflash_doctor.report.terminal import print_server_comparison
from dflash_doctor.rundir.engine_agreement import EngineAgreement, SetupSteps, TurnAgreement
from dflash_doctor.rundir.run_record import RunRecord
from dflash_doctor.rundir.writer import write_run_json

OLD_RUN = Path(__file__).parent / "data" / "engine_agreement_run" / "run.json"


def _old_run() -> dict:
    return json.loads(OLD_RUN.read_text())


def test_an_old_engine_agreement_block_reads_typed_and_writes_back_byte_for_byte(tmp_path):
    record = RunRecord.from_json(_old_run())
    data = record.probes.engine_agreement
    assert isinstance(data, EngineAgreement)
    assert isinstance(data.per_step["in-block attention causal"], SetupSteps)
    assert isinstance(data.turns[0], TurnAgreement) and data.turns[0].request_class == "chat"  # run.json's "class"
    assert data.outputs.differences[0].request_id == "r1" and data.prompts.differing == ["r2"]
    written = write_run_json(tmp_path, record.to_json())
    assert written.read_bytes() == OLD_RUN.read_bytes()


def test_the_check_judges_an_old_run_as_it_did_before_the_typing():
    """``check_result.json``: the check's result (what run.json and ``check --json`` carry) on this block, written by
    the check as it read the untyped dict."""
    record = RunRecord.from_json(_old_run())
    result = get_check("engine-agreement")().run(CheckContext(record=record))
    assert result.status == "fail"  # the differing prompt; the differing output warns
    assert json.dumps(result.to_dict(), indent=2) + "\n" == (OLD_RUN.parent / "check_result.json").read_text()


@pytest.mark.parametrize(
    "path, value, named",
    [
        (("turns", 0, "class"), 3, "probes.engine_agreement.turns[0].class is 3, not a string"),
        (
            ("per_step", "as configured", "share"),
            "high",
            "probes.engine_agreement.per_step.as configured.share is 'high'",
        ),
        (("tau", "overall", "engine_tau_ci"), None, "probes.engine_agreement.tau.overall.engine_tau_ci is null"),
        (("outputs", "differences", 0, "position"), True, "outputs.differences[0].position is True, not an integer"),
    ],
)
def test_a_mistyped_field_of_the_block_is_refused_by_its_path(path, value, named):
    data = _old_run()
    holder = data["probes"]["engine_agreement"]
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    with pytest.raises(ValueError) as caught:
        RunRecord.from_json(data)
    assert named in str(caught.value)


def test_an_unknown_key_in_a_turn_is_refused_and_the_record_is_never_changed_after_it_is_built():
    data = _old_run()
    data["probes"]["engine_agreement"]["turns"][0]["request_class"] = "chat"  # the field's name is not run.json's key
    with pytest.raises(ValueError, match=r"turns\[0\] has no field\(s\) \['request_class'\]"):
        RunRecord.from_json(data)
    record = RunRecord.from_json(_old_run())
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.probes.engine_agreement.num_turns = 0


def test_the_terminal_view_prints_the_typed_block_of_an_old_run():
    record = RunRecord.from_json(_old_run())
    console = Console(record=True, width=400)
    print_server_comparison(record, console)
    text = console.export_text()
    assert "│ code    │ 2     │ 1.027" in text and "in-block attention causal 100%" in text
