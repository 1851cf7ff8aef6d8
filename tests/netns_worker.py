"""One rank of the multi-node test: ``examples/gpt.py``'s GPT, small, trained
with ZeRO-3 under torchrun; rank 0 writes the losses and the trained params'
checksums to ZS_OUT as JSON. With ``ZS_MODES`` (a JSON object of mode names to
the variables each sets, as ``benchmarks/multinode.py`` writes it) the ranks
train every mode in turn in the one process group, and ZS_OUT holds a report
per mode."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def config(env: dict[str, str]):
    from examples import gpt

    return gpt.GPTConfig(seq=16, d=int(env.get("ZS_D", "32")),
                         layers=int(env.get("ZS_LAYERS", "2")), heads=2)


def train_one(comm, env: dict[str, str], model=None) -> dict | None:
    """One run as ``env`` says (of a copy of ``model``, else of the GPT built
    here); rank 0's report (None on the other ranks)."""
    import numpy as np

    import shard
    from examples import gpt

    warmup = int(env.get("ZS_WARMUP", "0"))  # steps before the measured ones
    iface = env.get("GLOO_SOCKET_IFNAME")
    marks: dict[str, float] = {}

    def sent() -> float:  # this host's bytes over its link so far
        if iface is None:
            return 0.0
        return float(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())

    def on_step(done: int) -> None:
        if done == warmup:
            marks["t"], marks["tx"] = time.perf_counter(), sent()

    if warmup == 0:
        on_step(0)
    out = gpt.train(comm, stage=int(env.get("ZS_STAGE", "3")),
                    steps=int(env.get("ZS_STEPS", "4")), batch=8, cfg=config(env), model=model,
                    progress=False, replicas=int(env.get("ZS_REPLICAS", "1")),
                    reshard_after_forward=int(env.get("ZS_RESHARD", "0")) or True,
                    quantized_weights=env.get("ZS_QWZ") == "1",
                    quantized_gradients=int(env.get("ZS_QGZ", "0")) or False,
                    onebit_freeze_step=int(env.get("ZS_ONEBIT", "0")) or None,
                    zero_one=dict(zip(("var_freeze_step", "local_step_scaler",
                                       "local_step_clipper"),
                                      map(int, env["ZS_ZEROONE"].split(",")),
                                      strict=True)) if env.get("ZS_ZEROONE") else None,
                    on_step=on_step)
    seconds = time.perf_counter() - marks["t"]
    tx = np.empty(comm.world_size)  # each rank's reading of its host's link
    comm.all_gather_into(tx, np.array([sent() - marks["tx"]]))
    params = shard.gather(out["state"], out["step"].config.comm)
    comm.barrier()  # the next mode's traffic starts after every rank has read the link
    if comm.rank != 0:
        return None
    return {"world": comm.world_size, "losses": [float(x) for x in out["losses"]],
            "seconds": out["seconds"],
            # the steps after the warm-up: their seconds and the most any host sent
            "measured_seconds": seconds, "measured_sent": float(tx.max()),
            "sent": [float(x) for x in tx],  # each rank's reading, from the run's start
            "param_bytes": sum(int(v.nbytes) for v in params.values()),
            "params": {k: [float(np.sum(v, dtype=np.float64)),
                           float(np.sum(np.abs(v), dtype=np.float64))]
                       for k, v in params.items()}}


def main() -> None:
    import ops

    comm = ops.init_from_env()
    env = dict(os.environ)
    if "ZS_MODES" in env:
        modes = json.loads(env["ZS_MODES"])
        reports = {mode: train_one(comm, {**env, **sets}) for mode, sets in modes.items()}
        report: dict | None = reports if comm.rank == 0 else None
    else:
        report = train_one(comm, env)
    if comm.rank == 0:
        Path(os.environ["ZS_OUT"]).write_text(json.dumps(report))
    comm.barrier()


if __name__ == "__main__":
    main()
