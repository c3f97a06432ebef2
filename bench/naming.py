"""Default names of benchmark results: <results dir>/YYYY-MM-DD-<device>-<commit>-<what>[.ext].

The results dir is $OUT when set, else ./bench-results under the working directory (which git ignores): a run
adds nothing to the repository unless told to. The date is today's, the commit the checked-out short hash, the
device a short tag of the hardware ("h100", "cpu"). Results people commit go under bench/results/ with the same
names, carrying the date and short commit of the commit that adds them.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def device_tag(device: str) -> str:
    """'cpu' for a CPU; for a CUDA device its model number, lower case ('NVIDIA H100 80GB HBM3' -> 'h100')."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    found = re.search(r"[a-z]*\d+[a-z]*", name)
    return found.group(0) if found else "cuda"


def short_commit() -> str:
    git = ["git", "rev-parse", "--short=7", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, check=False, cwd=ROOT).stdout.strip() or "nogit"


def results_dir() -> Path:
    """$OUT, else bench-results/ under the working directory."""
    return Path(os.environ.get("OUT") or "bench-results")


def results_path(what: str, device: str, ext: str = "jsonl") -> str:
    """<results dir>/<today>-<device tag>-<commit>-<what>[.ext]."""
    name = f"{datetime.date.today().isoformat()}-{device_tag(device)}-{short_commit()}-{what}"
    return str(results_dir() / (f"{name}.{ext}" if ext else name))
