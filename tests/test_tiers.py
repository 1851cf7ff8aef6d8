"""The tiers hold: every test that starts Python processes or network
namespaces carries its marker, so that ``make test-fast`` (which leaves them
out) never starts one. Read from the test files' syntax: a test reaches a
launch through ``tests.multiproc``, ``sys.executable``, ``torchrun`` or the
``gloo_shared`` and ``run_benchmark`` fixtures, or a
namespace through ``tests.netns``, in its own body or in a helper or fixture
of its module it calls."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LAUNCHES = {"tests.multiproc": "multiprocess", "tests.netns": "netns"}


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _imported(nodes: list[ast.AST]) -> dict[str, str | None]:
    """Names bound by imports: the marker a launching module's names need."""
    out: dict[str, str | None] = {}
    for n in nodes:
        if isinstance(n, ast.ImportFrom):
            for a in n.names:
                module = f"{n.module}.{a.name}" if n.module == "tests" else n.module
                out[a.asname or a.name] = LAUNCHES.get(module)
    return out


def _markers(fn: ast.FunctionDef, module: set[str]) -> set[str]:
    marks = set(module)
    for d in fn.decorator_list:
        if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Attribute) \
                and d.value.attr == "mark":
            marks.add(d.attr)
    return marks


def needed(path: Path) -> dict[str, tuple[set[str], set[str]]]:
    """Per test of ``path``: (the markers its launches need, the markers it has)."""
    tree = ast.parse(path.read_text())
    base = {"executable": "multiprocess", "torchrun": "multiprocess",
            "gloo_shared": "multiprocess",  # conftest's fixture: shared gloo launches
            "run_benchmark": "multiprocess",  # conftest's fixture: the benchmarks launch
            **_imported(tree.body)}
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    module = set()
    for n in tree.body:  # pytestmark = pytest.mark.X
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                             for t in n.targets):
            module |= {a.attr for a in ast.walk(n.value) if isinstance(a, ast.Attribute)}
    memo: dict[str, set[str]] = {}

    def kinds(name: str, seen: tuple = ()) -> set[str]:
        if name not in memo:
            fn = funcs[name]
            roots = {**base, **_imported(list(ast.walk(fn)))}
            found = {roots[n] for n in _names(fn) if roots.get(n)}
            for n in _names(fn) | {a.arg for a in fn.args.args}:
                if n in funcs and n != name and n not in seen:
                    found |= kinds(n, (*seen, name))
            memo[name] = found
        return memo[name]

    return {name: (kinds(name), _markers(fn, module)) for name, fn in funcs.items()
            if name.startswith("test_")}


def test_every_launch_is_marked():
    unmarked = [f"{path.name}::{name} needs {sorted(need - have)}"
                for path in sorted(TESTS.glob("test_*.py"))
                for name, (need, have) in needed(path).items() if need - have]
    assert unmarked == []


def test_the_check_sees_a_launch_through_a_helper(tmp_path):
    """The check itself: a helper that launches makes its caller need the marker."""
    f = tmp_path / "test_x.py"
    f.write_text("from tests.multiproc import run_ranks\n\n"
                 "def helper(tmp):\n    return run_ranks('w.py', 2, tmp, {})\n\n"
                 "def test_a(tmp_path):\n    helper(tmp_path)\n\n"
                 "def test_b():\n    pass\n")
    got = needed(f)
    assert got["test_a"] == ({"multiprocess"}, set()) and got["test_b"] == (set(), set())


def test_every_listed_slow_case_names_a_test_that_exists():
    """``tests/conftest.py``'s slow cases are node ids: one whose file or test
    function was renamed would silently fall back into the fast tier."""
    from tests.conftest import SLOW_CASES

    stale = []
    for node in sorted(SLOW_CASES):
        path, _, name = node.partition("::")
        tree = ast.parse((TESTS.parent / path).read_text()) if (TESTS.parent / path).exists() \
            else None
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} if tree else set()
        if name.split("[")[0] not in defined:
            stale.append(node)
    assert stale == []
