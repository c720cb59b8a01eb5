"""What only a CUDA GPU can check: `pytest -m gpu` (deselected otherwise; `bench/gpu_check.sh` runs them).

On a machine without CUDA these fail rather than skip: a GPU check that did not run must not pass.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    accelerate_cmd,
    log_history,
    max_weight_diff,
    read_jsonl,
    read_results,
    recipe_path,
    run,
    torchrun_cmd,
)
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune.checkpointing.checkpoint import verify_checkpoint

pytestmark = pytest.mark.gpu

CLASSIFY = recipe_path("classify")
SFT = recipe_path("sft")
DPO = recipe_path("dpo")
# accelerate_cmd's configuration, in one process: the run on this one GPU, and FSDP (one shard here)
ONE_GPU = {"config": "single_gpu.yaml", "num_processes": 1}
FSDP = {"config": "fsdp.yaml", "num_processes": 1}
CPU_DEFAULT_ACCURACY = 0.963
"""The classify default run's eval accuracy on the CPU (README, Quickstart)."""


@pytest.fixture(autouse=True)
def needs_cuda():
    assert torch.cuda.is_available(), "these checks need a CUDA GPU"


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory) -> Path:
    """The default MiniLM with dropout off, for comparisons that must not depend on dropout masks."""
    from finetune.models.loading import default_model_path

    folder = tmp_path_factory.mktemp("minilm_no_dropout")
    shutil.copytree(default_model_path(), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_classify_default_run_in_bf16_matches_the_cpu_accuracy(tmp_path):
    result = run(accelerate_cmd("--output_dir", str(tmp_path / "out"), **ONE_GPU, script=CLASSIFY), timeout=600)
    assert "process(es) on cuda" in result.stdout
    assert abs(read_results(tmp_path / "out")["eval_accuracy"] - CPU_DEFAULT_ACCURACY) <= 0.01


def test_raw_ddp_trains_two_processes_over_nccl(tmp_path):
    """One process per GPU in one NCCL group; on one GPU no group of two can form, so there is nothing to check."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"raw DDP over NCCL needs 2 GPUs for a process group of two; this machine has {gpus}")
    result = run(torchrun_cmd("--max_train_steps", "20", "--ddp_backend", "nccl", "--output_dir", str(tmp_path / "out"),
                              nproc=2, script=CLASSIFY))
    results = read_results(tmp_path / "out")
    assert (results["runtime"], results["world_size"], results["global_step"]) == ("ddp", 2, 20)
    assert "2 process(es) on cuda" in result.stdout


def load_and_predict(folder) -> tuple[list[str], float]:
    """The saved classifier, loaded in this process alone (no key missing or unexpected): its predicted label for
    each example of the embedded validation set, in order, and its mean loss there."""
    from finetune.data.embedded.support_tickets import LABEL_NAMES, make_support_tickets

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
    run(accelerate_cmd("--max_train_steps", "20", "--mixed_precision", "no", "--output_dir", str(out), **FSDP,
                       script=CLASSIFY))
    predictions, loss = load_and_predict(out)
    assert predictions == [row["prediction"] for row in read_jsonl(out / "eval_predictions.jsonl")]
    assert loss == pytest.approx(read_results(out)["eval_loss"], abs=1e-4)


FSDP_BF16 = {"accelerate": lambda *flags: accelerate_cmd(*flags, **FSDP, script=CLASSIFY),  # bf16 is the config's
             "torchrun": lambda *flags: torchrun_cmd("--fsdp", "--bf16", *flags, nproc=1, script=CLASSIFY)}


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
        losses = {h["step"]: h["loss"] for h in log_history(full)}
        for h in log_history(resumed):
            assert h["loss"] == pytest.approx(losses[h["step"]], rel=1e-2), (h, losses[h["step"]])
        assert max_weight_diff(full, resumed) <= 1e-3
        model, info = AutoModelForSequenceClassification.from_pretrained(resumed, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    history = {launcher: [h["loss"] for h in log_history(tmp_path / launcher)] for launcher in FSDP_BF16}
    assert history["torchrun"] == pytest.approx(history["accelerate"], rel=1e-2)


def test_a_resumed_run_on_the_gpu_ends_where_an_uninterrupted_one_does(tmp_path):
    """The same 12 steps from scratch would end at the same weights, so the resume itself is checked: its line,
    and steps 7 to 12 logged with the uninterrupted run's learning rates and (to bf16 rounding) losses."""
    flags = ["--max_train_steps", "12", "--checkpointing_steps", "6", "--mixed_precision", "bf16", "--logging_steps",
             "1"]
    full, resumed, checkpoint = tmp_path / "full", tmp_path / "resumed", tmp_path / "full" / "checkpoints" / "step_6"
    run(accelerate_cmd(*flags, "--output_dir", str(full), **ONE_GPU, script=CLASSIFY))
    result = run(accelerate_cmd(*flags, "--output_dir", str(resumed), "--resume_from_checkpoint", str(checkpoint),
                                **ONE_GPU, script=CLASSIFY))
    assert f"resumed from {checkpoint} at step 6" in result.stdout
    expected, ours = log_history(full)[6:], log_history(resumed)
    assert [h["step"] for h in ours] == [h["step"] for h in expected] == list(range(7, 13))
    for step, reference in zip(ours, expected, strict=True):
        assert step["learning_rate"] == pytest.approx(reference["learning_rate"], rel=1e-9)
        assert step["loss"] == pytest.approx(reference["loss"], rel=5e-3)
    # cuBLAS and embedding backward on a GPU may sum in another order from run to run: a bound, not equality.
    assert max_weight_diff(full, resumed) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_packed_batch_on_the_gpu_gives_each_token_the_loss_it_has_alone(dtype):
    """Packed rows as the recipe packs them on this GPU (flash-attention's variable-length kernels when flash-attn
    is installed and the model runs in bf16, SDPA with a mask built from the restarted position ids otherwise):
    every token's loss is its loss with its example alone, and without the restarted positions (the rows attending
    to each other) it is not. A tiny Llama drawn with wide weights, so that attention across examples changes
    losses by far (on the CPU: by 1.8 on average, by at least 0.015 for every token after the first example)."""
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

    from finetune.tasks.causal_lm import label_log_probs, language_model_collators
    from finetune.tasks.chat import IGNORE

    # (the packed collator needs no tokenizer; flash-attention's kernels take bf16, not float32)
    collate, _, packed, flash = language_model_collators(None, packing=True, half_precision=dtype == torch.bfloat16)
    assert packed
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="flash_attention_2" if flash
                                             else "sdpa")
    model = model.cuda().eval()
    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(3, 1000, (length,), generator=generator).tolist() for length in (37, 50, 23, 61))]

    def losses(batch: dict) -> torch.Tensor:
        log_probs, labels = label_log_probs(model, {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()})
        return -log_probs[labels != IGNORE].cpu()

    with torch.no_grad():
        together = losses(collate(rows))
        alone = torch.cat([losses({k: torch.tensor([v]) for k, v in row.items()}) for row in rows])
        crossing = losses(DataCollatorWithFlattening(return_position_ids=False)(rows))
    assert together.shape == alone.shape == (sum(len(row["input_ids"]) - 1 for row in rows),)
    if dtype == torch.float32:
        assert (together - alone).abs().max() <= 1e-3
    else:  # the logits are near 10, where bf16's step is 0.0625: a kernel that tiles a row differently moves
        # some logits by a step (seen on an H200: up to 0.061)
        assert (together - alone).abs().max() <= 0.125 and (together - alone).abs().mean() <= 0.02
    assert (crossing - alone).abs().mean() > 1.0


