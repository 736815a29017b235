"""docs/ARCHITECTURE.md names real things: every file it names exists, every C function it places
in a file is defined there, every dotted Python name resolves to an attribute, and every other
name it sets in code type is in the sources (a Python identifier or word, a C function, macro
or enum constant, a method the core registers)."""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import re
from pathlib import Path

import pytest

from kvscope.allocator import KVPool, _native
from tests.sources import parsed

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# where a name the page gives without its folder lives: the repository, then each package
BASES = [
    ROOT,
    *(ROOT / d for d in ("allocator", "kvscope", "probes", "kernels", "tui", "examples", "docs")),
]
SOURCES = ("allocator", "kvscope", "probes", "kernels", "tui", "examples")
PACKAGES = ("kvscope.allocator", "kvscope", "kvscope.probes", "kvscope.kernels", "kvscope.tui")
PATH = re.compile(r"^[\w./-]+\.(py|c|h|md|toml|tcss)$|^[\w.-]+/([\w./-]*)$")
# a backticked span that is a name (a call's arguments and a trailing () left off)
NAME = re.compile(r"^[A-Za-z_][\w.]*$")
# `name` in `csrc/file.c`: the C function is defined in that file
PLACED = re.compile(r"`(\w+)` in `(csrc/\w+\.c)`")


def doc() -> str:
    return DOC.read_text()


def spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", doc())


def found_path(text: str) -> bool:
    text = text.rstrip("/")
    if "<" in text:  # (a pattern: /dev/shm/kvscope.<name>)
        return True
    return any((base / text).exists() for base in BASES)


def named_paths() -> set[str]:
    """The files and folders the page names: in code type, and the paths written in its text."""
    out = {s for s in spans() if PATH.match(s) and not s.startswith("/")}
    prose = re.sub(r"`[^`\n]+`", " ", doc())
    out |= set(re.findall(r"\b(?:[\w-]+/)+[\w-]+\.(?:py|c|h|md|toml)\b", prose))
    return out


@functools.cache
def c_text() -> dict[str, str]:
    files = [*(ROOT / "allocator" / "csrc").glob("*.[ch]"), ROOT / "allocator" / "_native.c"]
    return {p.relative_to(ROOT / "allocator").as_posix(): p.read_text() for p in files}


@functools.cache
def c_names(where: str) -> frozenset[str]:
    """The C functions (declared or defined), macros, enum constants and registered methods of
    one file of the core, or of all of them (where: "")."""
    text = "\n".join(t for f, t in c_text().items() if not where or f == where)
    out = set(re.findall(r"^[A-Za-z_][\w \t*]*?\b(\w+)\(", text, re.M))
    out |= set(re.findall(r"^#define (\w+)", text, re.M))
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", text):
        out |= set(re.findall(r"^\s*(\w+)\s*(?:=[^,\n]*)?,?", body, re.M))
    out |= set(re.findall(r'\{"(\w+)",', text))
    return frozenset(out)


@functools.cache
def python_names() -> frozenset[str]:
    """Every identifier and word the Python sources hold (a def, a class, an attribute, a
    keyword, a lock's or a verb's name in a string)."""
    out: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            out.update(re.findall(r"[A-Za-z_]\w*", path.read_text()))
    return frozenset(out)


def instance_attributes(cls: type) -> set[str]:
    """The attributes a class's methods set on self (KVPool._core: an instance's)."""
    out: set[str] = set()
    tree = parsed(Path(inspect.getsourcefile(cls) or ""))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    out.add(sub.attr)
    return out


def resolve(dotted: str) -> bool:
    """A dotted Python name: a module of the packages (or a class the allocator exports, or
    `pool`: a KVPool, or `Native`: the C core's type) and its attributes, or an entry-point
    group pyproject.toml declares."""
    if f'"{dotted}"' in (ROOT / "pyproject.toml").read_text():
        return True
    try:
        importlib.import_module(dotted)
        return True
    except ImportError:
        pass
    head, *rest = dotted.split(".")
    roots: list[object] = []
    if head == "pool":
        roots.append(KVPool)
    elif head == "Native":
        roots.append(_native.Native)
    elif hasattr(importlib.import_module("kvscope.allocator"), head):
        roots.append(getattr(importlib.import_module("kvscope.allocator"), head))
    for package in PACKAGES:
        try:
            roots.append(importlib.import_module(f"{package}.{head}"))
        except ImportError:
            pass
    for obj in roots:
        for i, attr in enumerate(rest):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and i == len(rest) - 1 and attr in instance_attributes(obj):
                return True
            else:
                break
        else:
            return True
    return False


def named() -> set[str]:
    out = set()
    for s in spans():
        s = s.split("(", 1)[0]
        if NAME.match(s) and not PATH.match(s):
            out.add(s)
    return out


def test_every_file_it_names_exists():
    missing = sorted(p for p in named_paths() if not found_path(p))
    assert missing == []


def test_every_c_function_it_places_in_a_file_is_defined_there():
    placed = PLACED.findall(doc())
    assert placed, "the page places no C function in a file"
    wrong = sorted((name, where) for name, where in placed if name not in c_names(where))
    assert wrong == []


def test_every_dotted_name_resolves():
    dotted = sorted(n for n in named() if "." in n and not found_path(n))
    assert dotted
    assert [n for n in dotted if not resolve(n)] == []


def test_every_other_name_is_defined_in_the_sources():
    names = python_names()
    c_all = c_names("")
    missing = sorted(
        n
        for n in named()
        if "." not in n and n not in names and not hasattr(builtins, n) and n not in c_all
    )
    assert missing == []


@pytest.mark.parametrize(
    "wrong, caught",
    [
        ("`csrc/nothing.c`", {"file"}),
        ("`native.allocate`", {"dotted"}),
        ("`KVPool._nothing`", {"dotted"}),
        ("`N_allocate` in `csrc/blocks.c`", {"placed"}),
        ("`N_nothing` in `csrc/entry.c`", {"placed", "other"}),
        ("`no_such_name`", {"other"}),
    ],
)
def test_a_name_that_is_not_there_fails(wrong, caught, monkeypatch):
    # GIVEN the page with one name added that the code does not have (native.allocate: the
    # name the page used to give the core's allocate)
    text = doc() + f"\n{wrong}\n"
    monkeypatch.setattr(f"{__name__}.doc", lambda: text)
    # WHEN the checks run THEN one of them fails
    checks = {
        "file": test_every_file_it_names_exists,
        "placed": test_every_c_function_it_places_in_a_file_is_defined_there,
        "dotted": test_every_dotted_name_resolves,
        "other": test_every_other_name_is_defined_in_the_sources,
    }
    failed = set()
    for name, check in checks.items():
        try:
            check()
        except AssertionError:
            failed.add(name)
    assert failed == caught
