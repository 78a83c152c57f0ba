"""The measured figures in README.md and docs/ are generated from benchmarks/results/ (issue 58 point 3).

``benchmarks/tables.py`` renders every ``<!-- results: NAME -->`` block; a committed block that differs from what it
makes of the committed results fails here. Negative control: one changed figure in a copy of the results changes the
rendered block.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from benchmarks import tables

pytestmark = pytest.mark.timeout(120)


def test_committed_blocks_equal_what_the_results_make():
    stale = []
    for rel in tables.FILES:
        _, changed = tables.render_file((tables.ROOT / rel).read_text())
        stale += [f"{rel}: {name}" for name in changed]
    stale += [str(p) for p, text in tables.standalone_tables().items() if p.read_text() != text]
    assert not stale, f"run `make results-tables` and commit: {stale}"
    assert tables.main(["--check"]) == 0


def test_every_block_has_a_renderer_and_every_renderer_a_block():
    used = []
    for rel in tables.FILES:
        used += [m.group("name") for m in tables.BLOCK.finditer((tables.ROOT / rel).read_text())]
    assert sorted(set(used)) == sorted(tables.RENDERERS), used
    assert len(used) == len(set(used)), "a block appears twice"


@pytest.mark.parametrize("name", sorted(tables.RENDERERS))
def test_each_table_names_its_machine_and_date(name):
    text = "\n".join(tables.RENDERERS[name]())
    assert re.search(r"20\d\d-\d\d-\d\d", text), "no measurement date"
    assert re.search(r"Xeon|EPYC|NVIDIA|CPU model not recorded", text), "no machine"


def test_a_changed_result_changes_the_table(tmp_path, monkeypatch):
    """Negative control: the README's headline block follows the trainer JSON it quotes."""
    copy = tmp_path / "results"
    shutil.copytree(tables.RESULTS, copy)
    readme = (tables.ROOT / "README.md").read_text()
    monkeypatch.setattr(tables, "RESULTS", copy)
    assert tables.render_file(readme)[1] == []
    assert len(tables.standalone_tables()) >= 4
    path = copy / "trainer_h1024_xeon_amx_cpu2.json"
    data = json.loads(path.read_text())
    data["runs"]["bfloat16"]["speed_ours_over_stock"] = 2.5
    path.write_text(json.dumps(data))
    new, changed = tables.render_file(readme)
    assert changed == ["headline"]
    assert "| 2.50x / " in new and "| 2.50x / " not in readme
