"""Two hosts for real: torchrun on each of two network namespaces (see
``tests/netns.py``), 2 processes each, rendezvous over c10d, gloo traffic over
the link between them; the run matches the same 4 ranks on one host."""

from __future__ import annotations

import json
import os
import shutil
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


def two_hosts(out: Path, **more: str) -> list[int]:
    """``examples/gpt.py``'s GPT on 2 namespaces x 2 processes; the bytes each host
    sent over its link."""
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
                env=environ(out, GLOO_SOCKET_IFNAME=h.ifname, **more), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT))
        finish(procs)
        return [h.tx_bytes() for h in hosts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training on one host (4 processes), on two hosts, and on two hosts
    with hierarchical ZeRO (ZeRO-3 inside each host, replicas across)."""
    tmp = tmp_path_factory.mktemp("multinode")
    one = tmp / "one-host.json"
    finish([subprocess.Popen(torchrun(["--standalone", "--nproc-per-node", "4"]),
                             env=environ(one), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)])
    sent = {"flat": two_hosts(tmp / "two-hosts.json"),
            "hsdp": two_hosts(tmp / "hsdp.json", ZS_REPLICAS="2")}
    return {k: json.loads((tmp / f"{k}.json").read_text())
            for k in ("one-host", "two-hosts", "hsdp")}, sent


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_two_hosts_of_two_processes_train_as_four_processes_on_one_host(runs):
    reports, sent = runs
    want, got = reports["one-host"], reports["two-hosts"]
    assert got["world"] == want["world"] == 4
    assert len(got["losses"]) == STEPS
    assert got["losses"] == want["losses"]  # the same trajectory, bit for bit
    for k, v in want["params"].items():
        np.testing.assert_allclose(got["params"][k], v, rtol=1e-6, err_msg=k)
    # each host holds half the shards, and a ZeRO-3 step gathers every unit twice
    # (forward, backward): each host receives at least the params' bytes per step
    assert min(sent["flat"]) >= STEPS * want["param_bytes"], (sent, want["param_bytes"])


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_hierarchical_zero_sends_only_gradient_shards_between_hosts(runs):
    """ZeRO-3 inside each host and replicas across (``replicate=``): the same
    training, and the link carries each host's gradient shards once per step
    (a 2-rank all-reduce of half the params per host), not the gathers."""
    reports, sent = runs
    want, got = reports["one-host"], reports["hsdp"]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    for k, v in want["params"].items():  # the sums' order differs: to each leaf's scale
        np.testing.assert_allclose(got["params"][k], v, rtol=1e-4,
                                   atol=1e-4 * np.abs(v).max(), err_msg=k)
    # analytic: each host's two ranks each all-reduce a shard of half the params with
    # their replica, sending about that shard's bytes: the params' bytes per host and
    # step, plus the step's small collectives and the rendezvous
    for n in sent["hsdp"]:
        assert STEPS * want["param_bytes"] <= n <= 1.25 * STEPS * want["param_bytes"] + 2**18
    assert max(sent["hsdp"]) < 0.75 * min(sent["flat"]), sent
    per_step = {k: [round(n / STEPS / 2**20, 3) for n in v] for k, v in sent.items()}
    print(f"MiB sent per host and step: {per_step}; the params: "
          f"{want['param_bytes'] / 2**20:.3f} MiB")


@pytest.mark.skipif(WHY is not None or shutil.which("tc") is None,
                    reason=WHY or "no tc here to shape the link")
def test_multinode_benchmark_prints_its_table():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multinode.py"), "--rounds",
                          "1", "--steps", "2", "--d", "32", "--layers", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines()
            if line.startswith("| flat") or line.startswith("| hsdp")}
    assert set(rows) == {"flat", "hsdp"}, out.stdout
    ratio = {k: float(v.split("|")[5]) for k, v in rows.items()}  # bytes / params' bytes
    assert ratio["hsdp"] < ratio["flat"], out.stdout
