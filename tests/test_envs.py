"""The ``ZEROKLD_*`` environment variables live in one module (issue 58 point 5): ``zerokld_plugins.envs`` names,
types, defaults and documents each; no package reads one from ``os.environ`` itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerokld_plugins import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "shared_numerics",
    "deltasync",
    "zerokld_models",
    "zerokld_plugins",
    "titan_plugin",
    "vllm_plugin",
    "examples",
    "benchmarks",
)


def test_values_defaults_and_errors(monkeypatch, tmp_path):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.ZEROKLD_GEMM_THREADS == 1 and envs.ZEROKLD_AMX is True and envs.ZEROKLD_BACKEND is None
    assert Path.home() / ".cache" / "zerokld" == envs.ZEROKLD_CACHE_DIR
    monkeypatch.setenv("ZEROKLD_GEMM_THREADS", "")  # empty: the default, as before
    assert envs.ZEROKLD_GEMM_THREADS == 1
    monkeypatch.setenv("ZEROKLD_AMX", "0")
    monkeypatch.setenv("ZEROKLD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ZEROKLD_KV_CACHE_BYTES", "1024")
    assert envs.ZEROKLD_AMX is False and tmp_path == envs.ZEROKLD_CACHE_DIR and envs.ZEROKLD_KV_CACHE_BYTES == 1024
    monkeypatch.setenv("ZEROKLD_AMX", "1")
    assert envs.ZEROKLD_AMX is True  # only "0" turns a switch off
    monkeypatch.setenv("ZEROKLD_GEMM_THREADS", "two")
    with pytest.raises(ValueError, match="ZEROKLD_GEMM_THREADS='two'"):
        _ = envs.ZEROKLD_GEMM_THREADS
    with pytest.raises(AttributeError):
        _ = envs.ZEROKLD_NOT_A_VARIABLE
    assert {r["name"] for r in envs.describe()} == set(envs.VARIABLES)


def test_no_package_reads_a_zerokld_variable_itself():
    """Every ``ZEROKLD_*`` read goes through ``envs``; a name used anywhere in the packages is declared there."""
    direct, used = [], set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            direct += [
                f"{path.relative_to(ROOT)}: {m}"
                for m in re.findall(r"(?:environ\.get|getenv|environ\[)\(?[\"'](ZEROKLD_\w+)", text)
            ]
            used |= set(re.findall(r"envs\.(ZEROKLD_\w+)", text))
    assert direct == []
    assert used and used <= set(envs.VARIABLES)
