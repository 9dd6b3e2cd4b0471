"""A stand-in for the Hugging Face Hub's HTTP API, enough for `ferrum pull`: repo info
(`/api/models/{repo}/revision/{rev}`) and file resolution (`/{repo}/resolve/{rev}/{file}`,
with the `x-repo-commit`, `etag`/`x-linked-etag` and `Content-Range` headers and range
requests). Repos can be gated (Bearer token required), serve a corrupted file under the
right checksum, drop a download half-way once (to test resuming), or stall half-way for as
long as a file stays in `stall` (to kill the client mid-download)."""

import hashlib
import http.server
import json
import threading
import time


class Repo:
    def __init__(self, files, gated_token=None, corrupt=(), flaky=(), stall=()):
        self.files = files
        self.gated_token = gated_token
        self.corrupt = set(corrupt)
        self.flaky = set(flaky)
        self.stall = set(stall)
        self.sha = hashlib.sha1(json.dumps(sorted(files)).encode()).hexdigest()

    @staticmethod
    def etag(name, data):
        # Large (LFS) files carry their sha256; small ones the git blob sha1.
        if name.endswith((".gguf", ".safetensors")):
            return hashlib.sha256(data).hexdigest(), True
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), False


class Hub:
    def __init__(self, repos):
        self.repos = repos
        self.ranges = []  # (repo, file, start) of every ranged download
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send(self, code, body=b"", headers=()):
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def send_half(self, body, headers):
                """A 206 that promises `body` and sends half of it; the connection then ends."""
                self.send_response(206)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True

            def repo(self, repo_id):
                r = hub.repos.get(repo_id)
                if r is None:
                    self.send(404, b'{"error": "Repository not found"}')
                    return None
                if r.gated_token and self.headers.get("Authorization") != f"Bearer {r.gated_token}":
                    self.send(401, b'{"error": "Access to this model is restricted"}')
                    return None
                return r

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    repo_id = "/".join(parts[2:4])
                    r = self.repo(repo_id)
                    if r:
                        body = json.dumps({"id": repo_id, "sha": r.sha,
                                           "siblings": [{"rfilename": f} for f in r.files]}).encode()
                        self.send(200, body, [("Content-Type", "application/json")])
                    return
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, name = "/".join(parts[:2]), "/".join(parts[4:])
                    r = self.repo(repo_id)
                    if not r:
                        return
                    if name not in r.files:
                        self.send(404, b'{"error": "Entry not found"}')
                        return
                    data = r.files[name]
                    tag, lfs = Repo.etag(name, data)
                    if name in r.corrupt:
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                    start, end = 0, len(data) - 1
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes="):
                        a, _, b = rng[6:].partition("-")
                        start = int(a)
                        end = int(b) if b else end
                    headers = [("x-repo-commit", r.sha), ("etag", f'"{tag}"'),
                               ("Content-Range", f"bytes {start}-{end}/{len(data)}"),
                               ("Accept-Ranges", "bytes")]
                    if lfs:
                        headers.append(("x-linked-etag", f'"{tag}"'))
                    body = data[start:end + 1]
                    if rng and end > start:
                        hub.ranges.append((repo_id, name, start))
                    if name in r.stall and end > start:
                        # Promise everything, send half, then wait (at most a minute).
                        self.send_half(body, headers)
                        deadline = time.time() + 60
                        while name in r.stall and time.time() < deadline:
                            time.sleep(0.05)
                        return
                    if name in r.flaky and start == 0 and end > 0:
                        # Promise everything, send half, hang up: the client must resume.
                        r.flaky.discard(name)
                        self.send_half(body, headers)
                        return
                    self.send(206 if rng else 200, body, headers)
                    return
                self.send(404, b"{}")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # Clients hanging up (the client under test does, by design) are not errors here.
        self.server.handle_error = lambda request, address: None
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
