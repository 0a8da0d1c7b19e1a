"""What a script sees of python, printed: `python sees.py [ARGS...]` (run from another
directory holding a module `shadow.py`, which python does not put on the path)."""

import importlib.util
import os
import sys
import warnings

import torch
import torch.nn.functional as F

print("file", __file__, os.path.isabs(__file__))
print("argv", sys.argv[1:])
print("path0", sys.path[0])
print("shadow importable", importlib.util.find_spec("shadow") is not None)
with warnings.catch_warnings():
    warnings.simplefilter("always")
    F.mse_loss(torch.zeros(3, 1), torch.zeros(3))  # broadcasting: torch's UserWarning names this line
if "--chdir" in sys.argv:
    os.chdir(sys.argv[sys.argv.index("--chdir") + 1])
if "--fail" in sys.argv:
    sys.exit("fatal: bad config")
