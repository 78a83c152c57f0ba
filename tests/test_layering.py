"""The layering is a test (issue 39 point 6): import-linter checks pyproject.toml's ``[tool.importlinter]`` contracts
on the installed tree — plugins above deltasync above zerokld_models above shared_numerics above zerokld_plugins, the
two plugins independent, the numerics, the architecture declarations, the snapshot protocol and the extension
points free of vLLM and TorchTitan, and no import cycle between sibling modules or packages at any depth,
function-level imports included (issue 77 point 4). No exceptions are listed: the architecture folders describe, the
plugins build (issue 39 point 3). Two scans of the library's source (issue 77 point 4): no architecture name (HF class
or model type) outside its ``zerokld_models/<arch>/`` folder, and no decision by a token mixer's or an MLP's name
outside its component (:mod:`zerokld_models.mixers`, :mod:`zerokld_models.mlps`).

Negative controls: a copy of ``zerokld_models`` with the host binding the folders used to carry put back
(``qwen3/vllm.py`` importing vLLM's class and ``vllm_plugin.models.dense``) is reported by both contracts, naming the
import; the contracts with ``zerokld_models`` moved above ``deltasync`` are reported broken — the linter sees the real
graph, so a new upward import fails here.
"""

from __future__ import annotations

import configparser
import importlib.util
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(config: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache", str(config)], cwd=cwd, capture_output=True, text=True, timeout=300)


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


def test_a_host_binding_put_back_into_an_architecture_folder_is_reported(tmp_path):
    shutil.copytree(ROOT / "zerokld_models", tmp_path / "zerokld_models", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "zerokld_models" / "qwen3" / "vllm.py").write_text(
        "from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM\n\n"
        "from vllm_plugin.models.dense import GQALayer\n"
    )
    # the linter puts its working directory first on the import path: the copy shadows the installed package
    r = _lint(ROOT / "pyproject.toml", cwd=tmp_path)
    assert r.returncode != 0, r.stdout
    assert "zerokld_models is not allowed to import vllm_plugin" in r.stdout, r.stdout
    assert "zerokld_models is not allowed to import vllm:" in r.stdout, r.stdout
    assert "zerokld_models.qwen3.vllm -> vllm_plugin.models.dense" in r.stdout, r.stdout


def test_an_import_cycle_put_back_is_reported(tmp_path):
    """The cycle :mod:`shared_numerics.attention_cpu` had (it read ``Q_TILE`` from :mod:`shared_numerics.attention`,
    which imports it inside a function), put back in a copy, is reported by the acyclic-siblings contract."""
    shutil.copytree(
        ROOT / "shared_numerics", tmp_path / "shared_numerics", ignore=shutil.ignore_patterns("__pycache__")
    )
    with (tmp_path / "shared_numerics" / "attention_cpu.py").open("a") as f:
        f.write("\n\ndef _tile():\n    from .attention import Q_TILE\n\n    return Q_TILE\n")
    r = _lint(ROOT / "pyproject.toml", cwd=tmp_path)
    assert r.returncode != 0, r.stdout
    assert "No cycles are allowed in shared_numerics" in r.stdout, r.stdout
    assert re.search(r"\.attention(_cpu)? -> \.attention(_cpu)?\b", r.stdout), r.stdout


#: the library: every package but the tests' factory; ``zerokld_models/<arch>/`` folders are where names belong
LIBRARY = ("shared_numerics", "zerokld_models", "zerokld_plugins", "deltasync", "titan_plugin", "vllm_plugin")
#: strings that equal an architecture name but name something else: TorchTitan's ``ComplexRoPE`` ``scaling`` kind
#: for Llama 3.x frequency scaling (``torchtitan/models/common/rope.py``), a RoPE option
NOT_ARCHITECTURES = {"llama"}


def _library_sources() -> dict[str, str]:
    out = {}
    for pkg in LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not (rel.startswith("zerokld_models/") and rel.count("/") > 1):  # not inside an architecture folder
                out[rel] = path.read_text()
    return out


def _architecture_names() -> set[str]:
    """Every registered architecture (HF class name) and the HF model types whose causal LM is one of them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from zerokld_plugins import registered

    archs = set(registered("model"))
    return archs | {t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls in archs}


def _string_constants(text: str):
    """``(line, value)`` of every string constant in ``text`` that is not a bare string statement (a docstring)."""
    import ast

    tree = ast.parse(text)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose:
            yield n.lineno, n.value


def _architecture_names_in(sources: dict[str, str], names: set[str]) -> list[str]:
    return [
        f"{path}:{line} {value!r}"
        for path, text in sources.items()
        for line, value in _string_constants(text)
        if value in names and value not in NOT_ARCHITECTURES
    ]


#: component kinds (and ``ModelAdapterSpec.attention`` values, old and new) a decision must not test by name
COMPONENT_NAMES = {"gqa", "mha", "mla", "dsa", "swiglu", "moe", "deepseek_moe"}
COMPONENT_MODULES = {"zerokld_models/mixers.py", "zerokld_models/mlps.py"}


def _component_name_decisions_in(sources: dict[str, str]) -> list[str]:
    """``path:line`` of every comparison (``==``, ``!=``, ``in``, ``not in``) against a component's name outside the
    component modules."""
    import ast

    found = []
    for path, text in sources.items():
        if path in COMPONENT_MODULES:
            continue
        for n in ast.walk(ast.parse(text)):
            if not isinstance(n, ast.Compare):
                continue
            values = []
            for side in (n.left, *n.comparators):
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                values += [e.value for e in elts if isinstance(e, ast.Constant)]
            if COMPONENT_NAMES.intersection(v for v in values if isinstance(v, str)):
                found.append(f"{path}:{n.lineno}")
    return found


def test_no_architecture_name_outside_its_folder():
    """Negative controls: the reader's GLM router default as it was written (model types tested inside the shared
    reader) and a plugin's default architecture argument are found."""
    names = _architecture_names()
    assert {"Qwen3ForCausalLM", "qwen3", "glm_moe_dsa", "DeepseekV3ForCausalLM"} <= names
    sources = _library_sources()
    assert len(sources) > 100 and "zerokld_models/config.py" in sources
    assert _architecture_names_in(sources, names) == []
    old = {
        "config.py": 'glm = model_type in ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "deepseek_v32")\n',
        "moe.py": 'def check_moe_supported(vllm_config, architecture: str = "Qwen3MoeForCausalLM"):\n    """Doc."""\n',
    }
    assert _architecture_names_in(old, names) == [
        "config.py:1 'glm4_moe'",
        "config.py:1 'glm4_moe_lite'",
        "config.py:1 'glm_moe_dsa'",
        "config.py:1 'deepseek_v32'",
        "moe.py:1 'Qwen3MoeForCausalLM'",
    ]


