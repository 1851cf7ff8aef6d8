"""MkDocs hooks: the pages made from the code.

- ``index.md``: the README;
- ``api/<module>.md``: one reference entry per name in each public module's
  ``__all__`` (rendered by mkdocstrings), so a new public name has its entry;
- ``design-notes.md``: every ``[Note: ...]`` block of the library's sources,
  in the order of the folders;
- ``notebooks/<name>.md``: each notebook, executed (with
  ``ZEROSHARD_DOCS_NOTEBOOKS=source``: as committed, without outputs).

The build stops (mkdocs's PluginError) when a public callable has no docstring.
"""

from __future__ import annotations

import base64
import importlib
import os
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = ["shard", "shard.checkpoint", "ops", "ops.testing", "interop", "interop.torch",
          "interop.jax"]
SOURCES = ["ops", "shard", "interop"]


def _public() -> dict[str, list[str]]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return {m: sorted(importlib.import_module(m).__all__) for m in PUBLIC}


def undocumented() -> list[str]:
    """Public callables (functions, classes) without a docstring of their own."""
    missing = []
    for module, names in _public().items():
        m = importlib.import_module(module)
        for name in names:
            obj = getattr(m, name)
            if callable(obj) and not (obj.__doc__ or "").strip():
                missing.append(f"{module}.{name}")
    return missing


def api_page(module: str, names: list[str]) -> str:
    doc = (importlib.import_module(module).__doc__ or "").strip().split("\n\n")[0]
    lines = [f"# `{module}`", "", doc, ""]
    for name in names:
        lines += [f"::: {module}.{name}", ""]
    return "\n".join(lines)


_HEADER = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$")


def _rst_to_md(text: str) -> str:
    text = re.sub(r":(?:func|class|meth|attr|mod|data):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def notes() -> list[tuple[str, str, str]]:
    """(title, path, body) of every note: a ``[Note: title]`` line in a
    docstring runs to the next note or the docstring's end; in comments, to
    the comment's end."""
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            lines = path.read_text().splitlines()
            i = 0
            while i < len(lines):
                m = _HEADER.match(lines[i])
                if not m or "see [Note" in lines[i]:
                    i += 1
                    continue
                comment = lines[i].lstrip().startswith("#")
                body, i = [], i + 1
                while i < len(lines):
                    line = lines[i]
                    if _HEADER.match(line):
                        break
                    if comment:
                        if not line.lstrip().startswith("#"):
                            break
                        line = line.lstrip()[1:]
                        line = line[1:] if line.startswith(" ") else line
                        if set(line.strip()) == {"~"}:
                            i += 1
                            continue
                    elif '"""' in line:
                        body.append(line.split('"""')[0])
                        break
                    body.append(line)
                    i += 1
                text = "\n".join(body)
                indent = min((len(x) - len(x.lstrip()) for x in body if x.strip()), default=0)
                text = "\n".join(x[indent:] for x in text.splitlines()).strip()
                found.append((m.group(1), str(path.relative_to(ROOT)), _rst_to_md(text)))
    return found


def notes_page() -> str:
    out = ["# Design notes", "",
           "The library explains its design where the code is: each `[Note: ...]` block of "
           "the sources, gathered here (the code refers to them as `see [Note: ...]`).", ""]
    for title, path, body in notes():
        out += [f"## {title}", "", f"*`{path}`*", "", body, ""]
    return "\n".join(out)


def notebook_page(path: Path, execute: bool) -> str:
    import warnings

    import nbformat

    with warnings.catch_warnings():  # cells without ids: nbformat adds them
        warnings.simplefilter("ignore")
        nb = nbformat.read(path, as_version=4)
    if execute:
        import tempfile

        from nbclient import NotebookClient
        from traitlets.config import Config

        with tempfile.TemporaryDirectory() as tmp:  # no TCP port to lose to another process
            sockets = Config({"KernelManager": {"transport": "ipc",
                                                "connection_file": str(Path(tmp) / "kernel.json")}})
            NotebookClient(nb, timeout=600, kernel_name="python3", config=sockets,
                           resources={"metadata": {"path": str(path.parent)}}).execute()
    cells = list(nb.cells)
    title = (cells.pop(0).source if cells and cells[0].cell_type == "markdown"
             and cells[0].source.startswith("# ") else f"# {path.stem}")
    out = [title, "", f"*`notebooks/{path.name}`, "
           + ("executed when this site was built*" if execute else "as committed*"), ""]
    for cell in cells:
        if cell.cell_type == "markdown":
            out += [cell.source, ""]
        elif cell.cell_type == "code":
            out += ["```python", cell.source, "```", ""]
            for o in cell.get("outputs", []):
                if o.get("output_type") == "stream":
                    out += ["```text", o["text"].rstrip(), "```", ""]
                elif "image/png" in o.get("data", {}):
                    data = o["data"]["image/png"]
                    data = data if isinstance(data, str) else base64.b64encode(data).decode()
                    out += [f"![output](data:image/png;base64,{data.strip()})", ""]
                elif "text/plain" in o.get("data", {}):
                    out += ["```text", o["data"]["text/plain"].rstrip(), "```", ""]
                elif o.get("output_type") == "error":
                    raise PluginError(f"{path.name}: {o['ename']}: {o['evalue']}")
    return "\n".join(out)


def index_page() -> str:
    """The README, its links made relative to the site."""
    text = (ROOT / "README.md").read_text()
    return text.replace("[`docs/pages`](docs/pages)", "`docs/pages`").replace(
        "](docs/pages/", "](")


def on_config(config):
    missing = undocumented()
    if missing:
        raise PluginError("public names without a docstring: " + ", ".join(missing))
    return config


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=index_page()))
    for module, names in _public().items():
        files.append(File.generated(config, f"api/{module}.md", content=api_page(module, names)))
    files.append(File.generated(config, "design-notes.md", content=notes_page()))
    execute = os.environ.get("ZEROSHARD_DOCS_NOTEBOOKS", "run") != "source"
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(File.generated(config, f"notebooks/{path.stem}.md",
                                    content=notebook_page(path, execute)))
    return files
