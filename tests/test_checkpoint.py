import json
import logging
from dataclasses import replace

import pytest
import torch
from helpers import snapshot
from safetensors.torch import save_file

import finetune
from finetune.checkpointing.checkpoint import (
    Progress,
    check_output_dir,
    check_unwrapped,
    clear_output_dir,
    find_latest_checkpoint,
    load_state_dict_unwrapped,
    output_dir_lock,
    prune_checkpoints,
    read_progress,
    resolve_resume_checkpoint,
    resumed_progress,
    verify_checkpoint,
    write_final_model,
    write_manifest,
    write_progress,
)
from finetune.errors import UserError


def make_checkpoint(root, step, complete=True, run_id="", launch_id=""):
    folder = root / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    (folder / "optimizer.bin").write_bytes(b"moments" * 100)
    write_progress(folder, Progress(global_step=step, run_id=run_id, launch_id=launch_id))
    if complete:
        write_manifest(folder, Progress(global_step=step, world_size=2, seed=7))
    return folder


def names(root) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir())


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 5)
    newest = make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 15, complete=False)
    (tmp_path / "checkpoints" / "step_20.partial").mkdir()
    assert find_latest_checkpoint(str(tmp_path)) == newest
    assert resolve_resume_checkpoint("latest", str(tmp_path)) == newest


def test_latest_without_checkpoints_starts_fresh(tmp_path):
    assert resolve_resume_checkpoint("latest", str(tmp_path)) is None


def test_prune_keeps_the_newest_of_this_run_and_never_touches_another_runs(tmp_path):
    """A run resumed from step_2 of run "a", beside run "b"'s step_9 and step_10: with a limit of 2, what goes is
    "a"'s oldest up to the step just written; "b"'s (higher steps) and "a"'s step_8 (beyond it) stay."""
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, step, run_id="a")
    for step in (9, 10):
        make_checkpoint(tmp_path, step, run_id="b")
    prune_checkpoints(str(tmp_path), 2, Progress(global_step=6, run_id="a"))
    assert names(tmp_path) == ["step_10", "step_4", "step_6", "step_8", "step_9"]


def test_output_dir_rules(tmp_path):
    check_output_dir(str(tmp_path / "new"), overwrite=False, resume_from=None)
    for model_file in ("model.safetensors", "adapter_config.json"):
        (tmp_path / model_file).write_bytes(b"x")
        with pytest.raises(UserError, match="already holds a model"):
            check_output_dir(str(tmp_path), overwrite=False, resume_from=None)
        check_output_dir(str(tmp_path), overwrite=True, resume_from=None)
        (tmp_path / model_file).unlink()


def test_a_wrapped_state_dict_is_refused_at_save_time():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="wrapper prefix"):
        check_unwrapped({"module.weight": model.weight})
    check_unwrapped(model.state_dict())


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_prefixed_keys_are_repaired_on_load_with_one_warning(tmp_path, caplog, suffix):
    model = torch.nn.Linear(3, 2)
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    path = tmp_path / f"state{suffix}"
    save_file(wrapped, path) if suffix == ".safetensors" else torch.save(wrapped, path)
    with caplog.at_level(logging.WARNING):
        state = load_state_dict_unwrapped(path)
    assert sorted(state) == ["bias", "weight"]
    torch.testing.assert_close(state["weight"], model.weight.detach())
    assert len([r for r in caplog.records if "module." in r.getMessage()]) == 1
    torch.nn.Linear(3, 2).load_state_dict(state)


