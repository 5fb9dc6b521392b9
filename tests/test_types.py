"""The package type-checks: mypy, configured in pyproject.toml's [tool.mypy], finds nothing in weightsync/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# About 20 s from a cold cache on 2 cores, alone; more beside another test process.
@pytest.mark.timeout(300)
def test_mypy_finds_no_error_in_the_package(tmp_path, monkeypatch):
    from mypy import api

    # mypy reads [tool.mypy] (the files to check, the flags) from the pyproject.toml of the directory it runs in.
    monkeypatch.chdir(ROOT)
    # A cache of this run's own: nothing a previous run or another checkout left can hide an error.
    stdout, stderr, status = api.run(["--cache-dir", os.fspath(tmp_path / "mypy-cache")])
    assert status == 0, f"mypy (exit status {status}):\n{stdout}{stderr}"
