"""Which wheels an offline CUDA machine needs to run the GPU lane, downloaded into one folder.

Usage: python3 scripts/gpu_wheels.py WHEEL_DIR [FREEZE] [--python-version 3.12]   (scripts/gpu-tests.sh bundle runs it)

GPU machines come with their own torch (a CUDA build matched to their driver), and often with no package index
in reach. This resolves the project with its `hybrid` extra, and pytest, for that machine's Python on Linux x86-64
(pip's resolver, metadata only, nothing installed; the `test` extra's linters and browser are not the lane's), then
downloads every wheel of that resolution except:

- torch, triton and the nvidia-* libraries: the machine's own CUDA torch is the one under test;
- streamlit and what only it pulls in (pyarrow's newest release, pydeck, pillow ...): the lane runs the commands,
  not the dashboard, and they would make the bundle several times larger;
- what the machine has already (FREEZE, the output of `python -m pip freeze` there) in a version that satisfies
  every requirement the resolution places on it: an older transformers is replaced, a newer numpy is kept.

The wheels install with `pip install --no-index --no-deps --target` (scripts/gpu-tests.sh offline), which
takes precedence over the machine's site-packages on PYTHONPATH; the project itself is built there from the
checkout (its wheel carries the 48 MB demo draft, which the lane does not use).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
EXTRAS = "hybrid"
# pytest (on several workers) runs the lane; setuptools and wheel build the project on the machine (no build
# isolation offline)
LANE_TOOLS = ("pytest>=8", "pytest-xdist>=3.5", "setuptools>=69", "wheel")
# the official DFlash loop that benchmarks/gpu_engine.py --official times ours against (pure Python; its own
# requirements are torch and transformers, which the lane has)
BENCHMARK_ONLY = ("dflash==0.1.0",)
NOT_THE_LANES = {"streamlit"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "linux_x86_64")
MACHINE_OWN = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*)$")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def resolve(python_version: str) -> list[dict]:
    """pip's resolution of the project (with the lane's extras) for the GPU machine's interpreter: the report's
    install items, each with its name, version and requirements."""
    platform_args = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        _pip(
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            *platform_args,
            "--target",
            str(Path(scratch) / "unused"),
            "--report",
            str(report),
            f"{REPO}[{EXTRAS}]",
            *LANE_TOOLS,
        )
        return json.loads(report.read_text())["install"]


def read_freeze(path: Path | None) -> dict[str, Version]:
    """name -> version of the `name==version` lines of a pip freeze (editable and URL lines name no version)."""
    if path is None:
        return {}
    installed = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            installed[canonicalize_name(name)] = Version(version)
    return installed


def _requirements_on(items: list[dict], python_version: str) -> dict[str, list[Requirement]]:
    """Every requirement the resolution's packages place on each name, markers evaluated for the GPU machine
    (its Python, Linux) and for the extras the resolution asked for."""
    environment = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
    }
    extras_of = {canonicalize_name(item["metadata"]["name"]): set(item.get("requested_extras") or []) for item in items}
    extras_of["dflash-doctor"] = set(EXTRAS.split(","))
    placed: dict[str, list[Requirement]] = {}
    for item in items:
        for line in item["metadata"].get("requires_dist") or []:
            requirement = Requirement(line)
            wanted = [""] + sorted(extras_of.get(canonicalize_name(item["metadata"]["name"]), set()))
            if requirement.marker is None or any(
                requirement.marker.evaluate({**environment, "extra": e}) for e in wanted
            ):
                placed.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return placed


def _reachable(items: list[dict], python_version: str) -> set[str]:
    """The names the lane's roots (the project, LANE_TOOLS) reach without passing through NOT_THE_LANES or the
    machine's own torch stack."""
    placed_by = {canonicalize_name(item["metadata"]["name"]): item for item in items}
    # what each package requires: the keys of the requirements it alone places
    requirements = {name: set(_requirements_on([item], python_version)) for name, item in placed_by.items()}
    stack = ["dflash-doctor", *(canonicalize_name(Requirement(tool).name) for tool in LANE_TOOLS)]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in NOT_THE_LANES or MACHINE_OWN.match(name) or name not in placed_by:
            continue
        seen.add(name)
        stack.extend(requirements[name])
    return seen


def needed(items: list[dict], installed: dict[str, Version], python_version: str) -> list[tuple[str, str]]:
    """(name, version) of the resolved wheels the machine lacks, in the resolver's versions."""
    reachable = _reachable(items, python_version)
    placed = _requirements_on(
        [item for item in items if canonicalize_name(item["metadata"]["name"]) in reachable], python_version
    )
    wanted = []
    for item in items:
        name = canonicalize_name(item["metadata"]["name"])
        if name == "dflash-doctor" or name not in reachable:
            continue
        have = installed.get(name)
        if have is not None and all(
            requirement.specifier.contains(have, prereleases=True) for requirement in placed.get(name, [])
        ):
            continue
        wanted.append((name, item["metadata"]["version"]))
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel_dir", type=Path)
    parser.add_argument("freeze", type=Path, nargs="?")
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args()
    args.wheel_dir.mkdir(parents=True, exist_ok=True)
    items = resolve(args.python_version)
    wanted = needed(items, read_freeze(args.freeze), args.python_version)
    platform_args = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    _pip(
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        *platform_args,
        "-d",
        str(args.wheel_dir),
        *(f"{name}=={version}" for name, version in wanted),
        *BENCHMARK_ONLY,
    )
    print(
        f"{len(wanted) + len(BENCHMARK_ONLY)} wheels in {args.wheel_dir}: "
        + ", ".join([f"{n} {v}" for n, v in wanted] + list(BENCHMARK_ONLY))
    )


if __name__ == "__main__":
    main()
