"""A rank of the multi-process gloo tests (``tests/multiproc.py`` starts them).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun sets them),
ZS_SCENARIO (what to run: a scenario, or several joined by ``+``, run in turn in the
one process group, each reporting under ``parts``; ``name@seconds`` runs one on a group
of its own whose collectives time out after that long), ZS_TIMEOUT (the process
group's) and ZS_OUT (where to write this rank's JSON report: before each scenario and at
the end, so that a rank killed inside one leaves the parts before it and its name).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import numpy as np

import ops
import shard
from ops.device._arrays import BF16

DTYPES = {"f32": np.float32, "f64": np.float64, "bf16": BF16, "f16": np.float16}
SIZES = [0, 1, 7, 1_000_003]


def inputs(rank: int, n: int, dtype) -> np.ndarray:
    return np.random.default_rng(1000 * n + rank).standard_normal(n).astype(dtype)


def check_all(comm) -> list[str]:
    """Every collective x dtype x size against numpy; returns failures."""
    w, failures = comm.world_size, []
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6}
    for name, dtype in DTYPES.items():
        rt = tol.get(np.dtype(dtype), 2e-2)
        for n in SIZES:
            xs = [inputs(r, n, dtype) for r in range(w)]
            mine = xs[comm.rank]
            total = np.sum([x.astype(np.float64) for x in xs], axis=0)
            got = ops.all_gather(comm, mine)
            if not np.array_equal(got, np.concatenate(xs)):
                failures.append(f"all_gather {name} n={n}")
            m = n - n % w
            for op in ("sum", "mean"):
                got = ops.reduce_scatter(comm, mine[:m], op=op).astype(np.float64)
                want = np.split(total[:m] / (w if op == "mean" else 1), w)[comm.rank]
                if not np.allclose(got, want, rtol=rt, atol=rt * w):
                    failures.append(f"reduce_scatter {op} {name} n={n}")
            got = ops.all_to_all(comm, mine[:m])
            if not np.array_equal(got, np.concatenate([np.split(x[:m], w)[comm.rank]
                                                       for x in xs])):
                failures.append(f"all_to_all {name} n={n}")
            got = ops.all_reduce(comm, mine).astype(np.float64)
            if not np.allclose(got, total, rtol=rt, atol=rt * w):
                failures.append(f"all_reduce {name} n={n}")
            if not np.array_equal(ops.broadcast(comm, mine, src=w - 1), xs[-1]):
                failures.append(f"broadcast {name} n={n}")
    out = comm.allocate(4 * w, np.float32)
    work = comm.all_gather_async(out, np.full(4, comm.rank, np.float32))
    if not np.array_equal(work.wait(), np.repeat(np.arange(w, dtype=np.float32), 4)):
        failures.append("all_gather_async")
    return failures


def check_zero(comm) -> list[str]:
    """ZeRO stages 1 and 3 on gloo against the single-process reference."""
    import jax

    import shard
    from tests import zero_models as M

    failures = []
    want, want_losses, _ = M.reference(10)
    for stage, make in ((1, shard.zero1), (3, shard.zero3)):
        step = make(M.LAYERED if stage == 3 else M.loss, optimizer=ops.adamw(M.LR,
                    weight_decay=M.WD), comm=comm)
        state = step.init(M.init_params())
        losses = []
        for b in M.batches(10):
            state, metrics = step(state, shard.split_batch(b, rank=comm.rank,
                                                           world_size=comm.world_size))
            losses.append(metrics["loss"])
        ref = shard.partition(want, rank=comm.rank, world_size=comm.world_size)
        for got, exp in zip(jax.tree_util.tree_leaves(state.params),
                            jax.tree_util.tree_leaves(ref), strict=True):
            if not np.allclose(got, exp, rtol=1e-5, atol=1e-6):
                failures.append(f"stage {stage}: shard differs by {np.abs(got - exp).max()}")
        if not np.allclose(losses, want_losses, rtol=1e-5):
            failures.append(f"stage {stage}: losses {losses} != {want_losses}")
    from tests import test_invariance as inv  # invariant_shards: one thread rank's bits

    for stage in (1, 3):
        got = inv.jax_run(comm, stage=stage, steps=4)
        want_bits = ops.spawn(lambda c, s=stage: inv.jax_run(c, stage=s, steps=4), 1)[0]
        if got[1:] != want_bits[1:] or not all(
                np.array_equal(a, b) for a, b in zip(got[0], want_bits[0], strict=True)):
            failures.append(f"invariant_shards at stage {stage}: not one rank's bits")
    return failures


def check_torch(comm) -> list[str]:
    """A torch MLP (ZeRO-3, full-batch parity) and the GPT (bit-identical) on gloo."""
    import torch

    from examples import gpt
    from tests import test_interop_torch as T

    failures = []
    batches = T.data()
    model = T.built(lambda: T.MLP(True))
    want = T.reference(lambda: T.MLP(True), T.mse, batches)
    got = T.zero_run(comm, 3, None, T.mse, batches, model)[0]
    failures += [f"mlp {k}" for k in want
                 if not np.allclose(got[k], want[k], rtol=1e-5, atol=1e-6)]
    torch.set_num_threads(1)
    text = gpt.corpus()
    batches = [gpt.sample_batch(text, i, 12, T.SMALL.seq) for i in range(T.STEPS)]
    model = T.built(lambda: gpt.GPT(T.SMALL))
    want = T.reference_dp(model, gpt.lm_loss, batches, comm.world_size)
    got = T.zero_run(comm, 3, None, gpt.lm_loss, batches, model)[0]
    failures += [f"gpt {k}" for k in want if not np.array_equal(got[k], want[k])]
    from tests import test_invariance as inv  # invariant_shards: one thread rank's bits

    model = gpt.build(inv.CFG)
    out = gpt.train(comm, steps=4, batch=16, cfg=inv.CFG, model=model, progress=False,
                    invariant_shards=inv.V)
    got = shard.gather(out["state"], comm)
    want, _ = inv.gpt_run(1, steps=4, model=model)
    failures += [f"gpt invariant_shards {k}" for k in want if not np.array_equal(got[k], want[k])]
    return failures + check_lora(comm)


def check_lora(comm) -> list[str]:
    """PEFT's LoRA on a tiny Llama, ZeRO-3 over gloo, against one process of
    torch.optim.AdamW: the adapters match, the frozen base is unchanged."""
    import copy

    import interop.torch as it
    from tests import test_finetune as F

    model, data = F.lora_llama(), F.tokens()
    want = dict(F.lora_reference(model, data).named_parameters())
    module = copy.deepcopy(model)
    params, fn = it.functional(module, loss=F.lm_loss)
    step = shard.zero3(fn, optimizer=ops.adamw(F.LR, weight_decay=F.WD), comm=comm)
    state = step.init(params)
    n = data[0][0].shape[0] // comm.world_size
    for (b,) in data:
        state, _ = step(state, (b[comm.rank * n:(comm.rank + 1) * n],))
    got = it.state_dict(module, state, comm=comm)
    failures = []
    for name, p in model.named_parameters():
        have, ref = got[name].numpy(), want[name].detach().numpy()
        ok = (np.allclose(have, ref, rtol=2e-4, atol=2e-6) if p.requires_grad
              else np.array_equal(have, p.detach().numpy()))
        if not ok:
            failures.append(f"lora {name}")
    return failures


def run_scenario(scenario: str, comm, part: dict) -> None:
    """One scenario on this rank; what it finds goes into ``part``."""
    if scenario == "collectives":
        part["failures"] = check_all(comm)
    elif scenario == "zero":
        part["failures"] = check_zero(comm)
    elif scenario == "torch":
        part["failures"] = check_torch(comm)
    elif scenario == "kill":
        comm.barrier()
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        ops.all_gather(comm, np.ones(4_000_000, np.float32))
    elif scenario == "save0":  # only rank 0 saves; the others train on
        import jax.numpy as jnp

        import shard

        step = shard.zero2(lambda p, b: jnp.sum(p["w"] ** 2), optimizer=ops.adamw(1e-2),
                           comm=comm)
        state, _ = step(step.init({"w": np.ones(1000, np.float32)}), None)
        if comm.rank == 0:
            shard.save(state, os.environ["ZS_OUT"] + ".ck", comm=comm)
        for _ in range(3):
            state, _ = step(state, None)
    elif scenario == "p2p":  # 4 ranks: a ring, a mismatch caught, and a 2 x 2 mesh
        w, r = comm.world_size, comm.rank
        if r % 2 == 0:
            comm.send(np.full(1000, r, np.float32), (r + 1) % w, tag=3)
            got = comm.recv_(np.empty(1000, np.float32), (r - 1) % w, tag=3)
        else:
            got = comm.recv_(np.empty(1000, np.float32), (r - 1) % w, tag=3)
            comm.send(np.full(1000, r, np.float32), (r + 1) % w, tag=3)
        part["ring"] = float(got[0])
        data, pipe = comm.split(r // 2), comm.split(r % 2)  # data: {0,1},{2,3}
        part["data"] = ops.all_gather(data, np.array([r])).tolist()
        part["pipe"] = ops.all_gather(pipe, np.array([r])).tolist()
        import shard

        mesh = shard.Mesh(comm, {"pipe": 2, "data": 2})  # the same groups, by name
        part["mesh"] = [ops.all_gather(mesh[a], np.array([r])).tolist()
                          for a in ("data", "pipe")]
        if pipe.rank == 0:  # pipeline neighbours on their own group
            pipe.send(np.arange(5, dtype=np.float64), 1)
        else:
            part["pipe_recv"] = pipe.recv_(np.empty(5, np.float64), 0).tolist()
        if r == 3:  # a receive posted before its message is sent
            posted = comm._prepost_recv(np.empty(6, np.float64), 2, 11)
            comm.send(np.ones(1, np.float32), 2, tag=12)
            part["preposted"] = posted.wait().tolist()
        elif r == 2:
            comm.recv_(np.empty(1, np.float32), 3, tag=12)
            comm.send(np.arange(6, dtype=np.float64), 3, tag=11)
        if r == 0:
            comm.send(np.zeros(7, np.float32), 1, tag=9)
        elif r == 1:
            try:
                comm.recv_(np.empty(8, np.float32), 0, tag=9)
            except ops.CollectiveError as e:
                part["mismatch"] = str(e)
    elif scenario == "pipeline":  # 2 stages x 2 data ranks, 1F1B, ZeRO-2
        from tests import pipeline_models as PM

        results = [PM.run(comm, stages=2, microbatches=2)]
        part["worst"] = PM.worst_difference(results, PM.reference())
    elif scenario == "pipeline_routed":  # the same, behind init_from_env's GPU communicator
        from ops.comm._world import RoutedCommunicator

        run_scenario("pipeline", RoutedCommunicator(comm, lambda: comm), part)
    elif scenario == "torch_pipeline":  # 2 stages x 2 data ranks of torch modules, ZeRO-3
        import shard
        from tests import pipeline_models as PM

        layers, _ = PM.torch_run(comm, stages=2, microbatches=2, zero=shard.zero3)
        want = PM.torch_reference()
        part["worst"] = max(float(np.abs(np.asarray(got[k]) - want[i][k]).max())
                              for i, got in layers.items() for k in got)
    elif scenario == "tensor_parallel":  # 2 data x 2 model ranks, ZeRO-3, sequence-parallel
        import jax

        import shard
        from tests import tp_models as gpt

        _, whole, _, losses, norms = gpt.train(comm, 2, 2, shard.zero3, 5,
                                               sequence_parallel=True)
        # the test holds the one-process reference (computed once, not in each process)
        part["whole"] = [np.asarray(x).tolist() for x in jax.tree.leaves(whole)]
        part["losses"], part["norms"] = [float(x) for x in losses], [float(x) for x in norms]
        from tests import test_invariance as inv  # the test compares one thread rank's bits

        params, losses, norms = inv.jax_run(comm, stage=3, steps=4)
        part["invariant"] = {"params": [np.asarray(x).tolist() for x in params],
                             "dtypes": [str(np.asarray(x).dtype) for x in params],
                             "losses": [float(x) for x in losses],
                             "norms": [float(x) for x in norms]}
    elif scenario == "mismatch":
        ops.all_gather(comm, np.ones(100_000 + comm.rank, np.float32))
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


def timing_out(comm, seconds: float):
    """The ranks of ``comm`` on a gloo group of their own whose collectives time out
    after ``seconds`` (gloo enforces a group's timeout from its creation)."""
    import datetime

    import torch.distributed as dist

    from ops.comm._gloo import GlooCommunicator

    group = dist.new_group(list(range(comm.world_size)),
                           timeout=datetime.timedelta(seconds=seconds))
    return GlooCommunicator(group, timeout=seconds)


def write(report: dict) -> None:
    with open(f"{os.environ['ZS_OUT']}.{report.get('rank', os.environ['RANK'])}", "w") as f:
        json.dump(report, f)


def main() -> None:
    scenario, report = os.environ["ZS_SCENARIO"], {"ok": False}
    timeout = float(os.environ.get("ZS_TIMEOUT", "60"))
    t0 = began = time.monotonic()
    part: dict = report
    try:
        comm = ops.init_from_env(timeout=timeout)
        report["rank"] = comm.rank
        # As in conftest: the scenarios and their references mean the CPU, also
        # where JAX sees a GPU (its matmuls there default to TF32).
        import jax

        jax.config.update("jax_default_device", jax.devices("cpu")[0])
        jax.config.update("jax_default_matmul_precision", "highest")
        scenarios = scenario.split("+")  # several in turn, in this one process group
        for spec in scenarios:
            name, _, seconds = spec.partition("@")
            report["running"] = name  # where an error, if any, was raised
            part = report if len(scenarios) == 1 else \
                report.setdefault("parts", {}).setdefault(name, {})
            write(report)
            began = time.monotonic()
            run_scenario(name, timing_out(comm, float(seconds)) if seconds else comm, part)
            part["ok"], part["seconds"] = True, time.monotonic() - began
        report["ok"] = True
        report["seconds"] = time.monotonic() - t0
    except Exception as e:
        report.update(error=type(e).__name__, message=str(e), seconds=time.monotonic() - t0,
                      traceback=traceback.format_exc())
        if part is not report:  # the failed scenario's own time
            part["seconds"] = time.monotonic() - began
    write(report)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown, which waits for dead peers


if __name__ == "__main__":
    main()
