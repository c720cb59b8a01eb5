"""The upload process behind ``finetune.hub.HubPusher``: commits pushes to one Hub repository, in order.

Uploading encodes and hashes whole files. In a thread of the training process that work would hold
the GIL between training's kernel launches and take a core from it; in a process of its own at the
low CPU priority (nice 10) it takes little from training, yet still a share when training keeps every
core busy (at idle priority it would starve there, and a machine that died mid-run would leave nothing on
the Hub). It imports nothing but huggingface_hub and is run by path, so it starts in a fraction of a second.

Protocol: ``python hub_uploader.py REPO_ID [REVISION]`` with the token in ``HF_TOKEN``. Each line on
stdin is a push: ``{"push": n, "message": ..., "files": [[path_in_repo, local_path], ...], "stage": ...,
"saved_at": ...}``. Each line on stdout is its outcome: the push number and message, ``commit_id`` and
``seconds_after_save`` (from the files being complete on disk to the commit), or ``error``. The process ends
when stdin is closed and every push is done.

Staging copies (``.hub_staging/step_N``, hard links of a checkpoint) go once pushed; a failed one stays for
``hf upload`` until a later push is done, so at most one failed copy is kept besides those still queued.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from huggingface_hub import CommitOperationAdd, HfApi

UPLOAD_NICENESS = 10
"""About a tenth of a core under full load (CFS weights of nice 10 against nice 0)."""
PUSH_ATTEMPTS = 3
"""Attempts per push; waits of 2, 4 s between them, on top of huggingface_hub's own retries."""


def describe(err: Exception, token: str | None) -> str:
    """A one-line description of ``err`` that never contains the token."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.replace(token, "***") if token else text


def is_auth_error(err: Exception) -> bool:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None) in (401, 403)


def push(api: HfApi, repo_id: str, revision: str | None, job: dict, token: str) -> dict:
    status = {"push": job["push"], "message": job["message"]}
    operations = [CommitOperationAdd(path_in_repo, local_path) for path_in_repo, local_path in job["files"]]
    for attempt in range(1, PUSH_ATTEMPTS + 1):
        try:
            commit = api.create_commit(repo_id, operations=operations, commit_message=job["message"],
                                       revision=revision)
            status["commit_id"] = commit.oid
            status["seconds_after_save"] = round(time.time() - job["saved_at"], 2)
            break
        except Exception as err:  # network, HTTP, quota: record and go on, training must not stop
            status["error"] = describe(err, token)
            if is_auth_error(err) or attempt == PUSH_ATTEMPTS:
                break
            time.sleep(2**attempt)
    if job["stage"]:
        _remove_older_stages(job["stage"])
    if "commit_id" in status:
        status.pop("error", None)
        if job["stage"]:
            shutil.rmtree(job["stage"], ignore_errors=True)
    else:
        where = job["stage"] or "the output folder"
        print(f"warning: hub push '{job['message']}' to {repo_id} failed after {attempt} attempt(s): "
              f"{status['error']}. The local copy in {where} is kept until a later push is done; push it with "
              f"`hf upload {repo_id} <folder>`.", file=sys.stderr, flush=True)
    return status


def _remove_older_stages(stage: str) -> None:
    """Staging copies of earlier steps than ``stage``'s: superseded by this push, and never retried."""
    step = int(os.path.basename(stage).removeprefix("step_"))
    staging = os.path.dirname(stage)
    for name in os.listdir(staging):
        if name.startswith("step_") and name.removeprefix("step_").isdigit() and int(name[5:]) < step:
            shutil.rmtree(os.path.join(staging, name), ignore_errors=True)


def main() -> None:
    if hasattr(os, "nice"):
        os.nice(UPLOAD_NICENESS)
    repo_id, revision = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    token = os.environ.get("HF_TOKEN") or None
    api = HfApi(token=token)
    for line in sys.stdin:
        print(json.dumps(push(api, repo_id, revision, json.loads(line), token)), flush=True)


if __name__ == "__main__":
    main()
