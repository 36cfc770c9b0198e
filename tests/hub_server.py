"""A small Hugging Face Hub stand-in for tests: the HTTP endpoints ``huggingface_hub`` really calls.

Why a server and not mocks: ``hf_zero.hub.transfer`` is a thin layer over ``huggingface_hub``, so the
risk is in the wire protocol (which endpoint, which JSON field, which header), not in our
Python. Pointing the real client at this server through ``HF_ENDPOINT`` runs the real
request/response code on both sides of ``push``/``pull``/``from_pretrained``.

What it implements (model repos only, namespaced ids ``owner/name``):

- ``GET /api/agent-harnesses`` (a public registry the client reads for its user agent)
- ``GET /api/whoami-v2``, ``POST /api/validate-yaml``, ``POST /api/repos/create``
- ``GET /api/models/{repo}`` and ``.../revision/{rev}`` (repo info, ``siblings``, ``blobs=true``)
- ``POST /api/models/{repo}/branch/{branch}``
- ``POST /api/models/{repo}/preupload/{rev}`` (regular vs LFS, decided by the repo's
  ``.gitattributes`` as on the Hub, and the remote oid so unchanged files are skipped)
- ``POST /{repo}.git/info/lfs/objects/batch`` (basic transfer: a one-time upload URL on this
  server, like a pre-signed S3 URL, so the PUT carries no token) and the verify callback
- ``POST /api/models/{repo}/commit/{rev}`` (NDJSON: header, file, lfsFile, deletedFile,
  deletedFolder; ``create_pr=1`` opens ``refs/pr/N``)
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``recursive``; paginated by a ``Link`` header
  after ``page_size`` entries, so the client's pagination is exercised)
- ``GET``/``HEAD /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` (the git blob
  id), ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, ``Content-Length`` and byte ranges.

Every request except the one-time LFS upload and the public registry must carry
``Authorization: Bearer <token>``; others are answered 401.
Anything else is recorded in ``unknown_calls`` and answered 501, so the fixture can fail the
test: a client that starts calling an endpoint we do not model should be noticed, not silently
see a 404. The 404s the client reads as signals are answered the Hub's way, with
``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

# The Hub stores a fresh repo with a .gitattributes that routes binary formats to LFS;
# this is our own short version of that idea (the patterns the tests need, and a few more).
INITIAL_GITATTRIBUTES = (
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pt filter=lfs diff=lfs merge=lfs -text\n"
    b"*.gguf filter=lfs diff=lfs merge=lfs -text\n"
)
LFS_SIZE_THRESHOLD = 10 * 2**20  # larger files go to LFS whatever their name
_REPO = r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)"


def git_blob_oid(data: bytes) -> str:
    """The id git gives a blob: sha1 of ``blob <size>\\0<data>``; the Hub's ETag for regular files."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The text git stores in place of an LFS file; its blob id is the file's git oid."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class Entry:
    """One file of a commit: inline bytes (regular) or a reference into the LFS store."""

    size: int
    blob_oid: str
    content: bytes | None = None  # regular files
    lfs_sha256: str | None = None  # LFS files

    @property
    def is_lfs(self) -> bool:
        return self.lfs_sha256 is not None


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    files: dict[str, Entry]
    date: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    created: str
    refs: dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    next_pr: int = 1


