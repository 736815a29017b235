"""The pool's C core (allocator/_native.c): optional, the pure-Python allocator does everything
without it (slower; docs/FORMAT.md "The native core")."""

from pathlib import Path

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvscope.allocator._native",
            ["allocator/_native.c"],
            # its parts (one translation unit: _native.c includes them)
            depends=[str(p) for p in Path("allocator/csrc").glob("*")],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        # `kvscope run` reading a pool file the script truncates (kvscope/csrc/sigbus.c)
        Extension(
            "kvscope._sigbus",
            ["kvscope/csrc/sigbus.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
    ]
)
