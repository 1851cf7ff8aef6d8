"""Two hosts for real: torchrun on each of two network namespaces (see
``tests/netns.py``), 2 processes each, rendezvous over c10d, gloo traffic over
the link between them; the run matches the same 4 ranks on one host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import netns
from tests.multiproc import ROOT, free_port

WHY = netns.unavailable()
STEPS = 4


def torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "--max-restarts", "0",
            str(ROOT / "tests" / "netns_worker.py")]


def environ(out: Path, **more: str) -> dict[str, str]:
    return dict(os.environ, ZS_OUT=str(out), ZS_STEPS=str(STEPS), PYTHONPATH=str(ROOT),
                OMP_NUM_THREADS="1", **more)


def finish(procs: list[subprocess.Popen], timeout: float = 400) -> None:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_two_hosts_of_two_processes_train_as_four_processes_on_one_host(tmp_path):
    one = tmp_path / "one-host.json"
    finish([subprocess.Popen(torchrun(["--standalone", "--nproc-per-node", "4"]),
                             env=environ(one), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)])
    two = tmp_path / "two-hosts.json"
    with netns.two_hosts() as hosts:
        port = free_port()
        procs = []
        for i, h in enumerate(hosts):  # host 0 holds the rendezvous store
            args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{hosts[0].addr}:{port}", "--rdzv-id", "zs-two-hosts",
                    "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=120",
                    "--local-addr", h.addr]
            procs.append(subprocess.Popen(
                h.command(torchrun(args)), cwd=ROOT, text=True,
                env=environ(two, GLOO_SOCKET_IFNAME=h.ifname), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT))
        finish(procs)
        sent = [h.tx_bytes() for h in hosts]
    want, got = json.loads(one.read_text()), json.loads(two.read_text())
    assert got["world"] == want["world"] == 4
    assert len(got["losses"]) == STEPS
    assert got["losses"] == want["losses"]  # the same trajectory, bit for bit
    for k, v in want["params"].items():
        np.testing.assert_allclose(got["params"][k], v, rtol=1e-6, err_msg=k)
    # each host holds half the shards, and a ZeRO-3 step gathers every unit twice
    # (forward, backward): each host receives at least the params' bytes per step
    assert min(sent) >= STEPS * want["param_bytes"], (sent, want["param_bytes"])
