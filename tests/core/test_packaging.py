"""A wheel of vigil installs into a fresh venv and imports every subpackage; it ships no test
support."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ["agent", "collector", "analyzer", "recovery", "trainer", "kernels"]
# Test support shared by tests and benchmarks (tests/support/): never part of the product.
TEST_SUPPORT = {p.stem for p in (ROOT / "tests" / "support").glob("*.py")} - {"__init__"}
# Caches, environments and build output in a checkout, left out of the copy that is built.
NOT_SOURCES = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_wheel_installs_and_imports_every_subpackage(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # Built from a copy of the sources: a build in the checkout would leave a vigil.egg-info in
    # the root, whose entry points shadow the installed ones for anything run from there. sdist,
    # then the wheel from the unpacked sdist (what a release does): a wheel built straight from
    # a tree ships whatever a stale build/lib there still holds.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("vigil-*.whl")
    modules = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
    assert modules and all(n.startswith("vigil/") for n in modules), modules
    assert TEST_SUPPORT, "tests/support/ holds the test support"
    shipped_support = [n for n in modules if Path(n).stem in TEST_SUPPORT]
    assert not shipped_support, shipped_support
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # The wheel itself goes in for real; its dependencies come from this environment's
    # site-packages through a .pth line (which does not run this checkout's editable hook).
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    imports = "; ".join(f"import vigil.{p}" for p in SUBPACKAGES)
    code = f"import vigil, pathlib; {imports}; print(pathlib.Path(vigil.__file__).parent)"
    where = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site), "vigil must come from the wheel"
    for part in SUBPACKAGES:
        assert (site / "vigil" / part / "__init__.py").is_file()
    # The web UI's page shell and assets are package data: a wheel without them serves 404s.
    ui = site / "vigil" / "collector" / "ui"
    for asset in (
        "templates/index.html",
        "static/heatmap.js",
        "static/vigil.css",
        "static/NOTICE.txt",
    ):
        assert (ui / asset).is_file(), asset
    version = subprocess.run(
        [env_dir / "bin" / "vigil", "version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("vigil ")
