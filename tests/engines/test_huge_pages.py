"""engines/huge_pages.py: importing collab_app before torch puts torch's large CPU tensors in
transparent huge pages (torch's allocator, THP_MEM_ALLOC_ENABLE), a value in the environment
wins, and the log line says how much memory sits in them. Each case in a fresh interpreter: torch
reads the variable once per process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collab_app.engines import huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODE = re.search(r"\[(\w+)\]", THP_MODE.read_text()).group(1) if THP_MODE.exists() else None
pytestmark = pytest.mark.skipif(MODE in (None, "never"), reason=f"no transparent huge pages here (mode {MODE})")

PROBE = """
import sys
import collab_app   # first, as our entry points do
import torch
t = torch.ones(64 << 18)   # 64 MiB, every page written
ptr, huge = t.data_ptr(), None
for line in open("/proc/self/smaps"):
    first = line.split()
    if first and "-" in first[0] and not first[0].endswith(":"):
        lo, hi = (int(x, 16) for x in first[0].split("-"))
        inside = lo <= ptr < hi
    elif inside and first[0] == "AnonHugePages:":
        huge = int(first[1])
        break
import os
print(huge, os.environ.get("THP_MEM_ALLOC_ENABLE"))
"""


def probe(value: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != huge_pages.VAR}
    if value is not None:
        env[huge_pages.VAR] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    kb, seen = out.stdout.split()
    return int(kb), seen


def test_importing_collab_app_first_puts_large_tensors_in_huge_pages():
    kb, seen = probe(None)
    assert seen == "1"
    assert kb >= 60 * 1024, f"only {kb} kB of a 64 MiB tensor in huge pages"


@pytest.mark.skipif(MODE == "always", reason="THP mode 'always': every large mapping gets huge pages anyway")
def test_a_value_in_the_environment_wins():
    kb, seen = probe("0")
    assert seen == "0" and kb == 0


def test_the_log_line_reports_resident_memory_in_huge_pages():
    rss, huge = huge_pages.resident()
    assert rss > 0 and 0 <= huge <= rss
    assert re.fullmatch(r"\d+\.\d\d of \d+\.\d\d GiB resident in 2 MiB pages", huge_pages.summary())