def test_no_decision_by_a_component_name_outside_its_component():
    """Hosts ask a layer's component (its cache kind, TP split, LoRA and CP support), never its name. Negative
    controls: the family checks the plugins made before (``adapter.attention == "mla"``, a kind in a tuple) are
    found."""
    assert _component_name_decisions_in(_library_sources()) == []
    old = {
        "rl.py": 'mla_tp = tp > 1 and adapter_for(cfg).attention == "mla"\n',
        "classes.py": 'if spec.attention != "mha":\n    pass\nok = layer.mlp.kind in ("moe", "deepseek_moe")\n',
    }
    assert _component_name_decisions_in(old) == ["rl.py:1", "classes.py:1", "classes.py:3"]


def test_layers_in_another_order_are_reported_broken(section, tmp_path):
    """zerokld_models imports shared_numerics (its HF-config reader uses the RoPE scaling type): with
    shared_numerics put above it, the linter reports that import."""
    contracts = [
        dict(
            c,
            layers=["titan_plugin | vllm_plugin", "deltasync", "shared_numerics", "zerokld_models", "zerokld_plugins"],
        )
        if c["id"] == "layers"
        else c
        for c in section["contracts"]
    ]
    r = _lint(_write_config({**section, "contracts": contracts}, tmp_path / "reordered.ini"))
    assert r.returncode != 0, r.stdout
    assert "zerokld_models is not allowed to import shared_numerics" in r.stdout, r.stdout


