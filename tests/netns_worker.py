"""One rank of the multi-node test: ``examples/gpt.py``'s GPT, small, trained
with ZeRO-3 under torchrun; rank 0 writes the losses and the trained params'
checksums to ZS_OUT as JSON."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def main() -> None:
    import numpy as np

    import ops
    import shard
    from examples import gpt

    comm = ops.init_from_env()
    warmup = int(os.environ.get("ZS_WARMUP", "0"))  # steps before the measured ones
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
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
    cfg = gpt.GPTConfig(seq=16, d=int(os.environ.get("ZS_D", "32")),
                        layers=int(os.environ.get("ZS_LAYERS", "2")), heads=2)
    out = gpt.train(comm, stage=int(os.environ.get("ZS_STAGE", "3")),
                    steps=int(os.environ.get("ZS_STEPS", "4")), batch=8, cfg=cfg,
                    progress=False, replicas=int(os.environ.get("ZS_REPLICAS", "1")),
                    reshard_after_forward=int(os.environ.get("ZS_RESHARD", "0")) or True,
                    quantized_weights=os.environ.get("ZS_QWZ") == "1",
                    quantized_gradients=int(os.environ.get("ZS_QGZ", "0")) or False,
                    onebit_freeze_step=int(os.environ.get("ZS_ONEBIT", "0")) or None,
                    zero_one=dict(zip(("var_freeze_step", "local_step_scaler",
                                       "local_step_clipper"),
                                      map(int, os.environ["ZS_ZEROONE"].split(",")),
                                      strict=True)) if os.environ.get("ZS_ZEROONE") else None,
                    on_step=on_step)
    seconds = time.perf_counter() - marks["t"]
    tx = np.empty(comm.world_size)  # each rank's reading of its host's link
    comm.all_gather_into(tx, np.array([sent() - marks["tx"]]))
    params = shard.gather(out["state"], out["step"].config.comm)
    if comm.rank == 0:
        report = {"world": comm.world_size, "losses": [float(x) for x in out["losses"]],
                  "seconds": out["seconds"],
                  # the steps after the warm-up: their seconds and the most any host sent
                  "measured_seconds": seconds, "measured_sent": float(tx.max()),
                  "param_bytes": sum(int(v.nbytes) for v in params.values()),
                  "params": {k: [float(np.sum(v, dtype=np.float64)),
                                 float(np.sum(np.abs(v), dtype=np.float64))]
                             for k, v in params.items()}}
        Path(os.environ["ZS_OUT"]).write_text(json.dumps(report))
    comm.barrier()


if __name__ == "__main__":
    main()