def test_sft_with_lora_in_bf16_trains_packed_and_padded(tmp_path):
    """The chat recipe on this GPU in bf16 with LoRA, both ways it batches, and with the frozen base in bf16
    (``--dtype bfloat16``), and packed with its layers recomputed in the backward pass (``--gradient_checkpointing``,
    through flash-attention's kernels), with its MLPs in tiles too (``--tiled_mlp``): each trains its 4 steps to
    finite losses, evaluates and writes its 8 replies and its adapter (the packing itself is checked token by token
    above). The model is a stand-in with random weights, so no accuracy is checked."""
    for flags, said in ((["--packing"], "packed batches"), (["--no_packing"], "padded batches"),
                        (["--no_packing", "--dtype", "bfloat16"], "weights trained in float32, frozen in bfloat16"),
                        (["--packing", "--gradient_checkpointing"], "layers recomputed in the backward pass"),
                        (["--packing", "--gradient_checkpointing", "--tiled_mlp"], "MLPs run in tiles of positions")):
        out = tmp_path / "-".join(flag.strip("-") for flag in flags)
        result = run(accelerate_cmd(*flags, "--max_train_steps", "4", "--logging_steps", "1", "--eval_generate", "8",
                                    "--output_dir", str(out), **ONE_GPU, script=SFT), timeout=600)
        assert said in result.stdout
        assert [h["step"] for h in log_history(out)] == [1, 2, 3, 4]
        assert all(math.isfinite(h["loss"]) for h in log_history(out))
        assert math.isfinite(read_results(out)["eval_loss"])
        assert len((out / "eval_generations.jsonl").read_text().splitlines()) == 8
        assert (out / "adapter_model.safetensors").is_file()