def test_importing_the_trainer_plugin_changes_nothing_in_torch_or_torchtitan():
    """Issue 39 point 4: the CPU shims are applied by the entry points (``RLTrainer``, ``build_titan_model``), not by
    an import. Negative control: the explicit ``cpu_compat.apply()`` changes every value the check reads."""
    code = textwrap.dedent("""
        import torch
        import torch.distributed
        import torchtitan.tools.utils as tu
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

        def state():
            return (tu.device_type, tu.device_module, hasattr(torch.distributed, "set_timeout"),
                    fc._get_gradient_divide_factors)

        before = state()
        import titan_plugin, titan_plugin.client, titan_plugin.models, titan_plugin.rl  # noqa: E401
        assert state() == before, (before, state())
        titan_plugin.cpu_compat.apply()
        after = state()
        print(sum(a is not b for a, b in zip(before, after, strict=True)), after[0])
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["4", "cpu"], r.stdout


def test_the_example_and_the_benchmarks_use_public_api_only():
    """Issue 39 point 5: the countdown example and the benchmarks import nothing of the test package but its top-level
    names, the tiny-checkpoint factory and its synthetic requests (engines: :mod:`vllm_plugin.engines`, servers:
    :mod:`vllm_plugin.serve`, machine facts: :mod:`shared_numerics.machine`)."""
    import ast

    import zerokld_testing

    factory = set(zerokld_testing.__all__)
    found, scanned = [], 0
    for path in sorted([*(ROOT / "examples").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        scanned += 1
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerokld_testing"):
                names = {a.name for a in node.names}
                if node.module != "zerokld_testing" or not names <= factory:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module} {sorted(names)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("zerokld_testing") for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} import {[a.name for a in node.names]}")
    assert found == [], found
    assert scanned > 10
    assert factory == {
        "DeepSeekSpec",
        "TinyModelSpec",
        "make_deepseek_checkpoint",
        "make_qwen3_next_checkpoint",
        "make_tiny_checkpoint",
        "make_tokenizer",
        "mixed_sampling_params",
        "random_datums",
        "random_prompts",
        "realistic_qwen3_next",
    }


def _is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


def _vllm_attribute_assignments(sources: dict[str, str]) -> set[str]:
    """``"module:Name.attr"`` of every ``Name.attr = ...`` in ``sources`` (path -> text) where ``Name`` was imported
    from vLLM in the same file (``from vllm.x import Name`` / ``import vllm.x as Name``)."""
    import ast

    found = set()
    for text in sources.values():
        tree = ast.parse(text)
        names = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                for a in node.names:  # a submodule (``from vllm.x import y``, y a module) is ``vllm.x.y:``
                    sub = importlib.util.find_spec(f"{node.module}.{a.name}") if _is_package(node.module) else None
                    names[a.asname or a.name] = f"{node.module}.{a.name}:" if sub else f"{node.module}:{a.name}"
            elif isinstance(node, ast.Import):
                names.update({a.asname: f"{a.name}:" for a in node.names if a.asname and a.name.startswith("vllm.")})
        for node in ast.walk(tree):
            for t in node.targets if isinstance(node, ast.Assign) else []:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in names:
                    base = names[t.value.id]
                    found.add(f"{base}{t.attr}" if base.endswith(":") else f"{base}.{t.attr}")
    return found


def test_vllm_attributes_are_replaced_only_through_the_seam_table():
    """Issue 39 point 1: ``vllm_plugin`` assigns no vLLM attribute itself — every replacement goes through
    :func:`vllm_plugin.seams.replace`, which takes declared targets only, once each. Negative controls: the scan
    reports a direct assignment (the form the plugin used before), including through a submodule import."""
    sources = {str(p): p.read_text() for p in sorted((ROOT / "vllm_plugin").rglob("*.py"))}
    assert _vllm_attribute_assignments(sources) == set()
    assert _vllm_attribute_assignments(
        {
            "x.py": "from vllm.v1.sample.sampler import Sampler\nSampler.sample = f\n",
            "y.py": "from vllm.model_executor.model_loader import base_loader\nbase_loader.initialize_model = f\n",
        }
    ) == {"vllm.v1.sample.sampler:Sampler.sample", "vllm.model_executor.model_loader.base_loader:initialize_model"}


def test_registration_installs_every_declared_seam_and_refuses_others():
    """Every seam of the table is installed by ``register()`` (vLLM calls it in every process at start), each once;
    an undeclared target and a target this vLLM lacks are refused, naming it and the versions."""
    from vllm_plugin import seams
    from vllm_plugin.register import register

    register()
    assert set(seams.installed()) == {s.target for s in seams.SEAMS}
    assert seams.missing() == []
    with pytest.raises(seams.SeamError, match="does not declare"):
        seams.replace("vllm.v1.sample.sampler:Sampler.greedy_sample", lambda original: original)
    with pytest.raises(seams.SeamError, match="would wrap that patch"):  # a second patch of an installed target
        seams.replace("vllm.v1.sample.sampler:Sampler.sample", lambda original: original)
    gone = seams.Seam("vllm.v1.sample.sampler:Sampler.no_such_method", "a test target", ("tests",))
    with pytest.raises(
        seams.SeamError,
        match=r"vLLM 0\.32\.0 \(verified with 0\.32\.0\): it lacks or changed "
        r"vllm\.v1\.sample\.sampler:Sampler\.no_such_method \(no such attribute",
    ):
        seams.check((*seams.SEAMS, gone))
    changed = seams.Seam(
        "vllm.v1.sample.sampler:Sampler.sample", "a test target", ("tests",), params=("self", "logits", "metadata")
    )
    with pytest.raises(
        seams.SeamError,
        match=r"Sampler\.sample \(parameters \(self, logits, sampling_metadata, "
        r"logprobs_mode_override\), expected \(self, logits, metadata, \.\.\.\)",
    ):
        seams.check((changed,))
    with pytest.raises(seams.SeamError, match=r"compute_logprobs \(a staticmethod, not a function"):
        seams.check((seams.Seam("vllm.v1.sample.sampler:Sampler.compute_logprobs", "x", ("tests",)),))
