"""Sharded training (FSDP2, ``--fsdp``) under real torchrun on CPU/gloo: the same training as DDP, sharded
checkpoints that resume exactly, also at another number of processes, and a final folder that loads alone."""

from __future__ import annotations

import csv
import json
import re
import signal
import sys

import pytest
import torch
from helpers import (
    REPO,
    assert_adapter_replies_as_generated,
    assert_same_steps,
    assert_same_training,
    assert_weights_match_a_parity_run,
    free_port,
    log_history,
    max_weight_diff,
    parity_flags,
    python_cmd,
    read_results,
    recipe_path,
    run,
    start_and_signal,
    stopped_step,
    torchrun_cmd,
)
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune.checkpointing.checkpoint import verify_checkpoint
from finetune.data.embedded.support_chats import make_support_conversations


@pytest.fixture(scope="module")
def fsdp_run(parity_runs, small_data, tiny_bert_without_dropout, tmp_path_factory):
    """The raw-DDP parity run's training (2 processes x batch 4, accumulation 2, 9 steps, checkpoints at steps 4
    and 8, dropout off) under ``--fsdp``."""
    out = tmp_path_factory.mktemp("fsdp") / "out"
    run(torchrun_cmd(*parity_flags(small_data, tiny_bert_without_dropout, 4), "--fsdp", "--output_dir", str(out)))
    return out


def assert_continues(uninterrupted, resumed, first_step: int, ddp) -> None:
    """``resumed`` logged the ``uninterrupted`` run's loss and gradient norm at each of its steps from ``first_step``
    on, and ended with the weights of ``ddp`` (the DDP parity run, which ``uninterrupted`` equals) to float rounding."""
    assert [h["step"] for h in log_history(resumed)] == list(range(first_step, 10))
    assert_same_steps(log_history(resumed), log_history(uninterrupted)[first_step - 1:])
    assert_weights_match_a_parity_run(ddp, resumed)


@pytest.mark.multiprocess
def test_fsdp_trains_as_ddp_and_each_process_writes_its_shards(parity_runs, fsdp_run):
    ddp = parity_runs("torchrun", 2, 4)
    results = read_results(fsdp_run)
    assert (results["runtime"], results["world_size"], results["global_step"]) == ("fsdp", 2, 9)
    assert_same_training(ddp, fsdp_run)
    for key in ("eval_accuracy", "eval_f1", "eval_loss"):
        assert results[key] == pytest.approx(read_results(ddp)[key], abs=1e-6)
    checkpoint = fsdp_run / "checkpoints" / "step_4"
    verify_checkpoint(checkpoint)
    for shards in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (checkpoint / shards).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.bin").exists()
    assert json.loads((checkpoint / "progress.json").read_text())["per_device_train_batch_size"] == 4


