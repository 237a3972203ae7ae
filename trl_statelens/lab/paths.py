"""Where the lab is cached, and what it holds: no torch, so `statelens lab info` answers at once."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .world import LAB_VERSION


def lab_home() -> Path:
    """Where the lab is cached: ``$STATELENS_HOME/lab`` (default ``~/.cache/trl_statelens/lab``)."""
    root = os.environ.get("STATELENS_HOME") or Path.home() / ".cache" / "trl_statelens"
    return Path(root) / "lab"


def lab_dir(seed: int = 0) -> Path:
    """The lab of world version ``LAB_VERSION`` and ``seed``; labs of other versions stay where they are, unused."""
    return lab_home() / f"v{LAB_VERSION}" / f"seed{seed}"


def lab_info(seed: int = 0) -> dict | None:
    path = lab_dir(seed) / "info.json"
    return json.loads(path.read_text()) if path.exists() else None
