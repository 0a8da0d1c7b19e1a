"""Where a graph node came from: the user's module path and source line."""

from __future__ import annotations

import os
import re
import sysconfig

import torch

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>[^\n]*)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANPASS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_DYNAMO_ROOT = re.compile(r"^L(\[['\"][^'\"]+['\"]\]|\.\w+)\.?")
_GETATTR = re.compile(r"getattr\(([^,()]+), '([^']*)'\)")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def is_user_file(path: str) -> bool:
    return not path.startswith((_TORCH_DIR, _NANPASS_DIR)) and not path.startswith("<")


def user_frame(stack_trace: str | None) -> tuple[str, str] | None:
    """("file.py:12", "code line") of the last frame outside torch and nanpass."""
    if not stack_trace:
        return None
    found = last = None
    for m in _FRAME.finditer(stack_trace):
        path = m.group("file")
        last = (f"{path}:{m.group('line')}", m.group("code").strip())
        if not path.startswith((_TORCH_DIR, _NANPASS_DIR)):
            found = last
    # a model built only from torch modules has no user frame: show torch's own line
    return found or last


def _dotted(path: str) -> str:
    """A path as dynamo writes it (``L['self'].layers[0]``, ``getattr(L.s, '<odd>')``) in dots."""
    while _GETATTR.search(path):  # getattr(L.s, '<odd name>') for names that are not identifiers
        path = _GETATTR.sub(lambda m: f"{m.group(1)}.{m.group(2)}", path)
    return _INDEX.sub(lambda m: "." + m.group(1), path)


# set on a dynamo graph (``gm.meta``) by the backend: whether the compiled frame's ``self`` is a
# module (then it is the model, and paths are taken in it)
SELF_IS_MODULE = "nanpass_self_is_module"


def module_path(node) -> tuple[str, str]:
    """(dotted path as in named_modules(), class name) of the module a node ran in. The path is
    taken in the model: the frame's ``self`` where it is a module (``torch.compile(model)``),
    else the outermost module the frame reached (a global, a closure's, ``self.model`` of a
    trainer), as that module's ``named_modules()`` names it."""
    if node.op == "call_module":
        return str(node.target), ""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    entries = list(stack.values())
    path, cls = entries[-1]
    path = str(path)
    gm = getattr(node.graph, "owning_module", None)
    self_is_module = getattr(gm, "meta", {}).get(SELF_IS_MODULE, True)
    local = _DYNAMO_ROOT.match(path)
    if self_is_module and local is not None and local.group(1).strip(".[]'\"") == "self":
        path = _dotted(_DYNAMO_ROOT.sub("", path))
    else:
        root, dotted = _dotted(str(entries[0][0])), _dotted(path)
        if dotted == root or dotted.startswith(root + "."):
            path = dotted[len(root):]
        else:  # pragma: no cover - a stack whose first entry does not hold the last
            path = _dotted(_DYNAMO_ROOT.sub("", path))
    return path.strip("."), getattr(cls, "__name__", str(cls))


def input_name(node) -> str:
    """The user's name of a graph input: fx keeps it as the target, dynamo writes L_x_."""
    return re.sub(r"^[lL]_(.*)_$", r"\1", str(node.target))


# an installed package's files: shown from the package down, as an import path reads
_SITE = re.compile(r"^.*[\\/](?:site|dist)-packages[\\/]")


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.join(paths[k], "") for k in ("stdlib", "platstdlib") if paths.get(k)}
    return tuple(sorted(dirs, key=len, reverse=True))


_STDLIB = _stdlib_dirs()


def _short(file: str) -> str:
    """A source file as a reader wants it: ``transformers/models/llama/modeling_llama.py`` for an
    installed package (site-packages or dist-packages, in any environment), relative to the
    working directory for the user's own code, from the standard library's root for its modules;
    anything else stays absolute."""
    site = _SITE.match(file)
    if site:
        return file[site.end():]
    cwd = os.path.join(os.getcwd(), "")
    if file.startswith(cwd):
        return file[len(cwd):]
    for d in _STDLIB:
        if file.startswith(d):
            return file[len(d):]
    return file


def _rel(path: str | None) -> str | None:
    """``"file:line"`` with the file shortened by ``_short``."""
    if path is None:
        return None
    file, sep, line = path.rpartition(":")
    if not sep or not line.isdigit():  # no line number: all of it is the file
        return _short(path)
    return f"{_short(file)}:{line}"
