"""The upload process behind ``finetune.hub.pusher.HubPusher``: commits pushes to one Hub repository, in order.

Uploading encodes and hashes whole files. In a thread of the training process that work would hold
the GIL between training's kernel launches and take a core from it; in a process of its own at the
low CPU priority (nice 10) it takes little from training, yet still a share when training keeps every
core busy (at idle priority it would starve there, and a machine that died mid-run would leave nothing on
the Hub). It imports nothing but huggingface_hub and is run by path, so it starts in a fraction of a second.

Protocol: ``python finetune/hub/uploader.py REPO_ID TIMEOUT [REVISION]`` with the token in ``HF_TOKEN``. Each line on
stdin is a push: ``{"push": n, "message": ..., "files": [[path_in_repo, local_path], ...], "stage": ...,
"saved_at": ..., "keep": FOLDER or null}``; the commit also deletes every file in the repository that the push
does not hold, but ``.gitattributes`` and those under ``FOLDER/`` (the final model keeps the run's last checkpoint),
so the repository holds one model, never another run's or checkpoint's files beside it. Each line on
stdout is its outcome: the push number and message, ``commit_id`` and ``seconds_after_save`` (from the files
being complete on disk to the commit), ``superseded_by`` (a checkpoint's push skipped because a newer
checkpoint's was queued behind it), or ``error``. The process ends when stdin is
closed and every push is done, or TIMEOUT seconds after stdin closed, whichever comes first.

It ignores the stop signals (SIGTERM, SIGINT, SIGUSR1, SIGHUP) that schedulers and launchers send every process
of a job: a stopped run hands it its last checkpoint and may exit before that push is done. Once the run is gone
(its end of stdout closed), outcomes go to stderr, the run's log.

Staging copies (``.hub_staging/step_N``, hard links of a checkpoint) go once pushed or superseded; a failed one
stays for ``hf upload`` until a later push is done, so at most one failed copy is kept besides those queued. The
final model is pushed from a staging copy too (``.hub_staging/final_ID``, named for its run), so that a later run in
the folder, which may start once this run is gone, never changes a file under an unfinished push.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import sys
import threading
import time

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

UPLOAD_NICENESS = 10
"""About a tenth of a core under full load (CFS weights of nice 10 against nice 0)."""
PUSH_ATTEMPTS = 3
"""Attempts per push; waits of 2, 4 s between them, on top of huggingface_hub's own retries."""
IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
TIMED_OUT_EXIT_CODE = 124
"""The exit status once TIMEOUT has passed with pushes unfinished (``timeout``'s), which the run reads as such."""


def describe(err: Exception, token: str | None) -> str:
    """A one-line description of ``err`` that never contains the token."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.replace(token, "***") if token else text


def is_auth_error(err: Exception) -> bool:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None) in (401, 403)


def push(api: HfApi, repo_id: str, revision: str | None, job: dict, token: str) -> dict:
    status = {"push": job["push"], "message": job["message"]}
    adds = [CommitOperationAdd(path_in_repo, local_path) for path_in_repo, local_path in job["files"]]
    for attempt in range(1, PUSH_ATTEMPTS + 1):
        try:
            commit = api.create_commit(repo_id, operations=adds + _stale(api, repo_id, revision, job),
                                       commit_message=job["message"], revision=revision)
            status["commit_id"] = commit.oid
            status["seconds_after_save"] = round(time.time() - job["saved_at"], 2)
            break
        except Exception as err:  # network, HTTP, quota: record and go on, training must not stop
            status["error"] = describe(err, token)
            if is_auth_error(err) or attempt == PUSH_ATTEMPTS:
                break
            time.sleep(2**attempt)
    if _checkpoint_step(job["stage"]) is not None:
        _remove_older_stages(job["stage"])
    if "commit_id" in status:
        status.pop("error", None)
        if job["stage"]:
            shutil.rmtree(job["stage"], ignore_errors=True)
    else:
        where = job["stage"] or "the output folder"
        until = " until a later push is done" if _checkpoint_step(job["stage"]) is not None else ""
        print(f"warning: hub push '{job['message']}' to {repo_id} failed after {attempt} attempt(s): "
              f"{status['error']}. The local copy in {where} is kept{until}; push it with "
              f"`hf upload {repo_id} <folder>`.", file=sys.stderr, flush=True)
    return status


def _stale(api: HfApi, repo_id: str, revision: str | None, job: dict) -> list[CommitOperationDelete]:
    """Deletions of the repository's files that the push does not hold: pushes only add files, so an adapter pushed
    over a whole model (or a checkpoint written at another world size) would sit beside the other's leftovers,
    and ``from_pretrained`` may load those instead."""
    pushed = {path_in_repo for path_in_repo, _ in job["files"]}
    kept = (job["keep"] + "/",) if job.get("keep") else ()
    return [CommitOperationDelete(name) for name in api.list_repo_files(repo_id, revision=revision)
            if name not in pushed and name != ".gitattributes" and not name.startswith(kept)]


def _checkpoint_step(stage: str | None) -> int | None:
    """The step of a checkpoint's staging copy (``step_N``); None for the final model's, or no copy."""
    name = os.path.basename(stage or "")
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def _remove_older_stages(stage: str) -> None:
    """Staging copies of earlier steps than ``stage``'s: superseded by this push, and never retried."""
    step = _checkpoint_step(stage)
    staging = os.path.dirname(stage)
    for name in os.listdir(staging):
        older = _checkpoint_step(name)
        if older is not None and older < step:
            shutil.rmtree(os.path.join(staging, name), ignore_errors=True)


