"""Shared fixtures. Multi-rank tests run ranks as threads in this process."""

from __future__ import annotations

import os

import numpy as np
import pytest


def _version(dist: str) -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(p) for p in version(dist).split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ()


# Four JAX CPU devices for the mesh tests; on a GPU, XLA's deterministic
# reductions, so that two runs of one trajectory can be compared bit for bit.
# On the CPU, XLA's older fusion emitters: its default (MLIR) emitters took 2.6
# times as long to compile the tensor-parallel GPT's value and gradient (0.67
# against 0.25 s), and the fast tier 179 s against 127 s (330 against 229 CPU
# seconds). The launched ranks inherit the flags; the notebooks run with XLA's
# defaults, as users run them; an XLA_FLAGS of your own replaces these. An XLA
# that no longer knows the flag stops at start naming it; a jaxlib older than
# 0.10 (measured on 0.10.2) runs without it. Must precede the first jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 "
                                   "--xla_gpu_deterministic_ops=true" +
                      (" --xla_cpu_use_fusion_emitters=false" if _version("jaxlib") >= (0, 10)
                       else ""))
# XLA's optimisation passes off: the tests' programs are small and compiled
# once or twice each (per thread rank, per configuration), so compiling is most
# of their time and the passes would cost more than they save (the suite takes
# about a fifth less). Every program and its reference compile alike; the
# notebooks run optimised, as users run them (JAX_DISABLE_MOST_OPTIMIZATIONS=0
# runs every test so).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Launched ranks fork from a server that has imported torch, JAX and the library
# (see [Note: forked launches] in tests/multiproc.py); ZS_FORK_LAUNCH= (empty)
# starts each as a fresh process.
os.environ.setdefault("ZS_FORK_LAUNCH", "1")


@pytest.fixture
def run_benchmark(monkeypatch, capsys):
    """``run_benchmark(name, *args)``: ``benchmarks/NAME.py``'s ``main()`` in this
    process, with ``args`` as its command line; returns what it printed. Its
    launched modes and ranks fork from this worker's server (see [Note: forked
    launches] in tests/multiproc.py), where a fresh interpreter would import
    torch, JAX and the library and start a server of its own to import them again
    (about 5 CPU seconds a benchmark)."""
    import importlib.util
    import sys
    from pathlib import Path

    import torch

    environ, threads = dict(os.environ), torch.get_num_threads()  # the benchmarks set both

    def run(name: str, *args: object) -> str:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # for its dataclasses
        monkeypatch.setattr(sys, "path", list(sys.path))  # the benchmarks add to it
        monkeypatch.setattr(sys, "argv", [str(path), *map(str, args)])
        capsys.readouterr()
        spec.loader.exec_module(module)
        module.main()
        return capsys.readouterr().out

    yield run
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory):
    """A directory that the test session's pytest-xdist workers share (for
    work done once per session under a file lock)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' basetemps share a parent
        base = base.parent
    return base


@pytest.fixture(scope="session")
def gloo_shared(shared_tmp):
    """``gloo_shared(scenario, world)``: each rank's report of a scenario of
    ``tests/gloo_worker.py``, from one launch per world size that the test
    session's workers share (see ``tests.multiproc.shared_run``)."""
    from tests.multiproc import shared_run

    return lambda scenario, world: shared_run(scenario, world, shared_tmp)


@pytest.fixture(scope="session")
def emulated_cuda():
    """The CUDA driver with numpy arrays and kernels emulated on the CPU."""
    from ops.kernels._cuda import CudaDriver
    from ops.kernels._emulate import EmulatedModule

    return CudaDriver(np, EmulatedModule, sm_count=2)


def gpu_present() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available())


# The ZeRO step on device state: the strict stand-in always, a real GPU when
# there is one (see [Note: devices] in ops/device/_device.py).
DEVICES = ["standin"] + (["cupy"] if gpu_present() else [])

# Tests that mean the CPU pin JAX to it: on a GPU machine JAX would otherwise
# run the references there (TF32 matmuls by default). Losses over GPU state
# still run on the GPU: JAX computes where its committed inputs live.
import jax  # noqa: E402

jax.config.update("jax_default_device", jax.devices("cpu")[0])
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=DEVICES)
def device(request):
    """A device :class:`ops.Device` other than the host's."""
    if request.param == "standin":
        from ops.testing import STANDIN

        return STANDIN
    from ops.device._device import cupy_device

    return cupy_device()


@pytest.fixture(params=DEVICES)
def device_xp(request):
    """A device's array module: :data:`ops.testing.xp` (the stand-in's), or CuPy on a GPU."""
    if request.param == "standin":
        from ops.testing import xp

        return xp
    import cupy

    return cupy