@pytest.mark.multiprocess
def test_the_saved_model_loads_in_one_process_and_predicts_as_the_sharded_one(fsdp_run, small_data):
    """The final evaluation ran on the sharded model: its loss and predictions come back from the folder."""
    model, info = AutoModelForSequenceClassification.from_pretrained(fsdp_run, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(fsdp_run)
    with open(small_data["validation"], newline="") as f:
        rows = list(csv.DictReader(f))
    batch = tokenizer([r["text"] for r in rows], truncation=True, max_length=48, padding=True, return_tensors="pt")
    labels = torch.tensor([model.config.label2id[r["label"]] for r in rows])
    with torch.no_grad():
        logits = model.eval()(**batch).logits
    assert torch.nn.functional.cross_entropy(logits, labels).item() == pytest.approx(
        read_results(fsdp_run)["eval_loss"], abs=1e-5)
    predictions = [json.loads(line)["prediction"] for line in (fsdp_run / "eval_predictions.jsonl").open()]
    assert [model.config.id2label[i] for i in logits.argmax(-1).tolist()] == predictions


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stopped_fsdp_run_resumes_on_one_process_and_back_on_two_as_if_never_stopped(
        parity_runs, fsdp_run, small_data, tiny_bert_without_dropout, tmp_path):
    """SIGTERM to torchrun stops the 2 x 4 run with a sharded checkpoint; 1 process x 8 (the same global batch)
    resumes it and writes its own, which 2 x 4 resumes again. Dropout is off: the comparison is of arithmetic."""
    model = tiny_bert_without_dropout
    stopped, one, two = tmp_path / "stopped", tmp_path / "one", tmp_path / "two"
    _, output = start_and_signal(torchrun_cmd(*parity_flags(small_data, model, 4), "--fsdp",
                                              "--output_dir", str(stopped)), signal.SIGTERM, "launcher")
    step = stopped_step(output, signal.SIGTERM)
    assert 1 <= step < 9 and not (stopped / "model.safetensors").exists(), output[-3000:]
    saved = max(step + 1, 5)  # mid-epoch, and the one checkpoint of the run resumed on one process
    resumed = run(python_cmd(*parity_flags(small_data, model, 8), "--fsdp", "--checkpointing_steps",
                             str(saved), "--output_dir", str(one), "--resume_from_checkpoint",
                             str(stopped / "checkpoints" / f"step_{step}")))
    assert f"at step {step}" in resumed.stdout and read_results(one)["world_size"] == 1
    run(torchrun_cmd(*parity_flags(small_data, model, 4), "--fsdp", "--output_dir", str(two),
                     "--resume_from_checkpoint", str(one / "checkpoints" / f"step_{saved}")))
    assert read_results(two)["world_size"] == 2
    ddp = parity_runs("torchrun", 2, 4)
    assert_continues(fsdp_run, one, step + 1, ddp)
    assert_continues(fsdp_run, two, saved + 1, ddp)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_on_one_process_and_back_on_two(parity_runs, small_data, tiny_bert_without_dropout,
                                                                  tmp_path):
    """2 processes x batch 4 x accumulation 2 stop; 1 process x batch 4 x accumulation 4 (the same global batch of
    16, split into twice the micro-steps) continues, and 2 x 4 x 2 continues that."""
    reference = parity_runs("torchrun", 2, 4)
    one, two = tmp_path / "one", tmp_path / "two"
    run(python_cmd(*parity_flags(small_data, tiny_bert_without_dropout, 4), "--gradient_accumulation_steps", "4",
                   "--checkpointing_steps", "5", "--output_dir", str(one),
                   "--resume_from_checkpoint", str(reference / "checkpoints" / "step_4")))
    run(torchrun_cmd(*parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir", str(two),
                     "--resume_from_checkpoint", str(one / "checkpoints" / "step_5")))
    assert [read_results(out)["world_size"] for out in (one, two)] == [1, 2]
    assert_continues(reference, one, 5, reference)
    assert_continues(reference, two, 6, reference)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_accelerates_fsdp_config_on_a_machine_without_gpus_says_to_use_torchrun(tmp_path):
    out = tmp_path / "out"
    result = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(REPO / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2", "--main_process_port",
                  str(free_port()), str(REPO / "recipes" / "classify.py"), "--output_dir", str(out)],
                 check=False, timeout=120)
    errors = [line for line in result.stderr.splitlines() if " error: " in line]
    # Each process refuses on its own; the launcher stops the other once the first has exited, at times before
    # that one has printed its line.
    assert result.returncode != 0 and len(errors) in (1, 2), result.stderr[-3000:]
    assert len({line.split("]")[0] for line in errors}) == len(errors), "one line a process"
    for line in errors:
        assert re.match(r"\[rank [01]\] error: Accelerate runs FSDP on GPUs only", line), line
        assert "torchrun --nproc_per_node=N RECIPE --fsdp" in line
    assert "[rank0]: Traceback" not in result.stderr and not out.exists(), "nothing trained, nothing written"


