"""Each tier installs alone from a freshly built wheelhouse, and the wheels'
inter-package version ranges hold.

The wheelhouse is built once per module by tools/build_wheels.sh (the tool a
user runs). Every tier then gets its own fresh venv (no system site-packages)
and a plain ``pip install --find-links <wheelhouse> <dist>``: its laminar-common
must come from the wheelhouse, every third-party dependency from the index.
laminar-common, laminar-relay and laminar-examples (the example jobs' package, whose
warm starts come with its ``train`` extra) must install without torch; laminar-rollout
and laminar-trainer install their full dependency set, torch pinned to the
release the project tests (a constraints file), so ``pip check`` covers them
too. ``--no-compile`` halves the torch tiers' install time (bytecode for torch
and transformers is most of it) and changes nothing that is checked here.

Needs pip, ``venv`` and the package index (hatchling for the builds, the
tiers' dependencies).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

# One pytest-xdist worker runs this file's tests (the "install" group): they share a
# module fixture.
pytestmark = pytest.mark.xdist_group("install")

ROOT = Path(__file__).resolve().parents[1]
DISTS = ("laminar-common", "laminar-relay", "laminar-rollout", "laminar-trainer")
EXAMPLES = "laminar-examples"
"""The examples' package: built beside the libraries, depends on laminar-common only."""
TORCH_PIN = "torch==2.13.0"
INSTALL_TIMEOUT_S = 600


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run(args: list[str | Path], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          env=_env(), timeout=timeout_s, check=False)


def _ok(args: list[str | Path], timeout_s: float = 120) -> str:
    proc = _run(args, timeout_s)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, args))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _wheel_dist(wheel: Path) -> PathDistribution:
    """The metadata of a built wheel, read in place (as installed metadata would be)."""
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
    return PathDistribution(zipfile.Path(wheel, dist_info + "/"))


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "tools" / "build_wheels.sh"), "--wheels-only",
                           str(out)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                          env={**_env(), "PYTHON": sys.executable}, check=False)
    assert proc.returncode == 0, f"build_wheels.sh failed:\n{proc.stdout}\n{proc.stderr}"
    print(f"\nwheelhouse built in {time.monotonic() - start:.0f}s")
    return out


@pytest.fixture(scope="module")
def built_versions(wheelhouse) -> dict[str, str]:
    """Distribution name -> version, one entry per wheel the build produced."""
    dists = [_wheel_dist(w) for w in sorted(wheelhouse.glob("*.whl"))]
    versions = {d.metadata["Name"]: d.version for d in dists}
    assert sorted(versions) == sorted((*DISTS, EXAMPLES)), f"wheelhouse holds {sorted(versions)}"
    return versions


def _install_alone(wheelhouse: Path, tmp_path: Path, dist: str) -> Path:
    """A fresh venv holding ``dist`` and its dependencies; returns its bin dir."""
    venv = tmp_path / "venv"
    _ok([sys.executable, "-m", "venv", venv])
    bin_dir = venv / "bin"
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    start = time.monotonic()
    _ok([bin_dir / "python", "-m", "pip", "install", "--quiet", "--no-compile",
         "--find-links", wheelhouse, "--constraint", constraints, dist],
        timeout_s=INSTALL_TIMEOUT_S)
    print(f"\n{dist} installed alone in {time.monotonic() - start:.0f}s")
    return bin_dir


def _check_installed(bin_dir: Path, built_versions: dict[str, str], cli: str) -> None:
    """--help runs, pip finds nothing broken, and laminar-common is the one just built."""
    assert "usage" in _ok([bin_dir / cli, "--help"]).lower()
    _ok([bin_dir / "python", "-m", "pip", "check"])
    common = _ok([bin_dir / "python", "-c",
                  "import importlib.metadata as m; print(m.version('laminar-common'))"])
    assert common.strip() == built_versions["laminar-common"]


def _assert_no_torch(bin_dir: Path) -> None:
    proc = _run([bin_dir / "python", "-c", "import torch"])
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr, proc.stderr


def test_inter_package_ranges_hold(built_versions, wheelhouse):
    """Every laminar-* requirement of every wheel (extras included) admits the
    version of that package built beside it."""
    checked = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        dist = _wheel_dist(wheel)
        for line in dist.requires or []:
            req = Requirement(line)
            if not req.name.startswith("laminar-"):
                continue
            assert req.name in built_versions, f"{dist.metadata['Name']} requires {line}"
            built = built_versions[req.name]
            assert req.specifier.contains(built, prereleases=True), (
                f"{dist.metadata['Name']} requires {line!r}, but {req.name} is {built}")
            checked.append((dist.metadata["Name"], req.name))
    # each tier's own dependency on the shared core was among those checked
    for tier in (*DISTS[1:], EXAMPLES):
        assert (tier, "laminar-common") in checked
    assert (EXAMPLES, "laminar-trainer") in checked  # its train extra


def test_common_installs_alone(wheelhouse, built_versions, tmp_path):
    bin_dir = _install_alone(wheelhouse, tmp_path, "laminar-common")
    _check_installed(bin_dir, built_versions, "laminar")
    _assert_no_torch(bin_dir)
    proto = _ok([bin_dir / "python", "-c",
                 "from importlib.resources import files; "
                 "print((files('laminar_common.relay.proto') / 'laminar' / 'relay' / 'v1' "
                 "/ 'relay.proto').read_text())"])
    assert "package laminar.relay.v1;" in proto


def test_relay_installs_alone_without_torch(wheelhouse, built_versions, tmp_path):
    bin_dir = _install_alone(wheelhouse, tmp_path, "laminar-relay")
    _check_installed(bin_dir, built_versions, "laminar-relay")
    _assert_no_torch(bin_dir)


def test_examples_install_alone_without_torch_and_write_prompts(wheelhouse, built_versions,
                                                                tmp_path):
    bin_dir = _install_alone(wheelhouse, tmp_path, EXAMPLES)
    _check_installed(bin_dir, built_versions, "laminar-examples")
    _assert_no_torch(bin_dir)
    out = tmp_path / "p.jsonl"
    assert "wrote 3 sort records" in _ok([bin_dir / "laminar-examples", "prompts", "--n", "3",
                                          "--out", out])
    warm = _run([bin_dir / "laminar-examples", "warmstart", "--out", tmp_path / "m"])
    assert warm.returncode == 2 and "pip install 'laminar-examples[train]'" in warm.stderr


@pytest.mark.parametrize("dist", ["laminar-rollout", "laminar-trainer"])
def test_torch_tier_installs_alone(wheelhouse, built_versions, tmp_path, dist):
    bin_dir = _install_alone(wheelhouse, tmp_path, dist)
    _check_installed(bin_dir, built_versions, dist)
