"""The pool's C core (allocator/_native.c): required, the pool's operations run in it
(docs/FORMAT.md "The core"); kvscope._sigbus and kvscope._kvevents are optional."""

import runpy
from pathlib import Path

from setuptools import Extension, setup

# The core's offsets and constants come from allocator/records.py (plain Python: this runs in
# pip's build environment, which may lack numpy), written as a header the core includes.
RECORDS = Path("allocator/records.py")
HEADER = Path("allocator/csrc/layout.h")
text = runpy.run_path(str(RECORDS))["c_header"]()
if not HEADER.exists() or HEADER.read_text() != text:
    HEADER.write_text(text)

setup(
    ext_modules=[
        Extension(
            "kvscope.allocator._native",
            ["allocator/_native.c"],
            # its parts (one translation unit: _native.c includes them)
            depends=[str(p) for p in Path("allocator/csrc").glob("*")] + [str(RECORDS)],
            extra_compile_args=["-O2", "-std=gnu11"],
            # devchecks.c looks libcuda's entry points up at run time (dlopen)
            libraries=["dl"],
        ),
        # `kvscope run` reading a pool file the script truncates (kvscope/csrc/sigbus.c)
        Extension(
            "kvscope._sigbus",
            ["kvscope/csrc/sigbus.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        # `kvscope events check`'s fast path (kvscope/csrc/kvevents.c)
        Extension(
            "kvscope._kvevents",
            ["kvscope/csrc/kvevents.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
    ]
)
