"""The runtime on ``accelerate.Accelerator``: launch with ``accelerate launch`` (or plain python)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DistributedType, ProjectConfiguration
from safetensors.torch import load_file
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader

from finetune.data.batching import GlobalBatchSampler
from finetune.distributed.ddp import init_distributed
from finetune.distributed.fsdp import clip_grad_norm_, full_state_dict, generate_in_lockstep, transformer_block_classes
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError
from finetune.runtimes.base import Runtime, TrackerSettings, load_trainable_state, own_generator, trainable_state_dict
from finetune.runtimes.fsdp import load_sharded_state, save_sharded_state

__all__ = ["AccelerateRuntime"]


class AccelerateRuntime(Runtime):
    name = "accelerate"

    def __init__(self, *, mixed_precision: str | None, gradient_accumulation_steps: int, seed: int,
                 ddp_timeout: timedelta, project_dir: str, tracking: TrackerSettings | None):
        env = LaunchEnvironment.read()
        self._train_sampler: GlobalBatchSampler | None = None
        self.seed = seed
        cpu = not torch.accelerator.is_available()
        if env.world_size > 1 and env.restart_count > 0:
            # Accelerate would join through the store the dead attempt left behind; it adopts a group
            # that already exists, so form a fresh one for this attempt first.
            init_distributed("gloo" if cpu else None, ddp_timeout)
        self.accelerator = Accelerator(
            # Without cpu=True a multi-process launch on a machine with no accelerator starts processes
            # that each train alone; with it they form one gloo group.
            cpu=cpu,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            # Our scheduler counts optimizer steps, the same at any world size; Accelerate would step it
            # once per process per optimizer step.
            step_scheduler_with_optimizer=False,
            dataloader_config=DataLoaderConfiguration(even_batches=True),
            kwargs_handlers=[InitProcessGroupKwargs(timeout=ddp_timeout)],
            project_config=ProjectConfiguration(project_dir=project_dir),
        )
        if self.accelerator.num_processes != env.world_size:
            raise UserError(
                f"{env.world_size} processes were launched but Accelerate sees {self.accelerator.num_processes}: "
                "they are not one process group; launch with accelerate_configs/cpu_ddp.yaml or set use_cpu: true")
        self.world_size = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.device = self.accelerator.device
        if self.accelerator.distributed_type == DistributedType.FSDP and not self.shards:
            raise UserError("the accelerate config asks for FSDP version 1; set fsdp_version: 2 in its fsdp_config")
        if self.shards and self.accelerator.mixed_precision == "bf16":
            # Accelerate's policy would also reduce gradients in bf16; in float32, as torchrun --fsdp does.
            self.accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self._prepared = ()
        self._start_tracking(tracking)
        self.accelerator.register_save_state_pre_hook(self._save_trainable_only)
        self.accelerator.register_load_state_pre_hook(self._load_trainable_only)

    @property
    def shards(self) -> bool:
        return getattr(self.accelerator, "is_fsdp2", False)  # an older Accelerate has no FSDP2

    @property
    def shards_weights(self) -> bool:
        deepspeed = self.accelerator.state.deepspeed_plugin
        return self.shards or (deepspeed is not None and deepspeed.zero_stage == 3)

    def _save_trainable_only(self, models, weights, output_dir):
        # Checkpoints hold only the weights that train, under the unwrapped names (as the raw-DDP runtime).
        # DeepSpeed saves sharded states its own way, and keeps doing so.
        if self._shards_itself():
            return
        weights[:] = [trainable_state_dict(self.accelerator.unwrap_model(model)) for model in models]

    def _load_trainable_only(self, models, input_dir):
        if self._shards_itself():
            return
        (model,) = models
        # Read on the CPU (safetensors does not take Accelerate's "cpu:0"); loading copies onto the model's device.
        state = load_file(Path(input_dir) / "model.safetensors")
        load_trainable_state(self.accelerator.unwrap_model(model), state, Path(input_dir))
        models.clear()  # loaded here; Accelerate would expect the full state dict

    def _shards_itself(self) -> bool:
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def train_loader(self, dataset, sampler, collate_fn):
        # Accelerate shards batches round-robin, which is how the sampler lays out ranks' shares.
        self._train_sampler = sampler
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, generator=own_generator(self.seed))

    def eval_loader(self, dataset, batch_size, collate_fn):
        return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn,
                          generator=own_generator(self.seed))

    def prepare(self, model, optimizer, scheduler, *loaders):
        if self.shards and self.accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap is None:
            # Accelerate shards the input embeddings on their own after the blocks, and fails when a block it
            # wrapped holds them (BERT's embedding layer is in _no_split_modules): the blocks as torchrun --fsdp.
            self.accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = transformer_block_classes(model)
        prepared = self.accelerator.prepare(model, optimizer, scheduler, *loaders)
        self._loss_scale = self._scale()
        if self.shards:
            generate_in_lockstep(prepared[0])
            self._prepared = (prepared[0], optimizer, scheduler)  # the optimizer now steps the shards
        return prepared

    def epoch_batches(self, train_loader, epoch, skip_batches=0):
        # The prepared loader re-applies its own epoch counter to an unsharded sampler on every pass, so
        # both are set.
        train_loader.set_epoch(epoch)
        self._train_sampler.set_epoch(epoch)
        if skip_batches:
            return self.accelerator.skip_first_batches(train_loader, skip_batches)
        return train_loader

    @contextlib.contextmanager
    def accumulate(self, model, ends_step):
        # Accelerate's own accumulate() watches the loader for the epoch's end, which a rollout reaches early.
        self.accelerator.sync_gradients = ends_step
        with contextlib.nullcontext() if ends_step else self.accelerator.no_sync(model):
            yield

    @property
    def sync_gradients(self):
        return self.accelerator.sync_gradients

    def optimizer_step_was_skipped(self):
        # Accelerate's own flag misses the skips of a fused optimizer, whose kernel takes the overflow check: the
        # scaler lowers its scale after exactly the steps it skipped.
        before, self._loss_scale = self._loss_scale, self._scale()
        return before is not None and self._loss_scale < before

    def _scale(self) -> float | None:
        """The fp16 loss scaler's scale (None without one)."""
        return self.accelerator.scaler.get_scale() if self.accelerator.scaler else None

    def backward(self, loss):
        # Accelerate divides by the accumulation steps (as DeepSpeed's engine does); the loop's loss is
        # already normalised over the window, so that division is undone.
        self.accelerator.backward(loss * self.accelerator.gradient_accumulation_steps)

    def clip_grad_norm_(self, model, max_norm):
        if self.shards:  # the norm as a plain tensor, as the loop reads it (Accelerate's is a DTensor)
            self.accelerator.unscale_gradients()  # (fp16: Accelerate's own clip unscales first too)
            return clip_grad_norm_(model, max_norm)
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        # DeepSpeed's engine clips in its own step and gives the norm as a number, or None where it has none
        return norm if norm is None or torch.is_tensor(norm) else torch.tensor(float(norm))

    def gather_for_metrics(self, tensors, pad_index=-100):
        padded = tuple(self.accelerator.pad_across_processes(t, dim=1, pad_index=pad_index) if t.dim() > 1 else t
                       for t in tensors)
        return self.accelerator.gather_for_metrics(padded)

    def reduce_sum(self, tensor):
        return self.accelerator.reduce(tensor, reduction="sum")

    def wait_for_everyone(self):
        self.accelerator.wait_for_everyone()

    def autocast(self):
        return self.accelerator.autocast()

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def unwrapped_state_dict(self, model):
        if self.shards:  # every weight whole, a LoRA adapter too (not the main process's slice: accelerate #4206)
            return full_state_dict(model)
        return self.accelerator.get_state_dict(model)

    def _save_state(self, folder):
        if self.shards:  # the same sharded checkpoint as torchrun --fsdp, so that either resumes the other's
            save_sharded_state(folder, *self._prepared, self.rank)
        else:
            self.accelerator.save_state(str(folder))

    def _load_state(self, folder):
        if self.shards:
            load_sharded_state(folder, *self._prepared, self.rank)
        else:
            self.accelerator.load_state(str(folder))
            self._loss_scale = self._scale()

    def close(self):
        self.accelerator.end_training()
