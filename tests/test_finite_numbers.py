"""Every number a user hands over is finite and in range, or refused in one sentence (exit 2).

``nan`` compares false with everything, so it passed the old ``>= 0`` checks and then no drop could ever
exceed it: compare's gate and watch's alerts were switched off by a flag or a config value; ``inf`` did
the same from above. Each boundary is tried with many values of each class (the counts are in
BAD_NUMBERS and the parametrize tables)."""

from __future__ import annotations

import pytest

from cli_helpers import assert_usage_error, invoke
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import build_config
from dflash_doctor.inputs.validation import finite_number
from dflash_doctor.telemetry.settings import build_watch_settings
from dflash_doctor.telemetry.sources import parse_duration_s
from dflash_doctor.telemetry.verdict import Baseline, Thresholds

#: The non-finite and absurd values every boundary is tried with (as the flag's text).
NON_FINITE = ["nan", "NaN", "inf", "-inf", "Infinity", "-Infinity", "1e400", "-1e400"]
BAD_NUMBERS = NON_FINITE + ["-1", "-0.5", "1e300", "abc", "", "0x10", "1,5"]  # 15 values


def _flag_values(*extra: str) -> list[str]:
    return [v for v in BAD_NUMBERS if v] + list(extra)


# ------------------------------------------------------------------------------------------- the helper itself


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), float("-inf"), 10**400, -1, -1e-9, 1e300, "x", "nan", "inf", True, None, [1], {}],
)
def test_finite_number_refuses_in_one_sentence(value):
    with pytest.raises(UsageError) as caught:
        finite_number(value, "--knob", minimum=0, maximum=100, fix="pass 0.2")
    message = str(caught.value)
    assert message.startswith("--knob ") and message.endswith("; pass 0.2.") and len(message) < 200


@pytest.mark.parametrize("value", [2.5, "2.5", 1e15, "1e15"])
def test_finite_number_refuses_non_integers_where_an_integer_is_due(value):
    with pytest.raises(UsageError):
        finite_number(value, "--n", minimum=1, maximum=1e12, integer=True)


@pytest.mark.parametrize(("value", "expected"), [(0, 0.0), ("0.2", 0.2), (100, 100.0), (" 3 ", 3.0)])
def test_finite_number_accepts_numbers_in_range(value, expected):
    assert finite_number(value, "--knob", minimum=0, maximum=100) == expected


# ------------------------------------------------------------------------------------------------------ compare


# 1.5 is out of range for a rate only (a tau drop of 1.5 is a fair threshold)
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        (flag, value)
        for flag in ("--threshold-tau", "--threshold-rate")
        for value in _flag_values("1e9") + ["1.5"]
        if (flag, value) != ("--threshold-tau", "1.5")
    ],
)
def test_compare_refuses_a_threshold_that_would_switch_the_gate_off(tmp_path, flag, value):
    result = invoke("compare", tmp_path / "a", tmp_path / "b", f"{flag}={value}")
    if value in ("abc", "0x10", "1,5"):  # Click refuses these itself: still exit 2 without a traceback
        assert result.exit_code == 2 and "Traceback" not in result.output
        return
    assert_usage_error(result, flag)


# -------------------------------------------------------------------------------------------------------- watch


def _fair(name: str, value) -> bool:
    """Values that are in range for that knob: a tau threshold of 0 (every separated drop alerts), 2.5 as a tau
    drop or a speedup floor (only min_drafts must be whole)."""
    return (name == "threshold_tau" and value == 0) or (value == 2.5 and name != "min_drafts")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (name, value)
        for name in ("threshold_tau", "speedup_floor", "min_drafts")
        for value in (
            float("nan"),
            float("inf"),
            float("-inf"),
            -1,
            0,
            1e300,
            10**400,
            "nan",
            "inf",
            "abc",
            True,
            [1],
            2.5,
        )
        if not _fair(name, value)
    ],
)
def test_watch_thresholds_from_the_table_or_flags_are_finite_and_in_range(name, value):
    for table, flags in (({name: value}, {}), ({}, {name: value})):
        with pytest.raises(UsageError) as caught:
            build_watch_settings(table, **flags)
        assert name in str(caught.value)


@pytest.mark.parametrize("name", ["threshold_tau", "min_drafts", "speedup_floor"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_thresholds_cannot_be_built_non_finite(name, value):
    with pytest.raises(UsageError):
        Thresholds(**{name: value})


@pytest.mark.parametrize("key", ["window", "interval", "retain"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "1e400s", "99999999999d", "-5", "0", "abc", "5x"])
def test_watch_durations_are_finite_and_positive(key, value):
    with pytest.raises(UsageError):
        build_watch_settings({key: value})


@pytest.mark.parametrize("value", ["30s", "5m", "1.5h", "7d", "45"])
def test_fair_durations_still_parse(value):
    assert 0 < parse_duration_s(value) < 1e9


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 0.5, -1, 1e300, True, "nan"])
def test_a_fixed_baseline_tau_is_finite_and_at_least_one(value):
    with pytest.raises(UsageError):
        build_watch_settings({"baseline_tau": {"code": value}})
        Baseline.fixed({"code": value})
    with pytest.raises(UsageError):
        Baseline.fixed({"code": value})


@pytest.mark.parametrize("flag", ["--threshold-tau", "--speedup-floor", "--min-drafts", "--window", "--interval"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_watch_flags_refuse_non_finite_values(tmp_path, flag, value):
    log = tmp_path / "server.log"
    log.write_text("")
    result = invoke("watch", log, "--once", f"{flag}={value}", "--out", tmp_path / "w")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    named = {"--threshold-tau": "threshold_tau", "--speedup-floor": "speedup_floor", "--min-drafts": "min"}.get(flag)
    assert (
        (named in result.output) if named else ("duration" in result.output or "window and interval" in result.output)
    )


# ------------------------------------------------------------------------------------------- config-file numbers


@pytest.mark.parametrize("toml_value", ["nan", "+nan", "inf", "-inf", "+inf", "-1.0", "1e300"])
@pytest.mark.parametrize(
    ("key", "label"),
    [
        ("temperature", "--temperature"),
        ("engine_timeout_s", "--engine-timeout"),
        ("thresholds.confident_max_entropy", "confident_max_entropy"),
        ("thresholds.confident_min_margin", "confident_min_margin"),
        ("watch.threshold_tau", "threshold_tau"),
        ("watch.speedup_floor", "speedup_floor"),
    ],
)
def test_config_file_numbers_are_finite_and_in_range(tmp_path, toml_value, key, label):
    section, _, name = key.rpartition(".")
    text = f"[{section}]\n{name} = {toml_value}\n" if section else f"{name} = {toml_value}\n"
    path = tmp_path / "doctor.toml"
    path.write_text(text)
    with pytest.raises(UsageError) as caught:
        config = build_config(path)
        build_watch_settings(config.watch)
    assert label in str(caught.value)


def test_cli_temperature_nan_is_refused(tmp_path):
    with pytest.raises(UsageError):
        build_config(None, temperature=float("nan"))
    with pytest.raises(UsageError):
        build_config(None, engine_timeout_s=float("inf"))
