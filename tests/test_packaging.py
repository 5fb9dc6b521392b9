"""What `pip install weightsync` (not editable) installs: every module of the tree and the main job's YAML."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_every_module_and_every_config(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools builds in the source tree, and the checkout stays as it is
    for name in ("weightsync", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("weightsync-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "weightsync").rglob("*.py")}
    configs = {"weightsync/conf/" + p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    assert modules and configs
    assert sorted(modules - names) == [], "modules missing from the wheel: list their packages in pyproject.toml"
    assert sorted(configs - names) == [], "configs missing from the wheel"
