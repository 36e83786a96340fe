"""The run's folder (job.dump_folder) must exist and take files before anything is built: every rank
checks it itself (no torch), so a folder that cannot be written stops all of them with one line,
before launch (preflight) and before any collective, instead of one rank failing and the rest hanging."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from titanlite.errors import ConfigError


def check_writable_folder(folder: str, key: str = "job.dump_folder") -> None:
    """Create `folder` (and its parents) and write and remove a probe file in it; ConfigError naming
    the key, the folder and the reason when that fails."""
    path = Path(folder).expanduser()
    probe = path / f".titanlite-write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        where = f": {e.filename}" if e.filename and str(e.filename) != str(probe) else ""
        raise ConfigError(
            f"{key}='{folder}' cannot be created or written ({e.strerror or e}{where}); choose a folder you can "
            "write, e.g. --job.dump_folder ./outputs/run"
        ) from None
