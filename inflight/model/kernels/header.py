"""ctypes signatures read from ``kernels.h``, so Python binds exactly what C declares.

Each kernel source includes ``kernels.h``, so the compiler holds every definition to its
prototype there; binding from the same prototypes closes the loop: a changed argument list
changes the binding, and a type this reader does not know fails the load with its name
instead of passing garbage to C.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

# C type -> ctypes type, for the scalar types the kernels use; any pointer is a c_void_p.
_SCALARS: dict[str, type | None] = {
    "void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
}
_PROTOTYPE = re.compile(r"^\s*([A-Za-z_][\w ]*?)\s*\b(\w+)\s*\(([^)]*)\)\s*;", re.M)

Signature = tuple[type | None, list[type]]


def _ctype(decl: str, where: str) -> type | None:
    decl = " ".join(decl.replace("const", " ").split())
    if "*" in decl:
        return ctypes.c_void_p
    base = decl.rsplit(" ", 1)[0] if " " in decl else decl
    if base not in _SCALARS:
        raise ValueError(f"kernels.h: {where}: C type {decl!r} has no ctypes binding here")
    return _SCALARS[base]


def parse_signatures(text: str) -> dict[str, Signature]:
    """``{function: (restype, argtypes)}`` for every prototype in a C header.

    Args:
        text: the header's source; comments and preprocessor lines are ignored.

    Raises:
        ValueError: a return or parameter type other than ``void``, ``int``, ``int64_t``,
            ``float`` or a pointer, or an unnamed parameter.
    """
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    signatures: dict[str, Signature] = {}
    for m in _PROTOTYPE.finditer(text):
        ret, name, params = m.group(1), m.group(2), " ".join(m.group(3).split())
        restype = None if ret.strip() == "void" else _ctype(ret + " r", f"{name} return")
        args: list[type] = []
        if params and params != "void":
            for p in params.split(","):
                if len(p.replace("*", " ").split()) < 2:
                    raise ValueError(f"kernels.h: {name}: parameter {p.strip()!r} needs a name")
                t = _ctype(p, f"{name}({p.strip()})")
                if t is None:
                    raise ValueError(f"kernels.h: {name}: a void parameter {p.strip()!r}")
                args.append(t)
        signatures[name] = (restype, args)
    return signatures


def read_signatures(path: Path) -> dict[str, Signature]:
    """``parse_signatures`` of the header at ``path``."""
    return parse_signatures(path.read_text())
