import logging

import pytest
import torch
from safetensors.torch import save_file

from finetune.checkpoint import (
    Progress,
    check_output_dir,
    check_unwrapped,
    find_latest_checkpoint,
    load_state_dict_unwrapped,
    prune_checkpoints,
    resolve_resume_checkpoint,
    resumed_progress,
    verify_checkpoint,
    write_manifest,
    write_progress,
)
from finetune.errors import UserError


def make_checkpoint(root, step, complete=True):
    folder = root / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    (folder / "optimizer.bin").write_bytes(b"moments" * 100)
    write_progress(folder, Progress(global_step=step))
    if complete:
        write_manifest(folder, Progress(global_step=step, world_size=2, seed=7))
    return folder


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 5)
    newest = make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 15, complete=False)
    (tmp_path / "checkpoints" / "step_20.partial").mkdir()
    assert find_latest_checkpoint(str(tmp_path)) == newest
    assert resolve_resume_checkpoint("latest", str(tmp_path)) == newest


def test_latest_without_checkpoints_starts_fresh(tmp_path):
    assert resolve_resume_checkpoint("latest", str(tmp_path)) is None


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, step)
    prune_checkpoints(str(tmp_path), 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_6", "step_8"]


def test_output_dir_rules(tmp_path):
    check_output_dir(str(tmp_path / "new"), overwrite=False, resuming=False)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="already holds a model"):
        check_output_dir(str(tmp_path), overwrite=False, resuming=False)
    check_output_dir(str(tmp_path), overwrite=True, resuming=False)


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


def test_the_manifest_records_progress_versions_and_checksums(tmp_path):
    import hashlib
    import json

    folder = make_checkpoint(tmp_path, 4)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["global_step"], manifest["world_size"], manifest["seed"]) == (4, 2, 7)
    assert manifest["torch_version"] == torch.__version__ and manifest["finetune_version"]
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


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_unless_overwritten(tmp_path):
    make_checkpoint(tmp_path, 4)
    with pytest.raises(UserError, match=r"another run's checkpoints \(step_4\)"):
        check_output_dir(str(tmp_path), overwrite=False, resuming=False)
    check_output_dir(str(tmp_path), overwrite=False, resuming=True)
    assert (tmp_path / "checkpoints" / "step_4").is_dir(), "resuming keeps them"
    check_output_dir(str(tmp_path), overwrite=True, resuming=False)
    assert not (tmp_path / "checkpoints").exists(), "--overwrite_output_dir removes them"


def progress(world_size, batch, accumulation, **position):
    return Progress(world_size=world_size, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                    runtime="ddp", **position)


def test_another_world_size_resumes_when_the_global_batch_is_kept(tmp_path):
    saved = progress(2, 4, 2, global_step=5, epoch=1, batches_in_epoch=4, seed=7)
    resumed = resumed_progress(saved, progress(1, 8, 2), tmp_path, batches_per_rank=6)
    assert resumed == progress(1, 8, 2, global_step=5, epoch=1, batches_in_epoch=4, seed=7)
    # Another split of the same 16 examples a step: the position carries over in optimizer steps (2 done).
    assert resumed_progress(saved, progress(2, 8, 1), tmp_path, batches_per_rank=3).batches_in_epoch == 2
    assert resumed_progress(saved, progress(1, 4, 4), tmp_path, batches_per_rank=11).batches_in_epoch == 8
    # At the end of an epoch with a short last window, the end of the epoch in the new split.
    end = progress(1, 4, 4, global_step=3, batches_in_epoch=11)
    assert resumed_progress(end, progress(2, 8, 1), tmp_path, batches_per_rank=3).batches_in_epoch == 3


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
