"""junit.xml: one test case per check, so any CI (GitHub Actions, GitLab, Jenkins) lists them.

The shape is the one those tools parse (the Jenkins/Ant JUnit schema): ``<testsuites>`` with totals,
one ``<testsuite name="dflash-doctor">`` whose ``tests/failures/errors/skipped`` attributes match its
children, and per check a ``<testcase classname="dflash_doctor.checks" name=ID>`` holding
``<failure>`` (status fail), ``<error>`` (the check raised), ``<skipped>`` (inputs absent) or nothing
(pass). A warning passes but its findings go to ``<system-out>`` so they stay visible.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dflash_doctor.report.sanitize import for_xml
from dflash_doctor.rundir.load import Run
from dflash_doctor.rundir.status import CheckResult

SUITE_NAME = "dflash-doctor"
TESTCASE_CLASSNAME = "dflash_doctor.checks"
_CHILD_BY_STATUS = {"fail": "failure", "error": "error", "skip": "skipped"}


def _findings_text(check: CheckResult) -> str:
    """The findings as text (untrusted: made XML-safe by the caller)."""
    lines = []
    for finding in check.findings:
        lines.append(f"[{finding.severity}] {finding.message}")
        if finding.evidence:
            lines.append(f"  evidence: {finding.evidence}")
        if finding.fix:
            lines.append(f"  fix: {finding.fix}")
    return "\n".join(lines)


def render_junit(run: Run) -> str:
    """The junit.xml text for the run's checks (ElementTree escapes every attribute and text)."""
    checks = run.record.checks
    totals = {status: sum(1 for c in checks if c.status == status) for status in ("fail", "error", "skip")}
    counts = {
        "tests": str(len(checks)),
        "failures": str(totals["fail"]),
        "errors": str(totals["error"]),
        "skipped": str(totals["skip"]),
        "time": "0",
    }
    root = ET.Element("testsuites", {"name": SUITE_NAME, **counts})
    suite = ET.SubElement(root, "testsuite", {"name": SUITE_NAME, "timestamp": run.record.meta.created_at, **counts})
    for check in checks:
        case = ET.SubElement(
            suite, "testcase", {"classname": TESTCASE_CLASSNAME, "name": for_xml(check.id), "time": "0"}
        )
        child = _CHILD_BY_STATUS.get(check.status)
        if child is not None:
            element = ET.SubElement(
                case, child, {"message": for_xml(check.summary or check.status), "type": check.status}
            )
            element.text = for_xml(_findings_text(check)) or None
        elif check.status == "warn":
            ET.SubElement(case, "system-out").text = for_xml(f"WARN: {check.summary}\n{_findings_text(check)}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