def test_lora_dropout_draws_peft_s_masks_again_from_the_gpu_s_random_state():
    """LoRA's dropout on this GPU (``DropoutLinear``, which keeps the random state, not the mask): peft's own
    layers' log-probabilities and, within float32 rounding, gradients; other masks move them far more."""
    from helpers import padded_batch
    from test_lora import adapted

    from finetune.tasks.causal_lm import label_log_probs

    def step(model, seed):
        torch.manual_seed(seed)
        log_probs = label_log_probs(model, {name: value.cuda() for name, value in padded_batch().items()})[0]
        log_probs.sum().backward()
        return log_probs.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    (ours, our_grads), (peft_s, grads) = step(adapted(0.3).cuda(), 5), step(adapted(0.3, peft_only=True).cuda(), 5)
    _, other_masks = step(adapted(0.3, peft_only=True).cuda(), 6)
    assert torch.equal(ours, peft_s) and our_grads.keys() == grads.keys() and len(grads) == 28
    for name, grad in grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(other_masks[name], grad, rtol=1e-3, atol=1e-5), name


def test_tiled_mlps_draw_their_dropout_again_from_the_gpu_s_random_state_under_autocast(monkeypatch):
    """--tiled_mlp on this GPU under bf16 autocast, LoRA's dropout on: the backward pass runs each tile again in
    bf16 (as the forward did) and draws the dropout's masks again from the GPU's random state, so the loss is that
    of the same tiles keeping every activation and the gradients are within bf16's rounding of theirs (measured on
    a CPU: 0.009 of each gradient's largest value; other masks move them by 0.8)."""
    import copy

    from helpers import padded_batch
    from test_lora import adapted

    from finetune.models import memory

    def step(model):
        model, dtypes = copy.deepcopy(model), []
        memory.tile_mlps(model)
        model.get_submodule("base_model.model.model.layers.0.mlp.down_proj").register_forward_hook(
            lambda module, inputs, output: dtypes.append(output.dtype))
        batch = {name: value.cuda() for name, value in padded_batch(lengths=(40, 30, 25)).items()}  # 4 tiles of 32
        torch.manual_seed(0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}, dtypes

    def kept_tiles(mlp, tiles, x, *weights):
        return torch.cat([mlp.untiled_forward(part) for part in x.reshape(-1, x.shape[-1]).tensor_split(tiles)]
                         ).reshape(*x.shape[:-1], -1)

    model = adapted(0.1).cuda().train()
    loss, gradients, dtypes = step(model)
    with monkeypatch.context() as patched:
        patched.setattr(memory._TiledMLP, "apply", kept_tiles)
        reference_loss, reference_gradients, _ = step(model)
    assert dtypes == [torch.bfloat16] * 8  # 4 tiles forward, 4 again in the backward pass
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    assert gradients.keys() == reference_gradients.keys() and len(gradients) > 0
    for name, gradient in gradients.items():
        largest = reference_gradients[name].abs().max()
        assert (gradient - reference_gradients[name]).abs().max() <= 0.05 * largest, name