@pytest.fixture(scope="module")
def chat_runs(tiny_chat_model_with_distinct_replies, tmp_path_factory) -> dict:
    """The chat recipe with LoRA on the tiny Llama, 8 conversations, 2 steps of 2 x 2, under DDP and under
    ``--fsdp`` (which also merges the adapter), and sharded with ``--gradient_checkpointing``. Validation: 4
    conversations, a reply generated for the first only, so that the other process must join the generation's
    forwards with nothing of its own to generate."""
    folder = tmp_path_factory.mktemp("chat")
    data = make_support_conversations()
    for split, count in (("train", 8), ("validation", 4)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n"
                                                        for m in data[split]["messages"][:count]))
    flags = ["--train_file", str(folder / "train.jsonl"), "--validation_file", str(folder / "validation.jsonl"),
             "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--num_train_epochs", "1",
             "--lora_dropout", "0", "--logging_steps", "1", "--eval_generate", "1", "--max_new_tokens", "6",
             "--model_name_or_path", str(tiny_chat_model_with_distinct_replies), "--learning_rate", "1e-2"]
    outs = {"ddp": folder / "ddp", "fsdp": folder / "fsdp", "recomputed": folder / "recomputed"}
    run(torchrun_cmd(*flags, "--output_dir", str(outs["ddp"]), script=recipe_path("sft")))
    run(torchrun_cmd(*flags, "--fsdp", "--merge_lora", "--output_dir", str(outs["fsdp"]), script=recipe_path("sft")))
    run(torchrun_cmd(*flags, "--fsdp", "--merge_lora", "--gradient_checkpointing", "--output_dir",
                     str(outs["recomputed"]), script=recipe_path("sft")))
    return outs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lora_under_fsdp_trains_as_ddp_and_saves_the_whole_adapter(chat_runs):
    ddp, fsdp = chat_runs["ddp"], chat_runs["fsdp"]
    assert read_results(fsdp)["runtime"] == "fsdp"
    assert [h["step"] for h in log_history(ddp)] == [1, 2]
    assert_same_steps(log_history(fsdp), log_history(ddp))
    assert read_results(fsdp)["eval_loss"] == pytest.approx(read_results(ddp)["eval_loss"], rel=1e-5)
    # Every element of every LoRA weight: 2 matrices on each of the 7 linear layers of both blocks, whole.
    adapter, expected = (load_file(out / "adapter_model.safetensors") for out in (fsdp, ddp))
    assert len(adapter) == 2 * 7 * 2 and adapter.keys() == expected.keys()
    assert all(adapter[k].shape == expected[k].shape for k in expected)
    assert max((adapter[k] - expected[k]).abs().max().item() for k in expected) < 1e-5


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sharded_layers_recomputed_in_the_backward_pass_train_exactly_as_kept(chat_runs):
    """The checkpoint wraps each layer's forward inside FSDP2's hooks: the recompute gathers the shards again."""
    assert_same_steps(log_history(chat_runs["recomputed"]), log_history(chat_runs["fsdp"]), rel=1e-6)
    assert max_weight_diff(chat_runs["recomputed"], chat_runs["fsdp"], "adapter_model.safetensors") <= 1e-6
    assert read_results(chat_runs["recomputed"])["eval_loss"] == read_results(chat_runs["fsdp"])["eval_loss"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_sharded_adapter_loads_in_one_process_and_replies_as_the_sharded_model_did(
        chat_runs, tiny_chat_model_with_distinct_replies):
    assert assert_adapter_replies_as_generated(chat_runs["fsdp"], tiny_chat_model_with_distinct_replies,
                                               max_new_tokens=6, merged_atol=1e-4) == 1


def test_a_sharded_checkpoint_whose_metadata_would_run_code_is_refused_unread(tmp_path):
    """torch.distributed.checkpoint unpickles its metadata unrestricted: it is read first with an unpickler that
    takes checkpoint metadata only."""
    import os
    import pickle

    from finetune.distributed.fsdp import MODEL_FOLDER, OPTIMIZER_FOLDER, sharded_shapes

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    for name in (MODEL_FOLDER, OPTIMIZER_FOLDER):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(pickle.UnpicklingError, match="is not checkpoint metadata"):
        sharded_shapes(tmp_path)
    assert not (tmp_path / "ran").exists()


def test_fsdp_under_accelerate_launch_without_its_fsdp_config_is_refused(monkeypatch, tmp_path):
    from finetune.config import TrainConfig
    from finetune.errors import UserError
    from finetune.runtimes.launcher import make_runtime

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what accelerate launch sets, with no FSDP config
    with pytest.raises(UserError, match="under accelerate launch, pass --config_file accelerate_configs/fsdp.yaml"):
        make_runtime(TrainConfig(fsdp=True, output_dir=str(tmp_path)), None)
