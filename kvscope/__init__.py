"""kvscope: a debugging and observability harness around a paged, shared-memory KV-cache pool."""

import os as _os

__version__ = "0.1.0"

# Under `kvscope run` every process of the run inherits KVSCOPE_RUN_DIR, and a process cannot
# open a pool without importing kvscope first: this is how children the script starts with
# spawn, forkserver or subprocess get the probes (kvscope/child.py). Nothing happens elsewhere.
if _os.path.isdir(_os.environ.get("KVSCOPE_RUN_DIR", "")):
    from kvscope.child import install as _install

    _install()
