"""A real S3-protocol server for the tests: moto's standalone server on a free loopback port, reached
through a TCP relay that a test can cut (the endpoint gone mid-save) and restore.

``S3Server.start()`` sets what s3fs (and every rank the tests spawn, which inherit the environment)
needs to reach it — dummy credentials, the region, ``AWS_ENDPOINT_URL`` — and creates ``bucket``;
``stop()`` puts the environment back. A rank cuts the endpoint by creating the file named by
``LZ_TEST_S3_CUT`` and restores it by deleting that file: while it exists the relay closes every open
connection and refuses new ones, as a server that went away does.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from typing import Optional

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_MAX_ATTEMPTS": "2",  # an endpoint that went away fails a request in seconds, not minutes
    "AWS_RETRY_MODE": "standard",
}
CUT_ENV = "LZ_TEST_S3_CUT"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Relay:
    """Forwards TCP connections from a loopback port to ``target``; while ``cut_file`` exists, drops
    them all and refuses new ones."""

    def __init__(self, target: int, cut_file: str) -> None:
        self.target, self.cut_file = target, cut_file
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name="s3-relay").start()

    def cut(self) -> bool:
        return os.path.exists(self.cut_file)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self._stopped and not self.cut():
                ready, _, _ = select.select([a, b], [], [], 0.05)
                for source in ready:
                    data = source.recv(1 << 16)
                    if not data:
                        return
                    (b if source is a else a).sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {a, b}
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def stop(self) -> None:
        self._stopped = True
        self.listener.close()


class S3Server:
    def __init__(self, workdir: str, bucket: str = "bucket") -> None:
        self.bucket = bucket
        self.cut_file = os.path.join(workdir, "s3-endpoint-cut")
        self._server = None
        self._relay: Optional[_Relay] = None
        self._saved_env: dict[str, Optional[str]] = {}
        self.endpoint = ""

    def start(self) -> "S3Server":
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self._relay = _Relay(port, self.cut_file)
        self.endpoint = f"http://127.0.0.1:{self._relay.port}"
        env = {**ENV, "AWS_ENDPOINT_URL": self.endpoint, CUT_ENV: self.cut_file}
        for key, value in env.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._relay is not None:
            self._relay.stop()
        if self._server is not None:
            self._server.stop()

    def keys(self, prefix: str = "") -> list[str]:
        """Every key in the bucket under ``prefix`` (read by the test process, straight from the server)."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint)
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return sorted(keys)


def cut_endpoint() -> None:
    """(In a rank.) The endpoint goes away: open connections dropped, new ones refused."""
    open(os.environ[CUT_ENV], "w").close()


def restore_endpoint() -> None:
    try:
        os.remove(os.environ[CUT_ENV])
    except FileNotFoundError:
        pass