def test_the_manifest_records_progress_versions_and_checksums(tmp_path, monkeypatch):
    """Also where the package runs from a checkout that pip never installed (on ``PYTHONPATH``, as the GPU check
    runs it): no installed metadata names its version, and a checkpoint must not crash for that."""
    import hashlib
    import importlib.metadata
    import json

    installed = importlib.metadata.Distribution.from_name.__func__

    def from_name(cls, name):
        if name == "finetune":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(cls, name)

    monkeypatch.setattr(importlib.metadata.Distribution, "from_name", classmethod(from_name))
    folder = make_checkpoint(tmp_path, 4)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["global_step"], manifest["world_size"], manifest["seed"]) == (4, 2, 7)
    assert (manifest["torch_version"], manifest["finetune_version"]) == (torch.__version__, finetune.__version__)
    assert manifest["files"]["optimizer.bin"] == hashlib.sha256(b"moments" * 100).hexdigest()
    assert sorted(manifest["files"]) == ["model.safetensors", "optimizer.bin", "progress.json"]
    verify_checkpoint(folder)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_file_is_refused_by_name_and_latest_falls_back(tmp_path, capsys, damage):
    older = make_checkpoint(tmp_path, 4)
    newer = make_checkpoint(tmp_path, 8)
    target = newer / "optimizer.bin"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[5] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    with pytest.raises(UserError, match=r"step_8/optimizer\.bin is (damaged|missing)"):
        resolve_resume_checkpoint(str(newer), str(tmp_path))
    assert resolve_resume_checkpoint("latest", str(tmp_path)) == older
    warning = capsys.readouterr().err
    assert "warning: skipping" in warning and "step_8/optimizer.bin" in warning


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "sub/../../x"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path, name):
    import json

    folder = make_checkpoint(tmp_path, 4)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="is not a file inside the checkpoint"):
        verify_checkpoint(folder)


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    folder = make_checkpoint(tmp_path, 4)
    (folder / "extra.bin").write_bytes(b"slipped in")
    with pytest.raises(UserError, match="holds extra.bin, which its manifest does not list"):
        verify_checkpoint(folder)


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_and_overwriting_waits_for_the_start(tmp_path):
    old = make_checkpoint(tmp_path, 4, run_id="old")
    (tmp_path / "log_history.jsonl").write_text('{"step": 4}\n')
    with pytest.raises(UserError, match=r"another run's checkpoints \(step_4\)"):
        check_output_dir(str(tmp_path), overwrite=False, resume_from=None)
    check_output_dir(str(tmp_path), overwrite=False, resume_from=old)
    before = snapshot(tmp_path)
    check_output_dir(str(tmp_path), overwrite=True, resume_from=None)
    assert snapshot(tmp_path) == before, "checking removes nothing: the run may still stop on bad input"
    clear_output_dir(str(tmp_path), Progress(run_id="new"), overwrite=True)
    assert names(tmp_path) == [] and not (tmp_path / "log_history.jsonl").exists()


def test_a_resume_into_a_folder_with_another_runs_later_steps_is_refused_unless_overwritten(tmp_path):
    """Run "a" resumes from its step_100 into a folder where run "b" got to step_1000: `latest` would continue
    "b" later, and a limit on checkpoints would count "b"'s. Overwriting removes "b"'s once "a" starts."""
    resumed = make_checkpoint(tmp_path, 100, run_id="a")
    make_checkpoint(tmp_path, 50, run_id="b")
    make_checkpoint(tmp_path, 900, run_id="b")
    make_checkpoint(tmp_path, 1000, run_id="b")
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=r"another run's checkpoints of later steps \(step_900, step_1000\)"):
        check_output_dir(str(tmp_path), overwrite=False, resume_from=resumed)
    check_output_dir(str(tmp_path), overwrite=True, resume_from=resumed)
    assert snapshot(tmp_path) == before
    clear_output_dir(str(tmp_path), read_progress(resumed), overwrite=True)
    assert names(tmp_path) == ["step_100"]


def test_latest_for_a_restarted_launch_is_its_own_newest_checkpoint(tmp_path):
    own = make_checkpoint(tmp_path, 4, launch_id="slurm:c:7")
    make_checkpoint(tmp_path, 8, launch_id="slurm:c:6")  # the run this launch overwrites, not yet removed
    assert find_latest_checkpoint(str(tmp_path), "slurm:c:7") == own
    assert find_latest_checkpoint(str(tmp_path), "slurm:c:8") is None


def test_a_lock_file_planted_as_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".finetune.lock").symlink_to(victim)
    with pytest.raises(UserError, match=r"\.finetune\.lock is a symbolic link"):
        with output_dir_lock(str(out)):
            pass
    assert victim.read_text() == "precious"


def test_the_final_model_replaces_the_old_only_once_complete(tmp_path):
    out = tmp_path / "out"
    (out / "merged").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "merged/model.safetensors", "notes.txt"):
        (out / name).write_text(f"old {name}")
    before = snapshot(out)

    def torn(folder):
        (folder / "model.safetensors").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_final_model(str(out), torn)
    assert snapshot(out) == before, "a failed save leaves the old model as it was, and nothing else"

    def complete(folder):
        (folder / "merged").mkdir()
        for name in ("model.safetensors", "config.json", "merged/model.safetensors", "merged/config.json"):
            (folder / name).write_text(f"new {name}")

    assert write_final_model(str(out), complete) == ["config.json", "merged/config.json", "merged/model.safetensors",
                                                     "model.safetensors"]
    assert {name: (out / name).read_text() for name in ("model.safetensors", "merged/model.safetensors",
                                                        "notes.txt")} == {
        "model.safetensors": "new model.safetensors", "merged/model.safetensors": "new merged/model.safetensors",
        "notes.txt": "old notes.txt"}
    assert sorted(p.name for p in out.iterdir()) == [".finetune_saved.json", "config.json", "merged",
                                                     "model.safetensors", "notes.txt"]


