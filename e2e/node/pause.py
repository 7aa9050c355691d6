"""The pod sandbox ("pause") image of the real node, written as a docker-archive that containerd imports offline."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

#: the name containerd's CRI plugin is told to use as sandbox_image
PAUSE_IMAGE = "naiad.e2e/pause:1"


def _layer(binary: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        data = binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_pause_archive(binary: Path, out: Path, name: str = PAUSE_IMAGE) -> Path:
    """Write a one-layer image holding the static ``pause`` binary (tools/go/e2e-node) as a docker-archive."""
    layer = _layer(binary)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": "e2e/node/pause.py"}],
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for member, data in (("layer.tar", layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out
