"""Where a graph node came from: the user's module path and source line."""

from __future__ import annotations

import os
import re

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


def module_path(node) -> tuple[str, str]:
    """(dotted path as in named_modules(), class name) of the module a node ran in."""
    if node.op == "call_module":
        return str(node.target), ""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    path = str(path)
    while _GETATTR.search(path):  # getattr(L.s, '<odd name>') for names that are not identifiers
        path = _GETATTR.sub(lambda m: f"{m.group(1)}.{m.group(2)}", path)
    path = _DYNAMO_ROOT.sub("", path)
    path = _INDEX.sub(lambda m: "." + m.group(1), path).strip(".")
    return path, getattr(cls, "__name__", str(cls))


def input_name(node) -> str:
    """The user's name of a graph input: fx keeps it as the target, dynamo writes L_x_."""
    return re.sub(r"^[lL]_(.*)_$", r"\1", str(node.target))