def test_qlora_in_bf16_trains_and_merges_on_the_gpu(tmp_path):
    """The chat recipe with its frozen base in 4-bit NF4 on this GPU (bitsandbytes' CUDA kernels, the model loaded
    onto this process's device), computing in bf16, layers recomputed: 4 steps to finite losses, the adapter, and
    a merged float32 model. bitsandbytes' wheel (43 MB) does not fit the bundle: the machine must have it."""
    import importlib.util

    assert importlib.util.find_spec("bitsandbytes"), "this GPU machine has no bitsandbytes: QLoRA is unverified"
    out = tmp_path / "out"
    result = run(accelerate_cmd("--load_in_4bit", "--gradient_checkpointing", "--merge_lora", "--max_train_steps", "4",
                                "--logging_steps", "1", "--eval_generate", "2", "--output_dir", str(out), **ONE_GPU,
                                script=SFT), timeout=600)
    assert "4-bit NF4, computing in bfloat16" in result.stdout and "process(es) on cuda" in result.stdout
    assert [h["step"] for h in log_history(out)] == [1, 2, 3, 4]
    assert all(math.isfinite(h["loss"]) for h in log_history(out))
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged" / "model.safetensors").is_file()


def test_dpo_with_lora_in_bf16_starts_at_ln_2_and_trains(tmp_path):
    """The preference recipe on this GPU in bf16 with LoRA and its live reference (peft's adapter switch on the
    unwrapped model, under autocast): the fresh adapter adds exact zeros, so the first step's loss is ln 2 and its
    margin 0 up to the kernels' rounding; then finite losses, an evaluation of every validation pair with its
    predictions file, and the adapter. The model is a stand-in with random weights: no accuracy is checked."""
    out = tmp_path / "out"
    result = run(accelerate_cmd("--max_train_steps", "2", "--logging_steps", "1", "--output_dir", str(out), **ONE_GPU,
                                script=DPO), timeout=600)
    assert "process(es) on cuda" in result.stdout
    first, second = log_history(out)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-3) and abs(first["rewards_margin"]) < 1e-3
    assert math.isfinite(second["loss"]) and math.isfinite(read_results(out)["eval_loss"])
    assert len((out / "eval_predictions.jsonl").read_text().splitlines()) == 32
    assert (out / "adapter_model.safetensors").is_file()


def test_grpo_with_lora_in_bf16_samples_on_the_gpu_and_trains(tmp_path):
    """The reinforcement-learning recipe on this GPU: completions sampled with a CUDA generator each, scored by the
    routing reward in its worker process, two steps of finite losses, an evaluation of every validation prompt and
    the adapter. The model is a stand-in with random weights: no reward is checked."""
    out = tmp_path / "out"
    result = run(accelerate_cmd("--max_train_steps", "2", "--output_dir", str(out), **ONE_GPU,
                                script=recipe_path("grpo")), timeout=600)
    assert "process(es) on cuda" in result.stdout
    history = log_history(out)
    assert [h["step"] for h in history] == [1, 2]
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in history)
    assert all(h["completions/mean_length"] > 0 and h["reward_failures/routing_reward"] == 0 for h in history)
    assert len(read_jsonl(out / "eval_generations.jsonl")) == 47
    assert (out / "adapter_model.safetensors").is_file()


CPU_DEFAULT_MRR = 0.902
"""The embedding recipe's default run's held-out MRR@10 on the CPU (bench/results/embed-default.json)."""


def test_the_embedding_default_run_caches_gradients_on_the_gpu_and_retrieves_as_on_the_cpu(tmp_path):
    """The embedding recipe's default global batch (32) as 16 x accumulation 2: the cached-gradient path, each
    micro-batch's second pass replaying its CUDA random state, in bf16. Dropout's masks and bf16 differ from the CPU
    run, so its held-out MRR@10 is close to the CPU's, not equal."""
    out = tmp_path / "out"
    result = run(accelerate_cmd("--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "2",
                                "--output_dir", str(out), **ONE_GPU, script=recipe_path("embed")), timeout=600)
    assert "process(es) on cuda" in result.stdout
    history = log_history(out)
    assert history[-1]["step"] == 75 and all(math.isfinite(h["loss"]) for h in history)
    assert abs(read_results(out)["eval_mrr@10"] - CPU_DEFAULT_MRR) <= 0.03