class Jobs:
    """The pushes queued on stdin, read by a thread as they come, so that a push about to start can be skipped
    when a newer checkpoint's is already queued behind it (a lagging upload sends only the newest checkpoint)."""

    def __init__(self, stream, timeout: float):
        self._queued: collections.deque[dict] = collections.deque()
        self._ended = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream, timeout), daemon=True).start()

    def _read(self, stream, timeout: float) -> None:
        for line in stream:
            try:
                job = json.loads(line)
            except ValueError:  # a line cut short: the run that wrote it is gone
                break
            with self._changed:
                self._queued.append(job)
                self._changed.notify()
        with self._changed:
            self._ended = True
            self._changed.notify()
        # Nothing else may end a process that ignores the stop signals once the run is gone.
        deadline = threading.Timer(timeout, os._exit, [TIMED_OUT_EXIT_CODE])
        deadline.daemon = True
        deadline.start()

    def __iter__(self):
        """Each job in order, with the newer checkpoint push queued behind it, if any (None for the final push)."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queued or self._ended)
                if not self._queued:
                    return
                job = self._queued.popleft()
                newer = (next((later for later in self._queued if _checkpoint_step(later["stage"]) is not None), None)
                         if _checkpoint_step(job["stage"]) is not None else None)
            yield job, newer


def report(status: dict, repo_id: str) -> None:
    """The outcome on stdout for the run, or, once the run is gone, on stderr for its log."""
    try:
        print(json.dumps(status), flush=True)
        return
    except OSError:  # the run's end of the pipe is closed: later outcomes (and this one's buffer) go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    outcome = (f"commit {status['commit_id']}" if "commit_id" in status else
               f"skipped for push {status['superseded_by']}" if "superseded_by" in status else "FAILED")
    print(f"hub push {status['push']} ({status['message']}) to {repo_id}, after the run ended: {outcome}",
          file=sys.stderr, flush=True)


def lower_priority() -> None:
    """Nice 10, for the process and, when it leads a session of its own, for that session's scheduling group:
    where Linux groups processes by session (autogroup), a nice value only ranks a process within its group,
    and a group of its own would share the CPU with training's group as an equal."""
    os.nice(UPLOAD_NICENESS)
    if os.getsid(0) == os.getpid() and os.path.exists("/proc/self/autogroup"):
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(UPLOAD_NICENESS))


def main() -> None:
    for number in IGNORED_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    lower_priority()
    repo_id, timeout = sys.argv[1], float(sys.argv[2])
    revision = sys.argv[3] if len(sys.argv) > 3 else None
    token = os.environ.get("HF_TOKEN") or None
    api = HfApi(token=token)
    for job, newer in Jobs(sys.stdin, timeout):
        if newer:
            shutil.rmtree(job["stage"], ignore_errors=True)
            report({"push": job["push"], "message": job["message"], "superseded_by": newer["push"]}, repo_id)
        else:
            report(push(api, repo_id, revision, job, token), repo_id)


if __name__ == "__main__":
    main()
