"""The notebooks run from top to bottom (outputs stay cleared in the repository).

A test worker's notebooks share one kernel, each notebook starting from a reset
namespace, working directory and environment: a kernel's start and its imports
of torch, JAX and the library are paid once a worker, not once a notebook (this
file on two workers, three runs each: 101-128 against 133-156 CPU seconds).
``make docs`` runs each notebook in a kernel of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from traitlets.config import Config

pytestmark = pytest.mark.notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# each notebook's closing check prints this once its assertions hold
CHECKED = {"01_quickstart.ipynb": "largest difference from torch.optim.AdamW",
           "02_memory_by_stage.ipynb": "measured bytes equal estimate_memory",
           "03_jax_interop.ipynb": "jit loss equals step.evaluate",
           "04_transforms_by_hand.ipynb": "hand-built ZeRO-3 step equals shard.zero3",
           "05_pipelines.ipynb": "pipelined model equals the one-process model",
           "06_hf_models.ipynb": "reloaded with from_pretrained: every parameter equals",
           "07_3d_parallel.ipynb": "2 x 2 x 2 mesh trains as one process",
           "08_optax_and_friends.ipynb": "with optax.chain(clip_by_global_norm, lion) equals",
           "09_lora_finetuning.ipynb": "PeftModel.from_pretrained loads the adapters trained",
           "10_flax_models.ipynb": "flax nnx CNN under zero3 matches the per-rank reference",
           "11_training_loop.ipynb": "loader, range test and autotune checked"}


@pytest.fixture(scope="session")
def kernel(tmp_path_factory):
    """The worker's kernel: ``{"km", "kc"}`` once the first notebook has started
    it, with XLA's optimisations and default emitters, as users run notebooks
    (see conftest); a notebook that fails stops it, and the next starts another."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_cpu_use_fusion_emitters=false", "").strip()
    # the kernel's sockets are files: TCP ports, picked free and then bound, can be taken
    # in between by another kernel or process group that the suite starts
    sockets = Config({"KernelManager": {"transport": "ipc", "connection_file": str(
        tmp_path_factory.mktemp("kernel") / "kernel.json")}})
    shared = {"env": env, "config": sockets}
    yield shared
    _stop(shared)


def _stop(shared):
    if shared.get("km") is not None:
        client = NotebookClient(nbformat.v4.new_notebook(), km=shared.pop("km"),
                                shutdown_kernel="immediate")
        client.kc = shared.pop("kc")
        client._cleanup_kernel()


def _reset(path):
    """The first cell: a namespace, working directory and environment as the
    kernel's when it started (ipykernel adds MPLBACKEND to it), and no figure
    left open."""
    return "\n".join([
        "%reset -f", "import os as _os, sys as _sys", f"_os.chdir({str(path.parent)!r})",
        "_env = vars(_sys).setdefault('_notebook_env', dict(_os.environ))",
        "_os.environ.clear()", "_os.environ.update(_env)",
        "_sys.modules['matplotlib.pyplot'].close('all') "
        "if 'matplotlib.pyplot' in _sys.modules else None",
        "del _os, _sys, _env"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, kernel):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit notebooks with their outputs cleared"
    nb.cells.insert(0, nbformat.v4.new_code_cell(_reset(path)))
    client = NotebookClient(nb, timeout=300, kernel_name="python3", config=kernel["config"],
                            km=kernel.get("km"),
                            resources={"metadata": {"path": str(path.parent)}})
    client.kc = kernel.get("kc")  # (not a constructor argument)
    try:
        client.execute(cleanup_kc=False, env=kernel["env"])
    except BaseException:
        kernel.update(km=client.km, kc=client.kc)
        _stop(kernel)
        raise
    kernel.update(km=client.km, kc=client.kc)
    cells = [c for c in nb.cells[1:] if c.cell_type == "code"]
    outputs = "".join(o.get("text", "") for c in cells for o in c.outputs)
    assert CHECKED[path.name] in outputs
    if path.name.startswith(("02", "05", "06", "07", "08", "09", "10", "11")):  # the plot was drawn
        assert any("image/png" in o.get("data", {}) for c in cells for o in c.outputs)