# The fast tier (`make test-fast`) leaves out the slow marker's tests. Besides
# those marked in their files, these cases took 1.5 s or more on a quiet 2-core
# machine (`make test` lists the slowest); a parametrized test keeps at least
# one case in the fast tier (the one GPT case of the invariance tests aside:
# the same bits across layouts stay there with a JAX model).
SLOW_CASES = frozenset([
    "tests/test_device.py::test_bf16_clipping_and_loss_scaling_on_device_match_the_host[standin-3]",
    "tests/test_device.py::test_jax_loss_on_device_matches_single_process_adamw[standin-0-1]",
    "tests/test_device.py::test_jax_loss_on_device_matches_single_process_adamw[standin-1-3]",
    "tests/test_device.py::test_jax_loss_on_device_matches_single_process_adamw[standin-2-3]",
    "tests/test_device.py::test_jax_loss_on_device_matches_single_process_adamw[standin-3-3]",
    "tests/test_device.py::test_layered_loss_on_device[standin-0]",
    "tests/test_device.py::test_layered_loss_on_device[standin-3]",
    "tests/test_device.py::test_torch_module_on_device_matches_torch_adamw[standin-1]",
    "tests/test_device.py::test_torch_module_on_device_matches_torch_adamw[standin-2]",
    "tests/test_device.py::test_torch_module_on_device_matches_torch_adamw[standin-3]",
    "tests/test_device.py::test_zero3_on_device_keeps_at_most_two_units_alive[standin]",
    "tests/test_device_ops.py::test_a_layered_units_operations_do_not_grow_with_its_leaves[2]",
    "tests/test_device_ops.py::test_device_operations_do_not_grow_with_a_units_leaves[2-2]",
    "tests/test_device_ops.py::test_device_operations_do_not_grow_with_a_units_leaves[3-2]",
    "tests/test_device_ops.py::test_what_one_more_layered_unit_costs_on_two_ranks",
    "tests/test_device_ops.py::test_what_one_more_unit_costs[2-1]",
    "tests/test_device_ops.py::test_what_one_more_unit_costs[2-2]",
    "tests/test_device_ops.py::test_what_one_more_unit_costs[2-3]",
    "tests/test_finetune.py::test_trainable_mask_matches_optax_set_to_zero_on_one_process[1-tree-fused]",
    "tests/test_finetune.py::test_trainable_mask_matches_optax_set_to_zero_on_one_process[1-tree-optax]",
    "tests/test_hsdp.py::test_replicas_train_like_one_process_and_stay_identical[3-4-2-None]",
    "tests/test_jax_model_libraries.py::test_jax_model_libraries_train_like_single_process_optax[equinox-module-1]",
    "tests/test_jax_model_libraries.py::test_jax_model_libraries_train_like_single_process_optax[equinox-module-2]",
    "tests/test_jax_model_libraries.py::test_jax_model_libraries_train_like_single_process_optax[flax-linen-1]",
    "tests/test_kernel_races.py::test_lamb_stats_kernel_is_race_free_and_each_missing_barrier_is_caught[0]",
    "tests/test_kernel_races.py::test_lamb_stats_kernel_is_race_free_and_each_missing_barrier_is_caught[1]",
    "tests/test_kernel_races.py::test_lamb_stats_kernel_is_race_free_and_each_missing_barrier_is_caught[None]",
    "tests/test_kernel_races.py::test_reduction_kernels_are_race_free_and_a_missing_barrier_is_caught",
    "tests/test_lamb.py::test_zero_with_lamb_matches_single_process_optax[1-3-standin]",
    "tests/test_lamb.py::test_zero_with_lamb_matches_single_process_optax[3-2-standin]",
    "tests/test_mesh.py::test_a_pipeline_on_a_mesh_trains_like_one_process[axes0]",
    "tests/test_meta_init.py::test_init_from_onto_device_state[standin]",
    "tests/test_meta_init.py::test_init_from_refuses_ranks_with_different_keys",
    "tests/test_model_state.py::test_aux_and_evaluation_in_eval_mode_with_the_running_statistics",
    "tests/test_model_state.py::test_batch_norm_statistics_train_with_the_params[1-2]",
    "tests/test_model_state.py::test_batch_norm_statistics_train_with_the_params[3-1]",
    "tests/test_offload.py::test_frozen_params_offloaded_on_the_device_stand_in[standin-host]",
    "tests/test_offload.py::test_frozen_params_offloaded_on_the_device_stand_in[standin-overlap]",
    "tests/test_offload.py::test_bf16_steps_on_the_device_give_the_same_bits_run_to_run_offloaded_or_not[standin-3-1]",
    "tests/test_offload.py::test_bf16_steps_on_the_device_give_the_same_bits_run_to_run_offloaded_or_not[standin-3-3]",
    "tests/test_offload.py::test_offload_on_the_device_stand_in[standin-2-3]",
    "tests/test_offload.py::test_offload_on_the_device_stand_in[standin-3-1]",
    "tests/test_offload.py::test_offload_on_the_device_stand_in[standin-3-2]",
    "tests/test_offload.py::test_offload_on_the_device_stand_in[standin-3-3]",
    "tests/test_offload.py::test_zero3_compute_params_on_the_host_too[standin-3-disk]",
    "tests/test_offload.py::test_zero3_compute_params_on_the_host_too[standin-3-host]",
    "tests/test_offload_overlap.py::test_overlapped_offload_on_the_device_stand_in[standin-3-1]",
    "tests/test_offload_overlap.py::test_overlapped_offload_on_the_device_stand_in[standin-3-3]",
    "tests/test_offload_overlap.py::test_zero3_params_on_the_host_overlapped[standin]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[adabelief-schedule-1-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[adafactor-1-3]",
    "tests/test_p2p.py::test_a_receive_times_out",
    "tests/test_pipeline.py::test_bf16_pipeline_casts_the_batch_as_the_unpipelined_step_does",
    "tests/test_step_keys.py::test_each_rank_step_and_micro_batch_draws_its_own_key[1-2-2-True]",
    "tests/test_step_keys.py::test_each_rank_step_and_micro_batch_draws_its_own_key[3-2-1-True]",
    "tests/test_step_keys.py::test_each_rank_step_and_micro_batch_draws_its_own_key[3-3-2-False]",
    "tests/test_tensor_parallel.py::test_a_plain_checkpoint_loads_into_a_tensor_parallel_step",
    "tests/test_tensor_parallel.py::test_the_vocabulary_parallel_loss_equals_the_loss_of_the_gathered_logits",
    "tests/test_traced_units.py::test_a_plain_loss_at_stage_3_matches_single_process_optax[2]",
    "tests/test_traced_units.py::test_a_plain_loss_at_stage_3_matches_single_process_optax[3]",
    "tests/test_zero.py::test_float64_matches_the_reference_tightly[0]",
    "tests/test_zero.py::test_float64_matches_the_reference_tightly[1]",
    "tests/test_model_state.py::test_synchronised_statistics_match_flax_s_own_train_step_on_the_whole_batch[pure_zero3-3]",
    "tests/test_model_state.py::test_synchronised_statistics_match_flax_s_own_train_step_on_the_whole_batch[hsdp-4]",
    "tests/test_model_state.py::test_synchronised_statistics_match_flax_s_own_train_step_on_the_whole_batch[zero1-3]",
    "tests/test_kernel_races.py::test_quantize_kernel_is_race_free_and_each_missing_barrier_is_caught[1]",
    "tests/test_kernel_races.py::test_quantize_kernel_is_race_free_and_each_missing_barrier_is_caught[2]",
    "tests/test_kernel_races.py::test_quantize_kernel_is_race_free_and_each_missing_barrier_is_caught[3]",
    "tests/test_kernel_races.py::test_exact_sum_of_squares_kernel_is_race_free_and_each_missing_barrier_is_caught[0]",
    "tests/test_kernel_races.py::test_exact_sum_of_squares_kernel_is_race_free_and_each_missing_barrier_is_caught[1]",
    "tests/test_invariance.py::test_a_jax_model_trains_to_the_same_bits_at_worlds_1_to_8_and_zero_0_to_3[layered]",
    "tests/test_invariance.py::test_the_gpt_example_trains_to_the_same_bits_across_layouts",
    "tests/test_pure_step.py::test_steps_inside_jit_and_scan_match_optax_in_one_process[3-top-level]",
    "tests/test_pure_step.py::test_steps_inside_jit_and_scan_match_optax_in_one_process[3-one]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[adabelief-schedule-3-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[adafactor-3-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[clip-adamw-3-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[clip-lamb-3-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[lamb-3-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[lion-3-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[rmsprop-masked-decay-3-3]",
    "tests/test_optax_on_shards.py::test_elementwise_transformations_match_single_process_optax[sgd-momentum-3-3]",
    "tests/test_gpu_compile.py::test_nvcc_compiles_without_spills[adam-sm_80]",
    "tests/test_gpu_compile.py::test_nvcc_compiles_without_spills[cast-sm_80]",
    "tests/test_gpu_compile.py::test_nvcc_compiles_without_spills[copy-sm_80]",
    "tests/test_gpu_compile.py::test_nvcc_compiles_without_spills[lamb-sm_80]",
    "tests/test_gpu_compile.py::test_nvcc_compiles_without_spills[lion-sm_80]",
    "tests/test_gpu_compile.py::test_nvcc_compiles_without_spills[quant-sm_80]",
    "tests/test_gpu_compile.py::test_nvcc_compiles_without_spills[reduce-sm_80]",
    "tests/test_convergence_benchmark.py::test_convergence_benchmark_prints_its_table_and_draws_the_curves",
    "tests/test_kernel_races.py::test_quantize_kernel_is_race_free_and_each_missing_barrier_is_caught[None]",
    "tests/test_model_state.py::test_synchronised_statistics_match_flax_s_own_train_step_on_the_whole_batch[pure_zero3-2]",
    "tests/test_finetune.py::test_peft_lora_llama_matches_one_process_and_exports_adapters_peft_loads[1]",
    "tests/test_zero.py::test_bf16_mixed_precision_stages_agree_and_track_reference[4]",
])


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
