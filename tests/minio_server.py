"""A real MinIO (built from its Go module by tools/go/build.sh) on 127.0.0.1, and a boto3 client for it."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import requests
from helpers import free_ports, go_tool, server_log_dir


class MinioServer:
    """`minio server` on a fresh data folder with its own root credentials; stop() removes everything."""

    def __init__(self):
        binary = go_tool("minio")
        if binary is None:
            raise RuntimeError("MinIO could not be built: run `bash tools/go/build.sh minio` to see why")
        self.binary = binary
        self.port, self.console_port = free_ports(2)
        self.access_key = "naiad-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.data = Path(tempfile.mkdtemp(prefix="naiad-minio-"))
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(server_log_dir()) / (self.data.name + ".log")  # (kept for this test process)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict:
        """What a client needs: the AWS SDK's variable names."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            **extra,
        }

    def start(self) -> MinioServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MINIO_"))} | {
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
            "HOME": str(self.data),
        }
        cmd = [
            str(self.binary),
            "server",
            str(self.data / "drive"),
            "--address",
            self.host,
            "--console-address",
            f"127.0.0.1:{self.console_port}",
            "--quiet",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minio exited with {self.proc.returncode}: {self.log_path.read_text()}")
            try:
                if requests.get(self.endpoint + "/minio/health/live", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"minio did not start in 60s: {self.log_path.read_text()}")

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )

    def upload_tree(self, client, bucket: str, prefix: str, folder: Path) -> None:
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)
