"""The console exporters' stderr (probes/otel_exporters.CONSOLE): each document whole, though
the exporters write from threads of their own and a document outgrows the pipe."""

import subprocess
import sys

SCRIPT = """
import threading
from kvscope.probes.otel_exporters import CONSOLE
docs = ["{\\n" + (f'  "{k}": 1,\\n' * 20000) + "}\\n" for k in "ab"]
def write(doc):
    for _ in range(10):
        CONSOLE.write(doc)
        CONSOLE.flush()
threads = [threading.Thread(target=write, args=(d,)) for d in docs]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_documents_written_from_two_threads_come_out_whole():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    docs = [d for d in r.stderr.split("}\n") if d.strip()]
    assert len(docs) == 20
    assert not [d for d in docs if '"a"' in d and '"b"' in d]