def progress(world_size, batch, accumulation, **position):
    return Progress(world_size=world_size, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                    runtime="ddp", **position)


def test_another_world_size_resumes_when_the_global_batch_is_kept(tmp_path):
    saved = progress(2, 4, 2, global_step=5, epoch=1, batches_in_epoch=4, seed=7)
    resumed = resumed_progress(saved, progress(1, 8, 2, seed=7), tmp_path, batches_per_rank=6)
    assert resumed == progress(1, 8, 2, global_step=5, epoch=1, batches_in_epoch=4, seed=7)
    # Another split of the same 16 examples a step: the position carries over in optimizer steps (2 done).
    assert resumed_progress(saved, progress(2, 8, 1, seed=7), tmp_path, batches_per_rank=3).batches_in_epoch == 2
    assert resumed_progress(saved, progress(1, 4, 4, seed=7), tmp_path, batches_per_rank=11).batches_in_epoch == 8
    # At the end of an epoch with a short last window, the end of the epoch in the new split.
    end = progress(1, 4, 4, global_step=3, batches_in_epoch=11)
    assert resumed_progress(end, progress(2, 8, 1), tmp_path, batches_per_rank=3).batches_in_epoch == 3


def test_a_checkpoint_written_again_for_its_step_leaves_the_earlier_one_where_the_new_one_cannot_take_its_place(
        tmp_path, monkeypatch):
    """A restarted run checkpoints a step it checkpointed before: the earlier checkpoint stays complete until the
    new one is in place, and where the disk refuses that (here its last rename), it is still there, verified."""
    import errno
    from datetime import timedelta
    from pathlib import Path

    from finetune.runtimes.ddp import DDPRuntime

    runtime = DDPRuntime(mixed_precision=None, seed=0, backend=None, ddp_timeout=timedelta(minutes=1), tracking=None)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    runtime.prepare(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    out = str(tmp_path / "out")
    step = Progress(global_step=3, world_size=1, runtime="ddp")
    first = runtime.save_checkpoint(out, step, keep=None)
    files = sorted(path.name for path in first.iterdir())
    rename = Path.rename

    def disk_full_for_the_new_one(path, target):
        if path.name.endswith(".partial"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return rename(path, target)

    monkeypatch.setattr(Path, "rename", disk_full_for_the_new_one)
    with pytest.raises(UserError, match="cannot write checkpoint .*step_3 .*earlier checkpoints are intact"):
        runtime.save_checkpoint(out, replace(step, launch_id="restarted"), keep=None)
    assert find_latest_checkpoint(out) == first and sorted(path.name for path in first.iterdir()) == files
    verify_checkpoint(first)
    assert [path.name for path in first.parent.iterdir()] == ["step_3"]
    monkeypatch.setattr(Path, "rename", rename)
    assert runtime.save_checkpoint(out, replace(step, launch_id="restarted"), keep=None) == first
    assert read_progress(first).launch_id == "restarted"
    assert [path.name for path in first.parent.iterdir()] == ["step_3"]


def test_another_seed_is_refused_since_the_order_of_the_data_depends_on_it(tmp_path):
    with pytest.raises(UserError, match=r"written by a run with --seed 7 and this run has --seed 0; the order of the "
                                        r"data depends on it, so resume with --seed 7"):
        resumed_progress(progress(1, 8, 1, seed=7), progress(1, 8, 1), tmp_path, batches_per_rank=3)


@pytest.mark.parametrize(("run", "advice"), [
    (progress(1, 4, 2), "with 1 process(es), pass --per_device_train_batch_size 8 or --gradient_accumulation_steps 4"),
    (progress(4, 8, 1), "with 4 process(es), pass --per_device_train_batch_size 4"),
    (progress(4, 3, 3), "with 4 process(es), pass --per_device_train_batch_size 4 --gradient_accumulation_steps 1"),
    (progress(3, 4, 2), "resume with a number of processes that divides 16, such as 2"),
])
def test_a_changed_global_batch_is_refused_with_the_numbers_that_keep_it(tmp_path, run, advice):
    with pytest.raises(UserError, match="written with a global batch of 16 \\(4 per device x 2 process\\(es\\) x 2 "
                                        "accumulation step\\(s\\)\\)") as refused:
        resumed_progress(progress(2, 4, 2), run, tmp_path, batches_per_rank=3)
    assert str(refused.value).endswith(advice)


def test_a_checkpoint_that_does_not_record_its_batch_resumes_only_at_its_world_size(tmp_path):
    old = Progress(global_step=3, world_size=2, runtime="ddp")
    assert resumed_progress(old, progress(2, 4, 1), tmp_path, batches_per_rank=3).per_device_train_batch_size == 4
    with pytest.raises(UserError, match="written by 2 processes and this run has 1; the checkpoint does not record"):
        resumed_progress(old, progress(1, 8, 1), tmp_path, batches_per_rank=3)


def test_the_final_save_removes_what_the_previous_save_wrote_and_not_the_user_s_files(tmp_path):
    """A LoRA run's adapter, card and merged model, then a full model in the same folder: only the full model, the
    user's notes and what no save wrote remain."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's notes")
    (out / "log_history.jsonl").write_text('{"step": 1}\n')

    def adapter(folder):
        (folder / "merged").mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json",
                     "merged/model.safetensors", "merged/config.json"):
            (folder / name).write_text(f"lora {name}")

    def full_model(folder):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (folder / name).write_text(f"full {name}")

    write_final_model(str(out), adapter)
    (out / "merged" / "mine.txt").write_text("the user's file in merged/")
    assert write_final_model(str(out), full_model) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert {name: (out / name).read_text() for name in snapshot(out)} == {
        ".finetune_saved.json": '[\n  "config.json",\n  "model.safetensors",\n  "tokenizer.json"\n]',
        "config.json": "full config.json", "model.safetensors": "full model.safetensors",
        "tokenizer.json": "full tokenizer.json", "notes.txt": "the user's notes", "log_history.jsonl": '{"step": 1}\n',
        "merged/mine.txt": "the user's file in merged/"}
    assert sorted(p.name for p in (out / "merged").iterdir()) == ["mine.txt"]


def test_a_record_of_saved_files_edited_by_hand_reaches_nothing_outside_the_output_folder(tmp_path):
    out, outside = tmp_path / "out", tmp_path / "outside"
    for folder in (out, outside):
        folder.mkdir()
    (outside / "victim.txt").write_text("precious")
    (out / "linked").symlink_to(outside)
    (out / ".finetune.lock").write_text("a run's lock")
    (out / ".finetune_saved.json").write_text(json.dumps(["../outside/victim.txt", str(outside / "victim.txt"),
                                                          "linked/victim.txt", ".finetune.lock", ""]))
    write_final_model(str(out), lambda folder: (folder / "config.json").write_text("{}"))
    assert (outside / "victim.txt").read_text() == "precious" and (out / ".finetune.lock").is_file()
    assert json.loads((out / ".finetune_saved.json").read_text()) == ["config.json"]


def test_a_resume_keeps_the_log_up_to_its_step_and_a_line_cut_short_goes(tmp_path):
    (tmp_path / "log_history.jsonl").write_text("".join(f'{{"step": {step}, "loss": 0.5}}\n' for step in range(1, 7))
                                                + '{"step": 7, "lo')
    clear_output_dir(str(tmp_path), Progress(global_step=4, run_id="a"), overwrite=False)
    assert [json.loads(line)["step"] for line in (tmp_path / "log_history.jsonl").read_text().splitlines()] == [
        1, 2, 3, 4]


def test_a_checkpoint_from_before_the_frozen_weights_were_recorded_resumes_and_records_them(tmp_path):
    saved = progress(1, 8, 1, global_step=3)
    resumed = resumed_progress(saved, replace(progress(1, 8, 1), frozen_weights="abc"), tmp_path, batches_per_rank=6)
    assert resumed.frozen_weights == "abc" and resumed.global_step == 3
    with pytest.raises(UserError, match="was trained on other frozen weights than this run's model"):
        resumed_progress(resumed, replace(progress(1, 8, 1), frozen_weights="abd"), tmp_path, batches_per_rank=6)
