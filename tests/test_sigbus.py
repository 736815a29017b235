"""kvscope._sigbus: a reader of a mapped pool file that another process cuts short reads zeros
instead of dying of SIGBUS (what `kvscope run`'s supervisor relies on)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

_sigbus = pytest.importorskip("kvscope._sigbus", reason="built without a C compiler")

READER = """
import mmap, os, sys, tempfile
import numpy as np
from kvscope import _sigbus
fd, path = tempfile.mkstemp()
os.unlink(path)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ)
data = np.frombuffer(mm, np.uint8)
if sys.argv[1] == "guarded":
    assert _sigbus.guard(data.ctypes.data, 1 << 20)
os.ftruncate(fd, 4096)  # the file loses all but its first page
print(int(data.sum()), _sigbus.hits())
"""


@pytest.mark.parametrize("how", ["guarded", "unguarded"])
def test_a_read_of_pages_the_file_lost(how):
    # GIVEN a 1 MiB file mapped read-only, WHEN it is cut to one page and the mapping read
    done = subprocess.run(
        [sys.executable, "-c", READER, how], capture_output=True, text=True, timeout=60
    )
    if how == "guarded":
        # THEN a guarded reader reads zeros for the 255 lost pages and goes on
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["0", "255"]
    else:
        # THEN an unguarded one dies of SIGBUS (why the guard exists)
        assert done.returncode == -signal.SIGBUS
