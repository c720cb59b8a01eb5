"""The raw-DDP path under torchrun, and its agreement with the Accelerate path, with real processes."""

from __future__ import annotations

import json
import time

import pytest
from helpers import (
    assert_same_steps,
    assert_same_training,
    assert_weights_match_a_parity_run,
    classify_flags,
    launch_cmd,
    log_history,
    parity_flags,
    read_results,
    recipe_path,
    run,
    torchrun_cmd,
    train_here,
)
from transformers import AutoModelForSequenceClassification

pytestmark = pytest.mark.multiprocess
METRICS = ("eval_accuracy", "eval_f1")


def test_torchrun_selects_raw_ddp_and_matches_accelerate(parity_runs):
    # Dropout is off in these runs (conftest.parity_runs): the comparison is of arithmetic.
    accelerate, ddp = parity_runs("accelerate", 2, 4), parity_runs("torchrun", 2, 4)
    ddp_results, accelerate_results = read_results(ddp), read_results(accelerate)
    assert (ddp_results["runtime"], ddp_results["world_size"]) == ("ddp", 2)
    assert (accelerate_results["runtime"], accelerate_results["world_size"]) == ("accelerate", 2)
    assert ddp_results["global_step"] == accelerate_results["global_step"] == 9
    assert_same_training(accelerate, ddp)
    for key in (*METRICS, "eval_loss"):
        assert ddp_results[key] == pytest.approx(accelerate_results[key], abs=1e-6)
    assert not [k for k in AutoModelForSequenceClassification.from_pretrained(ddp).state_dict()
                if k.startswith("module.")]


@pytest.mark.slow
# The batch plan (grouped or not) is the sampler's, the same under both launchers: ungrouped runs once.
@pytest.mark.parametrize(("launcher", "group_by_length"),
                         [("accelerate", True), ("torchrun", True), ("torchrun", False)],
                         ids=["grouped-accelerate", "grouped-torchrun", "ungrouped-torchrun"])
def test_one_process_with_batch_2b_equals_two_with_batch_b(parity_runs, launcher, group_by_length):
    one = parity_runs(launcher, 1, 8, group_by_length)
    two = parity_runs(launcher, 2, 4, group_by_length)
    assert [read_results(r)["world_size"] for r in (one, two)] == [1, 2]
    assert [read_results(r)["global_step"] for r in (one, two)] == [9, 9]
    assert_same_training(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_no_gradient_all_reduce_on_accumulation_micro_steps(small_data, tiny_bert, tmp_path, launcher):
    reports = tmp_path / "reports"
    reports.mkdir()
    flags = classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
                           "3", "--num_train_epochs", "1", "--output_dir", str(tmp_path / "out"))
    run(launch_cmd(launcher, str(reports), recipe_path(), *flags, script="tests/scripts/count_all_reduces.py"))
    for rank in range(2):
        report = json.loads((reports / f"rank_{rank}.json").read_text())
        # 42 examples in global batches of 8: 6 micro-steps, optimizer steps after the 3rd and the 6th.
        assert report["forwards"] == 6 and report["optimizer_steps"] == [3, 6]
        assert report["all_reduces"] and set(report["all_reduces"]) == {3, 6}, report


@pytest.mark.slow
def test_eval_metrics_are_identical_for_world_sizes_1_2_3(small_data, tiny_bert_without_dropout, tmp_path):
    results = []
    for world_size, batch in ((1, 6), (2, 3), (3, 2)):  # the same global batch, so the same training
        out = tmp_path / f"ws{world_size}"
        flags = classify_flags(small_data, tiny_bert_without_dropout, "--per_device_train_batch_size", str(batch),
                               "--max_train_steps", "2", "--output_dir", str(out))
        if world_size == 1:  # the reference: one process needs no launcher
            train_here("classify", *flags)
        else:
            run(torchrun_cmd(*flags, nproc=world_size))
        results.append(read_results(out))
    assert [r["world_size"] for r in results] == [1, 2, 3]
    for r in results[1:]:
        assert {k: r[k] for k in METRICS} == {k: results[0][k] for k in METRICS}
        assert r["eval_loss"] == pytest.approx(results[0]["eval_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("written_by", "resumed_by"), [("accelerate", "torchrun"), ("torchrun", "accelerate")])
def test_a_checkpoint_resumes_under_the_other_runtime(parity_runs, small_data, tiny_bert_without_dropout, tmp_path,
                                                      written_by, resumed_by):
    """The resumed run goes on from step 4 and logs steps 5 to 9 as the uninterrupted run under its own runtime
    does: a run that ignored the checkpoint would log steps 1 to 9, with other losses."""
    checkpoint = parity_runs(written_by, 2, 4) / "checkpoints" / "step_4"  # one step into the second epoch
    resumed = tmp_path / "resumed"
    result = run(launch_cmd(resumed_by, *parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir",
                            str(resumed), "--resume_from_checkpoint", str(checkpoint)))
    assert f"resumed from {checkpoint} at step 4" in result.stdout
    assert read_results(resumed)["runtime"] == ("accelerate" if resumed_by == "accelerate" else "ddp")
    reference = parity_runs(resumed_by, 2, 4)
    assert [h["step"] for h in log_history(resumed)] == [5, 6, 7, 8, 9]
    assert_same_steps(log_history(resumed), log_history(reference)[4:])
    assert_weights_match_a_parity_run(reference, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["ddp", "accelerate"])
def test_a_rank_that_raises_ends_the_whole_job(tmp_path, runtime):
    start = time.monotonic()
    result = run(launch_cmd("torchrun" if runtime == "ddp" else "accelerate", "--ddp_timeout", "60", "--runtime",
                            runtime, script="tests/scripts/failing_rank.py"), check=False, timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - start < 60, "every rank ended within --ddp_timeout"
    output = result.stdout + result.stderr
    assert len([line for line in output.splitlines() if "RuntimeError: rank 1 failed on purpose" in line]) == 1


@pytest.mark.slow
def test_the_readme_example_script_trains_under_torchrun(tmp_path):
    out = tmp_path / "model"
    result = run(torchrun_cmd(str(out), script="examples/raw_ddp.py"))
    assert "over 2 processes" in result.stdout
    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_outputs_of_different_lengths_are_gathered_once_each_in_order(tmp_path, launcher):
    run(launch_cmd(launcher, str(tmp_path), script="tests/scripts/gather_variable.py"))
    gathered = json.loads((tmp_path / "gathered.json").read_text())
    assert gathered["world_size"] == 2
    assert gathered["rows"] == [[i] * ((i * 5) % 11 + 1) for i in range(23)]
