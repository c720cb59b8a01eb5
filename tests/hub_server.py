"""A Hub-compatible HTTP server on loopback, for the Hub-push tests.

It answers the endpoints the real ``huggingface_hub`` client calls to create a repository, commit
files (every file ``regular``: base64 inside the commit, so neither Xet nor LFS is needed) and download
them (``from_pretrained``, ``snapshot_download``). Repositories live in memory. ``faults`` injects
failures: HTTP errors, dropped connections and stalls, for requests whose path contains a given text.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Fault:
    path_contains: str
    action: str  # an HTTP status ("500", "401", ...), "drop" (close without answering) or "stall"
    times: int = 1
    seconds: float = 0.0


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files at that commit
    branches: dict[str, str] = field(default_factory=dict)  # name -> sha
    history: list[dict] = field(default_factory=list)


class HubServer:
    """``with HubServer(tokens={"tok": "alice"}) as hub: ... hub.url ...``"""

    def __init__(self, tokens: dict[str, str], read_only_tokens: frozenset[str] = frozenset()):
        self.tokens = tokens
        self.read_only_tokens = read_only_tokens
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, str]] = []  # method, path, Authorization header
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                server.handle(self, "GET")

            def do_HEAD(self):
                server.handle(self, "HEAD")

            def do_POST(self):
                server.handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- what tests inspect --------------------------------------------------------------------------
    def commits(self, repo_id: str) -> list[dict]:
        return self.repos[repo_id].history if repo_id in self.repos else []

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[repo.branches[branch]]

    # -- request handling ----------------------------------------------------------------------------
    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(request.path)
        path = unquote(url.path)
        body = b""
        if method == "POST":
            body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        auth = request.headers.get("Authorization", "")
        with self.lock:
            self.requests.append((method, path, auth))
            fault = next((f for f in self.faults if f.times > 0 and f.path_contains in path), None)
            if fault:
                fault.times -= 1
        if fault:
            if fault.action == "drop":
                request.close_connection = True
                request.connection.close()
                return
            if fault.action == "stall":
                time.sleep(fault.seconds)
            else:
                return self.error(request, int(fault.action), "InjectedFault", f"injected {fault.action}")
        try:
            self.route(request, method, path, parse_qs(url.query), body, auth)
        except BrokenPipeError:
            pass

    def user(self, auth: str) -> str | None:
        return self.tokens.get(auth.removeprefix("Bearer ").strip())

    def route(self, request, method, path, query, body, auth):
        user = self.user(auth)
        if path == "/api/whoami-v2":
            if not user:
                return self.error(request, 401, "Unauthorized", "Invalid credentials in Authorization header")
            return self.json(request, {"name": user, "orgs": [], "type": "user"})
        if path == "/api/validate-yaml":
            return self.json(request, {"errors": [], "warnings": []})
        if path == "/api/agent-harnesses":
            return self.json(request, {"standardEnvVars": [], "harnesses": {}})
        if path == "/api/repos/create" and method == "POST":
            return self.create_repo(request, json.loads(body or b"{}"), auth, user)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/(.+)", path):
            return self.create_branch(request, m.group(1), m.group(2), auth, user)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/(.+)", path):
            return self.preupload(request, m.group(1), m.group(2), json.loads(body))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/(.+)", path):
            return self.commit(request, m.group(1), m.group(2), body, auth, user)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
            return self.tree(request, m.group(1), m.group(2), (m.group(3) or "").strip("/"))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path):
            return self.model_info(request, m.group(1), m.group(2) or "main")
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self.resolve(request, method, m.group(1), m.group(2), m.group(3))
        return self.error(request, 404, "EntryNotFound", f"no route for {path}")

    def writable(self, auth: str, user: str | None, repo_id: str) -> bool:
        token = auth.removeprefix("Bearer ").strip()
        return user is not None and token not in self.read_only_tokens and repo_id.split("/")[0] == user

    def create_repo(self, request, payload, auth, user):
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        if not user:
            return self.error(request, 401, "Unauthorized", "Invalid credentials in Authorization header")
        if not self.writable(auth, user, repo_id):
            return self.error(request, 403, "Forbidden", f"You don't have the rights to create a model under {repo_id}")
        url = {"url": f"{self.url}/{repo_id}"}
        if repo_id in self.repos:
            return self.json(request, {**url, "error": "You already created this model repo"}, status=409)
        sha = uuid.uuid4().hex + "00000000"
        self.repos[repo_id] = Repo(commits={sha: {}}, branches={"main": sha})
        return self.json(request, url)

    def create_branch(self, request, repo_id, branch, auth, user):
        if repo_id not in self.repos:
            return self.error(request, 404, "RepoNotFound", f"Repository {repo_id} not found")
        if not self.writable(auth, user, repo_id):
            return self.error(request, 403, "Forbidden", "no write access")
        repo = self.repos[repo_id]
        if branch in repo.branches:
            return self.error(request, 409, "BranchExists", "Reference already exists")
        repo.branches[branch] = repo.branches["main"]
        return self.json(request, {})

    def lookup(self, request, repo_id, revision):
        repo = self.repos.get(repo_id)
        if repo is None:
            self.error(request, 404, "RepoNotFound", f"Repository {repo_id} not found")
            return None, None
        sha = repo.branches.get(revision, revision if revision in repo.commits else None)
        if sha is None:
            self.error(request, 404, "RevisionNotFound", f"Revision {revision} not found")
        return repo, sha

    def model_info(self, request, repo_id, revision):
        repo, sha = self.lookup(request, repo_id, revision)
        if sha:
            files = repo.commits[sha]
            siblings = [{"rfilename": p, "size": len(d), "blobId": git_sha1(d)} for p, d in sorted(files.items())]
            self.json(request, {"id": repo_id, "modelId": repo_id, "sha": sha, "siblings": siblings,
                                "private": False})

    def tree(self, request, repo_id, revision, prefix):
        repo, sha = self.lookup(request, repo_id, revision)
        if not sha:
            return
        files = repo.commits[sha]
        under = {p: d for p, d in files.items() if not prefix or p.startswith(prefix + "/")}
        if prefix and not under:
            return self.error(request, 404, "EntryNotFound", f"{prefix} does not exist")
        entries, folders = [], set()
        for p, d in sorted(under.items()):
            entries.append({"type": "file", "path": p, "oid": git_sha1(d), "size": len(d)})
            parts = p.split("/")[:-1]
            folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        entries += [{"type": "directory", "path": f, "oid": git_sha1(f.encode())}
                    for f in sorted(folders) if not prefix or f.startswith(prefix + "/")]
        self.json(request, entries)

    def preupload(self, request, repo_id, revision, payload):
        repo, sha = self.lookup(request, repo_id, revision)
        if sha:
            stored = repo.commits[sha]
            self.json(request, {"files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                 **({"oid": git_sha1(stored[f["path"]])} if f["path"] in stored else {})}
                for f in payload["files"]]})

    def commit(self, request, repo_id, revision, body, auth, user):
        if not self.writable(auth, user, repo_id):
            return self.error(request, 401 if not user else 403, "Unauthorized", "no write access to this repo")
        repo, sha = self.lookup(request, repo_id, revision)
        if not sha:
            return
        files = dict(repo.commits[sha])
        summary = ""
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                summary = item["value"].get("summary", "")
            elif item["key"] == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] == "deletedFile":
                files.pop(item["value"]["path"], None)
        new_sha = hashlib.sha1(f"{sha}{summary}{time.time_ns()}".encode()).hexdigest()
        repo.commits[new_sha] = files
        repo.branches[revision] = new_sha
        repo.history.append({"sha": new_sha, "summary": summary, "branch": revision, "files": sorted(files),
                             "time": time.time()})
        self.json(request, {"commitOid": new_sha, "commitUrl": f"{self.url}/{repo_id}/commit/{new_sha}",
                            "pullRequestUrl": None})

    def resolve(self, request, method, repo_id, revision, file_path):
        repo, sha = self.lookup(request, repo_id, revision)
        if not sha:
            return
        data = repo.commits[sha].get(file_path)
        if data is None:
            return self.error(request, 404, "EntryNotFound", f"{file_path} does not exist")
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(len(data)))
        request.send_header("X-Repo-Commit", sha)
        request.send_header("ETag", f'"{git_sha1(data)}"')
        request.end_headers()
        if method == "GET":
            request.wfile.write(data)

    # -- responses ----------------------------------------------------------------------------------
    def json(self, request, payload, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def error(self, request, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.send_header("X-Error-Code", code)
        request.send_header("X-Error-Message", message)
        request.end_headers()
        if request.command != "HEAD":
            request.wfile.write(data)
