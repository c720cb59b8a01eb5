"""QLoRA (--load_in_4bit): the frozen base in 4-bit NF4 through bitsandbytes, LoRA adapters trained on top."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import (
    HUB_TOKEN,
    assert_refused,
    assert_same_steps,
    log_history,
    max_weight_diff,
    read_weights,
    run_on,
    train_here,
    write_jsonl,
)
from huggingface_hub import constants
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from finetune.data.embedded.support_chats import make_support_conversations
from finetune.errors import UserError
from finetune.models.memory import FOUR_BIT_BASE_FILE, keep_four_bit_trainable
from finetune.models.trained import load_trained, trained_config

FLAGS = ["--load_in_4bit", "--learning_rate", "1e-2", "--eval_generate", "0", "--per_device_train_batch_size", "4"]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("qlora_data")
    data = make_support_conversations()
    train, validation = data["train"]["messages"][:16], data["validation"]["messages"][:4]
    return ["--train_file", write_jsonl(folder / "train.jsonl", [{"messages": m} for m in train]),
            "--validation_file", write_jsonl(folder / "validation.jsonl", [{"messages": m} for m in validation]),
            "--logging_steps", "1"]


def four_bit(model_path):
    """The model at ``model_path`` in 4-bit NF4 computing in float32 (not on bitsandbytes' bfloat16 CPU kernel)."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=config, dtype=torch.float32)
    keep_four_bit_trainable(model)
    return model


def test_the_adapter_trains_loads_on_the_float_base_and_merges_into_the_model_that_trained(tiny_chat_model,
                                                                                          chat_files, tmp_path,
                                                                                          hub, monkeypatch):
    """And each checkpoint pushed to the Hub carries the base's quantization beside its adapter, as the final
    folder does, so that it merges into the same weights."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest turned this process offline
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    for name, value in hub.env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    result = run_on("sft", tiny_chat_model, chat_files, out, *FLAGS, "--max_train_steps", "4", "--merge_lora",
                    "--checkpointing_steps", "2", "--push_to_hub", "--hub_model_id", "alice/qlora", "--hub_token",
                    HUB_TOKEN)
    assert "over the base's linear layers in 4-bit NF4, computing in float32" in result.stdout
    assert "weights trained in float32, frozen in float32/nf4" in result.stdout
    losses = [row["loss"] for row in log_history(out)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1
    adapter = read_weights(out, "adapter_model.safetensors")
    rows = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # The adapter is peft's, on the full-precision base as on the 4-bit one.
        on_float = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_chat_model), out).eval()
        loaded = {name: weight for name, weight in on_float.state_dict().items() if "lora_" in name}
        assert len(loaded) == len(adapter) and all(
            torch.equal(weight, adapter[name.replace(".default", "")]) for name, weight in loaded.items())
        trained = PeftModel.from_pretrained(four_bit(tiny_chat_model), out).eval()(rows).logits
        merged_model = AutoModelForCausalLM.from_pretrained(out / "merged")
        assert getattr(merged_model.config, "quantization_config", None) is None
        merged = merged_model.eval()(rows).logits
        float_base = on_float(rows).logits
        exported = load_trained(out).model(rows).logits  # what export and predict merge
    # Merged: the 4-bit weights dequantized, the adapter folded in; the model that trained to float32 rounding,
    # where the adapter on the original float weights is off by the quantization's error.
    assert (merged - trained).abs().max() < 1e-4
    assert (exported - trained).abs().max() < 1e-4
    assert json.loads((out / FOUR_BIT_BASE_FILE).read_text())["quantization_config"]["load_in_4bit"]
    repository = hub.repos["alice/qlora"]
    pushed = {commit["summary"]: repository.commits[commit["sha"]] for commit in repository.history}
    assert {"Training in progress, step 2", "Training in progress, step 4"} <= pushed.keys()
    for files in pushed.values():
        assert files[FOUR_BIT_BASE_FILE] == (out / FOUR_BIT_BASE_FILE).read_bytes()
    assert (float_base - trained).abs().max() > 1e-2


def test_over_a_base_quantized_from_bfloat16_export_merges_into_the_same_4_bit_weights(tiny_chat_model, chat_files,
                                                                                         tmp_path):
    """--dtype bfloat16 quantizes the base from its bf16 values, whose 4-bit codes differ from the float32 ones':
    what export and predict merge (quantized again from the dtype the folder records) is ``merged/``, which the run
    folded into its own 4-bit weights."""
    out = tmp_path / "out"
    run_on("sft", tiny_chat_model, chat_files, out, *FLAGS, "--max_train_steps", "1", "--merge_lora", "--dtype",
           "bfloat16")
    assert json.loads((out / FOUR_BIT_BASE_FILE).read_text())["dtype"] == "bfloat16"
    rows = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = load_trained(out).model(rows).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(rows).logits
    assert (exported - merged).abs().max() < 1e-5


def test_an_evaluation_between_steps_changes_no_gradient(tiny_chat_model, chat_files, tmp_path):
    """On a CPU with bfloat16 instructions, bitsandbytes moves a layer that runs in eval mode onto a kernel with no
    backward, for good: the steps after an evaluation would lose the gradients through the frozen layers."""
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "plain", *FLAGS, "--max_train_steps", "3")
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "evaluated", *FLAGS, "--max_train_steps", "3",
           "--eval_steps", "1")
    assert_same_steps(log_history(tmp_path / "evaluated"), log_history(tmp_path / "plain"), rel=1e-6)


@pytest.mark.parametrize("recipe", ["dpo", "grpo"])
def test_preference_tuning_trains_over_a_four_bit_base(recipe, tiny_chat_model, tmp_path):
    out = tmp_path / "out"
    flags = [flag for flag in FLAGS if recipe == "dpo" or flag not in ("--eval_generate", "0")]  # GRPO's is its own
    result = train_here(recipe, "--model_name_or_path", str(tiny_chat_model), "--output_dir", str(out), *flags,
                        "--max_train_steps", "2", "--logging_steps", "1", "--gradient_checkpointing")
    assert "frozen in float32/nf4" in result.stdout
    assert "activations of the longest micro-batch" in result.stdout
    assert len(log_history(out)) == 2 and (out / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(("flags", "expected"), [
    (["--no_use_lora"], ("--load_in_4bit with --no_use_lora", "leave out --no_use_lora")),
    (["--fsdp"], ("--load_in_4bit with --fsdp", "launch without sharding")),
])
def test_what_four_bit_weights_cannot_do_is_refused(flags, expected, tiny_chat_model, chat_files, tmp_path):
    assert_refused("sft", [*chat_files, "--model_name_or_path", str(tiny_chat_model), "--output_dir",
                           str(tmp_path / "out"), "--load_in_4bit", *flags], tmp_path, *expected)


def test_under_accelerate_s_fsdp_config_four_bit_weights_are_refused_as_under_fsdp(monkeypatch):
    """accelerate launch with accelerate_configs/fsdp.yaml sets ACCELERATE_USE_FSDP (GPUs only: on a CPU the launcher
    refuses the config first); the 4-bit base is refused there as under --fsdp."""
    from types import SimpleNamespace

    from finetune.errors import UserError
    from finetune.tasks.causal_lm import ChatModelArguments

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserError, match="--load_in_4bit with Accelerate's FSDP config: FSDP cannot shard"):
        ChatModelArguments(load_in_4bit=True).loading_options(SimpleNamespace(fsdp=False, mixed_precision="no"))


def test_without_bitsandbytes_the_flag_names_the_extra(tiny_chat_model, chat_files, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "bitsandbytes"
                        else find_spec(name, *args))
    assert_refused("sft", [*chat_files, "--model_name_or_path", str(tiny_chat_model), "--output_dir",
                           str(tmp_path / "out"), "--load_in_4bit"], tmp_path, "bitsandbytes", '".[qlora]"')
    adapter = tmp_path / "adapter"  # a QLoRA run's output: exporting or predicting it merges it
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_chat_model)}))
    (adapter / FOUR_BIT_BASE_FILE).write_text("{}")
    with pytest.raises(UserError, match=r"4-bit base.*pip install -e \"\.\[qlora\]\""):
        trained_config(adapter)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_and_two_train_alike(tiny_chat_model, chat_files, tmp_path):
    """The parity LoRA has across world sizes (tests/test_sft.py) holds over the 4-bit base: 1 x 4 equals 2 x 2."""
    flags = [*FLAGS, "--lora_dropout", "0", "--max_train_steps", "3", "--gradient_accumulation_steps", "2"]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "one", *flags)
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "two", *flags, "--per_device_train_batch_size", "2",
           launcher="torchrun", processes=2)
    assert_same_steps(log_history(tmp_path / "two"), log_history(tmp_path / "one"), rel=1e-5)
    # AdamW moves a weight by about the learning rate (1e-2) a step: a hundredth of one step.
    assert max_weight_diff(tmp_path / "two", tmp_path / "one", "adapter_model.safetensors") < 1e-4
