"""What only a CUDA GPU can check: `pytest -m gpu` (deselected otherwise; `bench/gpu_check.sh` runs them).

On a machine without CUDA these fail rather than skip: a GPU check that did not run must not pass.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import REPO, free_port, max_weight_diff, read_results, run
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune.checkpoint import verify_checkpoint

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


def torchrun(script: str, *flags) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
            script, *flags]


def test_raw_ddp_runs_on_nccl_with_the_local_gpu(tmp_path):
    result = run(torchrun(CLASSIFY, "--max_train_steps", "20", "--output_dir", str(tmp_path / "out")))
    results = read_results(tmp_path / "out")
    assert (results["runtime"], results["global_step"]) == ("ddp", 20) and "process(es) on cuda" in result.stdout


def load_and_predict(folder) -> tuple[list[str], float]:
    """The saved classifier, loaded in this process alone (no key missing or unexpected): its predicted label for
    each example of the embedded validation set, in order, and its mean loss there."""
    from finetune.default_dataset import LABEL_NAMES, make_support_tickets

    model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model = model.cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    validation = make_support_tickets()["validation"]
    labels = torch.tensor([model.config.label2id[LABEL_NAMES[i]] for i in validation["label"]], device="cuda")
    logits = []
    with torch.no_grad():
        for start in range(0, len(validation), 64):
            batch = tokenizer(validation["text"][start:start + 64], truncation=True, max_length=128, padding=True,
                              return_tensors="pt").to("cuda")
            logits.append(model(**batch).logits.float())
    logits = torch.cat(logits)
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    return [model.config.id2label[i] for i in logits.argmax(-1).tolist()], loss


def test_an_fsdp_run_saves_a_model_that_loads_and_predicts(tmp_path):
    """Accelerate's FSDP2 in float32, so that the model alone in one process must give what the sharded model gave
    in the run's final evaluation: the same prediction for every validation example, the same loss."""
    out = tmp_path / "out"
    run(accelerate("fsdp.yaml", CLASSIFY, "--max_train_steps", "20", "--mixed_precision", "no", "--output_dir",
                   str(out)))
    predictions, loss = load_and_predict(out)
    assert predictions == [json.loads(line)["prediction"] for line in (out / "eval_predictions.jsonl").open()]
    assert loss == pytest.approx(read_results(out)["eval_loss"], abs=1e-4)


FSDP_BF16 = {"accelerate": lambda *flags: accelerate("fsdp.yaml", CLASSIFY, *flags),  # bf16 is the config's
             "torchrun": lambda *flags: torchrun(CLASSIFY, "--fsdp", "--bf16", *flags)}


def test_fsdp_in_bf16_checkpoints_and_resumes_under_both_launchers_from_either_s_checkpoint(tmp_path,
                                                                                             no_dropout_model):
    """Each launcher trains 12 steps with a sharded checkpoint at step 6, which the other launcher resumes: both
    launchers shard the same blocks with the same policy, so they log the same losses (dropout off: the same
    arithmetic), and a resumed run ends where the run it continues does. The saved folders load whole."""
    flags = ["--model_name_or_path", str(no_dropout_model), "--max_train_steps", "12", "--checkpointing_steps", "6",
             "--logging_steps", "1"]
    for launcher in FSDP_BF16:
        run(FSDP_BF16[launcher](*flags, "--output_dir", str(tmp_path / launcher)), timeout=600)
        verify_checkpoint(tmp_path / launcher / "checkpoints" / "step_6")
        assert (tmp_path / launcher / "checkpoints" / "step_6" / "pytorch_model_fsdp_0" / "__0_0.distcp").is_file()
    for written_by, resumed_by in (("accelerate", "torchrun"), ("torchrun", "accelerate")):
        full, resumed = tmp_path / written_by, tmp_path / f"{resumed_by}_from_{written_by}"
        result = run(FSDP_BF16[resumed_by](*flags, "--output_dir", str(resumed), "--resume_from_checkpoint",
                                           str(full / "checkpoints" / "step_6")), timeout=600)
        assert "resumed from" in result.stdout and read_results(resumed)["global_step"] == 12
        assert read_results(resumed)["runtime"] == ("fsdp" if resumed_by == "torchrun" else "accelerate")
        # bf16 compute and the GPU's run-to-run summation order: bounds, not equality.
        losses = {h["step"]: h["loss"] for h in map(json.loads, (full / "log_history.jsonl").open())}
        for h in map(json.loads, (resumed / "log_history.jsonl").open()):
            assert h["loss"] == pytest.approx(losses[h["step"]], rel=1e-2), (h, losses[h["step"]])
        assert max_weight_diff(full, resumed) <= 1e-3
        model, info = AutoModelForSequenceClassification.from_pretrained(resumed, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    history = {launcher: [json.loads(line)["loss"] for line in (tmp_path / launcher / "log_history.jsonl").open()]
               for launcher in FSDP_BF16}
    assert history["torchrun"] == pytest.approx(history["accelerate"], rel=1e-2)


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