class ErrorReply(Exception):
    """An error answered the Hub's way: status plus ``X-Error-Code`` / ``X-Error-Message`` headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class HubServer:
    """The state and routing of the fake Hub; ``start()`` serves it on 127.0.0.1 on a free port."""

    def __init__(self, token: str, user: str = "user", page_size: int = 5):
        self.token, self.user, self.page_size = token, user, page_size
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.pending_uploads: dict[str, tuple[str, int]] = {}  # one-time upload id -> (sha256, size)
        self.unknown_calls: list[str] = []
        self.requests: list[tuple[str, str, bool, int]] = []  # (method, path, authorised, status)
        self.bodies: list[bytes] = []  # every request body, so a test can look for what was sent
        self._lock = threading.RLock()
        self._counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        self._routes = [
            ("GET", re.compile(r"/api/agent-harnesses"), self._agent_harnesses),
            ("GET", re.compile(r"/api/whoami-v2"), self._whoami),
            ("POST", re.compile(r"/api/validate-yaml"), self._validate_yaml),
            ("POST", re.compile(r"/api/repos/create"), self._create_repo),
            ("GET", re.compile(rf"/api/models/{_REPO}"), self._repo_info),
            ("GET", re.compile(rf"/api/models/{_REPO}/revision/(?P<rev>[^/]+)"), self._repo_info),
            ("POST", re.compile(rf"/api/models/{_REPO}/branch/(?P<branch>.+)"), self._create_branch),
            ("POST", re.compile(rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)"), self._preupload),
            ("POST", re.compile(rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)"), self._commit),
            ("GET", re.compile(rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?"), self._tree),
            ("POST", re.compile(rf"/{_REPO}\.git/info/lfs/objects/batch"), self._lfs_batch),
            ("POST", re.compile(rf"/{_REPO}\.git/info/lfs/objects/verify"), self._lfs_verify),
            ("PUT", re.compile(r"/lfs-upload/(?P<upload>[0-9a-f]+)"), self._lfs_put),
            ("GET", re.compile(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), self._resolve),
            ("HEAD", re.compile(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), self._resolve),
        ]
        # answered without a token: the one-time LFS upload URL is its own credential (like a
        # pre-signed S3 URL, which the client PUTs to without Authorization), the registry is public
        self.public = (self._lfs_put, self._agent_harnesses)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    # ------------------------------------------------------------------ helpers

    def route(self, method: str, raw_path: str) -> tuple[Any, dict[str, str]] | None:
        for m, pattern, handler in self._routes:
            match = pattern.fullmatch(raw_path)
            if m == method and match:
                return handler, {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        return None

    def _now(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())

    def _new_oid(self, *parts: str) -> str:
        with self._lock:
            self._counter += 1
            return hashlib.sha1("\x00".join((str(self._counter), *parts)).encode()).hexdigest()

    def _repo(self, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise ErrorReply(404, "Repository not found", "RepoNotFound")
        return repo

    def _resolve_rev(self, repo: Repo, rev: str) -> Commit:
        oid = repo.refs.get(rev)
        if oid is None and re.fullmatch(r"[0-9a-f]{40}", rev):
            oid = rev if rev in repo.commits else None
        if oid is None:
            raise ErrorReply(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.commits[oid]

    def _entry_json(self, path: str, entry: Entry) -> dict[str, Any]:
        item: dict[str, Any] = {"type": "file", "oid": entry.blob_oid, "size": entry.size, "path": path}
        if entry.is_lfs:
            pointer = lfs_pointer(entry.lfs_sha256 or "", entry.size)
            item["lfs"] = {"oid": entry.lfs_sha256, "size": entry.size, "pointerSize": len(pointer)}
        return item

    def _is_lfs(self, commit: Commit, path: str, size: int, sample: bytes) -> bool:
        attributes = commit.files.get(".gitattributes")
        text = attributes.content.decode() if attributes and attributes.content else ""
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and "filter=lfs" in parts[1:]:
                target = path if "/" in parts[0] else path.rsplit("/", 1)[-1]
                if fnmatch.fnmatchcase(target, parts[0]):
                    return True
        return size >= LFS_SIZE_THRESHOLD or b"\x00" in sample

    # ------------------------------------------------------------------ endpoints
    # Each takes (request, params) and returns (status, body, headers); body is bytes, a JSON-able
    # value, or None. Request holds method, query, headers and body.

    def _agent_harnesses(self, req: Request, p: dict) -> tuple:
        # huggingface_hub fetches this public registry (no token) to name AI agents in its
        # user agent, unless HF_HUB_DISABLE_TELEMETRY is set; an empty registry detects none.
        return 200, {"standardEnvVars": [], "harnesses": {}}, {}

    def _whoami(self, req: Request, p: dict) -> tuple:
        return 200, {"type": "user", "name": self.user, "orgs": [], "auth": {"type": "access_token"}}, {}

    def _validate_yaml(self, req: Request, p: dict) -> tuple:
        import yaml

        content = req.json()["content"]
        match = re.match(r"^---\s*\n(.*?)\n---\s*\n", content, re.S)
        if match:
            try:
                meta = yaml.safe_load(match.group(1))
            except yaml.YAMLError as e:
                return 400, {"errors": [{"message": f"invalid YAML: {e}"}], "warnings": []}, {}
            if meta is not None and not isinstance(meta, dict):
                return 400, {"errors": [{"message": "metadata must be a mapping"}], "warnings": []}, {}
        return 200, {"errors": [], "warnings": []}, {}

    def _create_repo(self, req: Request, p: dict) -> tuple:
        body = req.json()
        if body.get("type", "model") != "model":
            raise ErrorReply(400, "this test server only hosts model repos")
        repo_id = f"{body.get('organization') or self.user}/{body['name']}"
        url = f"{self.url}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": url}, {}
            now = self._now()
            repo = Repo(repo_id, private=body.get("visibility") == "private", created=now)
            data = INITIAL_GITATTRIBUTES
            first = Commit(
                self._new_oid(repo_id, "initial"),
                None,
                "initial commit",
                {".gitattributes": Entry(len(data), git_blob_oid(data), content=data)},
                now,
            )
            repo.commits[first.oid] = first
            repo.refs["main"] = first.oid
            self.repos[repo_id] = repo
        return 200, {"url": url, "name": repo_id, "id": first.oid}, {}

    def _repo_info(self, req: Request, p: dict) -> tuple:
        repo = self._repo(p["repo"])
        commit = self._resolve_rev(repo, p.get("rev", "main"))
        blobs = req.query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path, entry in sorted(commit.files.items()):
            item: dict[str, Any] = {"rfilename": path}
            if blobs:
                item.update(size=entry.size, blobId=entry.blob_oid)
                if entry.is_lfs:
                    item["lfs"] = {
                        "sha256": entry.lfs_sha256,
                        "size": entry.size,
                        "pointerSize": len(lfs_pointer(entry.lfs_sha256 or "", entry.size)),
                    }
            siblings.append(item)
        owner = repo.repo_id.split("/")[0]
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": owner,
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": repo.created,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        return 200, info, {}

    def _create_branch(self, req: Request, p: dict) -> tuple:
        repo = self._repo(p["repo"])
        start = (req.json() if req.body else {}).get("startingPoint") or "main"
        with self._lock:
            if p["branch"] in repo.refs:
                raise ErrorReply(409, f"Reference already exists: {p['branch']}")
            repo.refs[p["branch"]] = self._resolve_rev(repo, start).oid
        return 200, {}, {}

    def _preupload(self, req: Request, p: dict) -> tuple:
        repo = self._repo(p["repo"])
        commit = self._resolve_rev(repo, p["rev"])
        files = []
        for f in req.json()["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = self._is_lfs(commit, f["path"], int(f["size"]), sample)
            existing = commit.files.get(f["path"])
            oid = None
            if existing is not None:
                oid = existing.lfs_sha256 if existing.is_lfs else existing.blob_oid
            files.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": oid,
                }
            )
        return 200, {"files": files, "commitOid": commit.oid}, {}

    def _lfs_batch(self, req: Request, p: dict) -> tuple:
        repo = self._repo(p["repo"])
        body = req.json()
        if body.get("operation") != "upload" or "basic" not in body.get("transfers", ["basic"]):
            raise ErrorReply(400, "only basic LFS uploads are supported here")
        objects = []
        for obj in body["objects"]:
            oid, size = obj["oid"], int(obj["size"])
            item: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.lfs_objects:  # already stored: no actions, the client skips it
                upload = secrets.token_hex(16)
                with self._lock:
                    self.pending_uploads[upload] = (oid, size)
                item["actions"] = {
                    "upload": {"href": f"{self.url}/lfs-upload/{upload}"},
                    "verify": {"href": f"{self.url}/{repo.repo_id}.git/info/lfs/objects/verify"},
                }
            objects.append(item)
        return (
            200,
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            {"Content-Type": "application/vnd.git-lfs+json"},
        )

    def _lfs_put(self, req: Request, p: dict) -> tuple:
        with self._lock:
            expected = self.pending_uploads.pop(p["upload"], None)
        if expected is None:
            raise ErrorReply(403, "unknown or already used upload URL")
        oid, size = expected
        if len(req.body) != size or hashlib.sha256(req.body).hexdigest() != oid:
            raise ErrorReply(400, f"uploaded bytes do not match oid {oid} / size {size}")
        with self._lock:
            self.lfs_objects[oid] = req.body
        return 200, b"", {"ETag": f'"{oid}"'}

    def _lfs_verify(self, req: Request, p: dict) -> tuple:
        self._repo(p["repo"])
        body = req.json()
        data = self.lfs_objects.get(body["oid"])
        if data is None or len(data) != int(body["size"]):
            raise ErrorReply(404, f"LFS object {body['oid']} was not uploaded")
        return 200, {}, {}

    def _commit(self, req: Request, p: dict) -> tuple:
        repo = self._repo(p["repo"])
        create_pr = req.query.get("create_pr") == "1"
        lines = [json.loads(line) for line in req.body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise ErrorReply(400, "a commit starts with a header line")
        header = lines[0]["value"]
        with self._lock:
            base = self._resolve_rev(repo, p["rev"])
            if header.get("parentCommit") and not base.oid.startswith(header["parentCommit"]):
                raise ErrorReply(412, "parentCommit is not the head of the revision")
            files = dict(base.files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                path = value.get("path", "")
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise ErrorReply(400, f"unsupported encoding {value.get('encoding')!r}")
                    data = base64.b64decode(value["content"])
                    files[path] = Entry(len(data), git_blob_oid(data), content=data)
                elif key == "lfsFile":
                    data = self.lfs_objects.get(value["oid"])
                    if data is None or ("size" in value and int(value["size"]) != len(data)):
                        raise ErrorReply(400, f"LFS object {value['oid']} for {path} was not uploaded")
                    pointer = lfs_pointer(value["oid"], len(data))
                    files[path] = Entry(len(data), git_blob_oid(pointer), lfs_sha256=value["oid"])
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise ErrorReply(404, "A file with this name doesn't exist", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    files = {k: v for k, v in files.items() if not k.startswith(prefix)}
                else:
                    self.unknown_calls.append(f"commit line with key {key!r}")
                    raise ErrorReply(400, f"hub_server does not know commit line key {key!r}")
            commit = Commit(
                self._new_oid(repo.repo_id, base.oid, header.get("summary", "")),
                base.oid,
                header.get("summary", ""),
                files,
                self._now(),
            )
            repo.commits[commit.oid] = commit
            pr_url = None
            if create_pr:
                number, repo.next_pr = repo.next_pr, repo.next_pr + 1
                repo.refs[f"refs/pr/{number}"] = commit.oid
                pr_url = f"{self.url}/{repo.repo_id}/discussions/{number}"
            else:
                ref = p["rev"] if p["rev"] in repo.refs else None
                if ref is None:
                    raise ErrorReply(400, f"cannot commit onto {p['rev']!r}: not a branch")
                repo.refs[ref] = commit.oid
        return (
            200,
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": f"{self.url}/{repo.repo_id}/commit/{commit.oid}",
                "pullRequestUrl": pr_url,
            },
            {},
        )

    def _tree(self, req: Request, p: dict) -> tuple:
        repo = self._repo(p["repo"])
        commit = self._resolve_rev(repo, p["rev"])
        base = p.get("path", "").strip("/")
        recursive = req.query.get("recursive", "").lower() in ("1", "true")
        prefix = base + "/" if base else ""
        if base and base in commit.files:
            raise ErrorReply(400, f"{base} is a file, not a folder")
        below = {k: v for k, v in commit.files.items() if k.startswith(prefix)}
        if base and not below:
            raise ErrorReply(
                404, f"{base} does not exist on {p['rev']}", "EntryNotFound", {"X-Repo-Commit": commit.oid}
            )
        folders: set[str] = set()
        items: list[dict[str, Any]] = []
        for path, entry in below.items():
            rest = path[len(prefix) :].split("/")
            for depth in range(1, len(rest)):
                if depth == 1 or recursive:
                    folders.add(prefix + "/".join(rest[:depth]))
            if len(rest) == 1 or recursive:
                items.append(self._entry_json(path, entry))
        for folder in folders:
            items.append(
                {"type": "directory", "oid": git_blob_oid(folder.encode()), "size": 0, "path": folder}
            )
        items.sort(key=lambda i: i["path"])
        cursor = int(req.query.get("cursor", "0"))
        page = items[cursor : cursor + self.page_size]
        headers = {}
        if cursor + self.page_size < len(items):
            query = "&".join(f"{k}={quote(v)}" for k, v in req.query.items() if k != "cursor")
            headers["Link"] = f'<{self.url}{req.path}?{query}&cursor={cursor + self.page_size}>; rel="next"'
        return 200, page, headers

    def _resolve(self, req: Request, p: dict) -> tuple:
        repo = self._repo(p["repo"])
        commit = self._resolve_rev(repo, p["rev"])
        entry = commit.files.get(p["path"])
        if entry is None:
            raise ErrorReply(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        data = self.lfs_objects[entry.lfs_sha256] if entry.is_lfs else entry.content or b""
        headers = {
            "X-Repo-Commit": commit.oid,
            "ETag": f'"{entry.blob_oid}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if entry.is_lfs:
            headers["X-Linked-Etag"] = f'"{entry.lfs_sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
        status = 200
        byte_range = re.fullmatch(r"bytes=(\d+)-(\d*)", req.headers.get("Range", ""))
        if byte_range and req.method == "GET":
            start = int(byte_range.group(1))
            end = int(byte_range.group(2)) if byte_range.group(2) else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        return status, data, headers


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: Any
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    hub: HubServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: pytest shows failures, not traffic
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        hub = self.hub
        split = urlsplit(self.path)
        body = self._read_body()
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        req = Request(self.command, split.path, query, self.headers, body)
        found = hub.route(self.command, split.path)
        authorised = self.headers.get("Authorization") == f"Bearer {hub.token}"
        headers: dict[str, str] = {}
        try:
            if found is None:
                hub.unknown_calls.append(f"{self.command} {self.path}")
                raise ErrorReply(501, f"hub_server does not implement {self.command} {split.path}")
            handler, params = found
            if handler not in hub.public and not authorised:
                raise ErrorReply(401, "Invalid credentials in Authorization header")
            status, payload, headers = handler(req, params)
        except ErrorReply as e:
            status, payload, headers = e.status, {"error": e.message}, dict(e.headers)
            headers["X-Error-Message"] = e.message
            if e.code:
                headers["X-Error-Code"] = e.code
        except Exception as e:  # a bug in this server: make it loud in the test, not a hang
            hub.unknown_calls.append(f"server error on {self.command} {self.path}: {e!r}")
            status, payload = 500, {"error": repr(e)}
        with hub._lock:
            hub.requests.append((self.command, split.path, authorised, status))
            hub.bodies.append(body)
        if isinstance(payload, bytes):
            data = payload
        else:
            data = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = do_PATCH = _handle
