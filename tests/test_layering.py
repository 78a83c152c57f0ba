"""The layering is a test (issue 39 point 6): import-linter checks pyproject.toml's ``[tool.importlinter]`` contracts
on the installed tree — plugins above deltasync above zerokld_models above shared_numerics above zerokld_plugins, the
two plugins independent, and the numerics / snapshot protocol / extension points free of vLLM and TorchTitan.

Negative controls: the same contracts without the listed exceptions, and with zerokld_models among the host-free
packages, are reported broken, naming the imports — the linter sees the real graph, so a new upward import fails here.
"""
from __future__ import annotations

import configparser
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _write_config(section: dict, path: Path) -> Path:
    """``section`` (pyproject's ``[tool.importlinter]`` table) as import-linter's INI config, written by configparser:
    lists as one item per line, each contract in ``[importlinter:contract:<id>]``."""
    def val(v):
        return "\n".join(v) if isinstance(v, list) else str(v)

    ini = configparser.ConfigParser()
    ini["importlinter"] = {k: val(v) for k, v in section.items() if k != "contracts"}
    for c in section["contracts"]:
        ini[f"importlinter:contract:{c['id']}"] = {k: val(v) for k, v in c.items() if k != "id"}
    with path.open("w") as f:
        ini.write(f)
    return path


@pytest.fixture(scope="module")
def section() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def test_import_contracts_kept():
    r = _lint(ROOT / "pyproject.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Contracts: (\d+) kept, 0 broken", r.stdout), r.stdout


def test_without_the_listed_exceptions_the_upward_imports_are_reported(section, tmp_path):
    contracts = [{k: v for k, v in c.items() if k != "ignore_imports"} for c in section["contracts"]]
    r = _lint(_write_config({**section, "contracts": contracts}, tmp_path / "strict.ini"))
    assert r.returncode != 0, r.stdout
    assert "zerokld_models is not allowed to import vllm_plugin" in r.stdout, r.stdout
    assert "zerokld_models is not allowed to import titan_plugin" in r.stdout, r.stdout


def test_a_package_that_imports_vllm_breaks_the_host_free_contract(section, tmp_path):
    contracts = [dict(c, source_modules=[*c["source_modules"], "zerokld_models"]) if c["id"] == "hosts" else c
                 for c in section["contracts"]]
    r = _lint(_write_config({**section, "contracts": contracts}, tmp_path / "hosts.ini"))
    assert r.returncode != 0, r.stdout
    assert "zerokld_models is not allowed to import vllm" in r.stdout, r.stdout
