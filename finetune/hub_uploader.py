"""The upload process behind ``finetune.hub.HubPusher``: commits pushes to one Hub repository, in order.

Uploading encodes and hashes whole files. In a thread of the training process that work would hold
the GIL between training's kernel launches and take a core from it; in a process of its own at the
lowest CPU priority it only uses what training leaves idle. It imports nothing but huggingface_hub
and is run by path, so it starts in a fraction of a second.

Protocol: ``python hub_uploader.py REPO_ID [REVISION]`` with the token in ``HF_TOKEN``. Each line on
stdin is a push: ``{"push": n, "message": ..., "files": [[path_in_repo, local_path], ...], "stage": ...}``.
Each line on stdout is its outcome: the push number and message, and ``commit_id`` or ``error``. The
process ends when stdin is closed and every push is done.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from huggingface_hub import CommitOperationAdd, HfApi

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
            break
        except Exception as err:  # network, HTTP, quota: record and go on, training must not stop
            status["error"] = describe(err, token)
            if is_auth_error(err) or attempt == PUSH_ATTEMPTS:
                break
            time.sleep(2**attempt)
    if "commit_id" in status:
        status.pop("error", None)
        if job["stage"]:
            shutil.rmtree(job["stage"], ignore_errors=True)
    else:
        where = job["stage"] or "the output folder"
        print(f"warning: hub push '{job['message']}' to {repo_id} failed after {attempt} attempt(s): "
              f"{status['error']}. The local copy in {where} is intact; push it later with "
              f"`hf upload {repo_id} <folder>`.", file=sys.stderr, flush=True)
    return status


def lowest_cpu_priority() -> None:
    """Run only on CPU time nothing else wants: SCHED_IDLE where Linux offers it, else nice 19."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if hasattr(os, "nice"):
        os.nice(19)


def main() -> None:
    lowest_cpu_priority()
    repo_id, revision = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    token = os.environ.get("HF_TOKEN") or None
    api = HfApi(token=token)
    for line in sys.stdin:
        print(json.dumps(push(api, repo_id, revision, json.loads(line), token)), flush=True)


if __name__ == "__main__":
    main()
