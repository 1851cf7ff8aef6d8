"""The documentation site (docs/): its code runs, its reference covers the
public API, and it builds with mkdocs's strict checks."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_public_api import PUBLIC

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "pages"
# Code fenced `python` is a whole program and runs here; `py` fences excerpts.
RUNNABLE = [ROOT / "README.md", *sorted(p for p in PAGES.rglob("*.md")
                                        if "```python\n" in p.read_text())]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name if p.parent == ROOT
                         else str(p.relative_to(PAGES)))
def test_the_code_of_each_page_runs(page):
    blocks = re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.S | re.M)
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks:  # in order, in one namespace, as a reader would run them
        exec(compile(block, str(page), "exec"), namespace)


def test_some_pages_hold_whole_programs():
    assert {p.name for p in RUNNABLE} >= {"README.md", "zero.md", "deepspeed.md"}


def test_the_readme_is_one_screen_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert targets and [t for t in targets if not (ROOT / t).exists()] == []


def test_the_reference_has_an_entry_for_every_public_name():
    hooks = _hooks()
    assert sorted(hooks.PUBLIC) == sorted(PUBLIC)
    for module, names in PUBLIC.items():
        page = hooks.api_page(module, names)
        assert [f"{module}.{n}" for n in names] == re.findall(r"^::: (\S+)$", page, re.M)
    assert hooks.undocumented() == []


def test_a_public_name_without_a_docstring_stops_the_build(monkeypatch):
    from mkdocs.exceptions import PluginError

    import shard

    def undocumented_transform(loss):
        return loss

    monkeypatch.setattr(shard, "undocumented_transform", undocumented_transform, raising=False)
    monkeypatch.setattr(shard, "__all__", [*shard.__all__, "undocumented_transform"])
    hooks = _hooks()
    assert hooks.undocumented() == ["shard.undocumented_transform"]
    with pytest.raises(PluginError, match=r"shard\.undocumented_transform"):
        hooks.on_config({})


def test_the_design_notes_are_gathered_from_the_code():
    titles = [t for t, _, _ in _hooks().notes()]
    assert len(titles) >= 40 and len(set(titles)) == len(titles)
    assert {"TrainState", "optax on shards", "untrusted checkpoints", "pipeline"} <= set(titles)


@pytest.mark.multiprocess
def test_the_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a broken link, anchor or cross-reference, or
    a docstring mkdocstrings cannot parse, fails it (the notebooks as
    committed; ``make docs`` executes them)."""
    env = dict(os.environ, ZEROSHARD_DOCS_NOTEBOOKS="source", NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "-f", "docs/mkdocs.yml", "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "shard" / "index.html").exists()
