"""Each failure scenario reproduces its incident on the real demo pair, and the checks name cause and fix."""

import pytest

from dflash_doctor import pipeline
from dflash_doctor.replay import scenarios
from dflash_doctor.inputs.config import build_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_scenario_is_named_by_its_check(name, tmp_path):
    scenario = scenarios.get_scenario(name)
    # the scenarios are judged by their checks, not by prices: a short step timing (2 s) is enough
    config = build_config(max_requests=3, max_new_tokens=64, out=str(tmp_path / name), seed=0, timing_budget_s=2.0)
    outcome = pipeline.run_check(config, scenario=scenario)
    run_dir = outcome.run_dir
    by_id = {r.id: r for r in outcome.record.checks}
    for check_id in scenario.expect:
        result = by_id[check_id]
        assert result.status == scenario.severity, f"{name}: {check_id} said {result.status}: {result.summary}"
        naming = [f for f in result.findings if f.severity == scenario.severity]
        assert naming and all(f.fix for f in naming), f"{name}: {check_id} must give a fix"
    assert outcome.record.meta.scenario == name
    assert (run_dir / "report.html").is_file() and (run_dir / "junit.xml").is_file()


def test_unknown_scenario_suggests_the_closest_name():
    with pytest.raises(Exception, match="did you mean 'layer-offset'"):
        scenarios.get_scenario("layer-ofset")
