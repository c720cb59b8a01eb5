"""What only a CUDA GPU can check: `pytest -m gpu` (deselected otherwise; `bench/gpu_check.sh` runs them).

On a machine without CUDA these fail rather than skip: a GPU check that did not run must not pass.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import REPO, free_port, max_weight_diff, read_results, run

pytestmark = pytest.mark.gpu

CLASSIFY = str(REPO / "recipes" / "classify.py")
SFT = str(REPO / "recipes" / "sft.py")
CPU_DEFAULT_ACCURACY = 0.963
"""The classify default run's eval accuracy on the CPU (README, Quickstart)."""


@pytest.fixture(autouse=True)
def needs_cuda():
    assert torch.cuda.is_available(), "these checks need a CUDA GPU"


def accelerate(config: str, script: str, *flags, processes: int = 1) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "accelerate_configs" / config), "--num_processes", str(processes), "--main_process_port",
            str(free_port()), script, *flags]


def test_the_classify_default_run_in_bf16_matches_the_cpu_accuracy(tmp_path):
    result = run(accelerate("single_gpu.yaml", CLASSIFY, "--output_dir", str(tmp_path / "out")), timeout=600)
    assert "process(es) on cuda" in result.stdout
    assert abs(read_results(tmp_path / "out")["eval_accuracy"] - CPU_DEFAULT_ACCURACY) <= 0.01


def test_raw_ddp_runs_on_nccl_with_the_local_gpu(tmp_path):
    result = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                  str(free_port()), CLASSIFY, "--max_train_steps", "20", "--output_dir", str(tmp_path / "out")])
    results = read_results(tmp_path / "out")
    assert (results["runtime"], results["global_step"]) == ("ddp", 20) and "process(es) on cuda" in result.stdout


def test_an_fsdp_run_saves_a_model_that_loads_and_predicts(tmp_path):
    from transformers import pipeline

    run(accelerate("fsdp.yaml", CLASSIFY, "--max_train_steps", "20", "--output_dir", str(tmp_path / "out")))
    classify = pipeline("text-classification", model=str(tmp_path / "out"), device=0)
    assert classify("My parcel never arrived")[0]["label"] in {"billing", "technical", "shipping", "account"}


def test_a_resumed_run_on_the_gpu_ends_where_an_uninterrupted_one_does(tmp_path):
    flags = ["--max_train_steps", "12", "--checkpointing_steps", "6", "--mixed_precision", "bf16"]
    run(accelerate("single_gpu.yaml", CLASSIFY, *flags, "--output_dir", str(tmp_path / "full")))
    run(accelerate("single_gpu.yaml", CLASSIFY, *flags, "--output_dir", str(tmp_path / "resumed"),
                   "--resume_from_checkpoint", str(tmp_path / "full" / "checkpoints" / "step_6")))
    # cuBLAS and embedding backward on a GPU may sum in another order from run to run: a bound, not equality.
    assert max_weight_diff(tmp_path / "full", tmp_path / "resumed") <= 1e-3


def test_sft_with_lora_in_bf16_trains_packed_and_padded_alike(tmp_path):
    """Packed through flash-attention when it is installed (SDPA with a block mask otherwise) or padded: the
    first step's loss is the same up to bf16 rounding."""
    first_losses = {}
    for batches, kind in (("--packing", "packed batches"), ("--no_packing", "padded batches")):
        out = tmp_path / batches.strip("-")
        result = run(accelerate("single_gpu.yaml", SFT, batches, "--max_train_steps", "4", "--logging_steps", "1",
                                "--eval_generate", "8", "--output_dir", str(out)), timeout=600)
        assert kind in result.stdout
        first_losses[batches] = json.loads((out / "log_history.jsonl").read_text().splitlines()[0])["loss"]
        assert 0 <= read_results(out)["eval_routing_accuracy"] <= 1
    assert first_losses["--packing"] == pytest.approx(first_losses["--no_packing"], rel=2e-2)
