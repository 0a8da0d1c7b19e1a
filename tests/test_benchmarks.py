"""The measures benchmarks/run.py takes (no timing here): the CPU peak-memory measure of the
issue 47 row, the largest number of tensor bytes alive at once inside a step, read from the
profiler's record of every allocation and free."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_run():
    spec = importlib.util.spec_from_file_location("nanpass_bench_run", ROOT / "benchmarks" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


run = _load_run()
MiB = 1 << 20


def test_live_bytes_peak_is_the_most_alive_at_once_inside_each_range():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        kept = torch.empty(MiB, dtype=torch.uint8)  # alive before and through both ranges
        with record_function("a"):
            x = torch.empty(2 * MiB, dtype=torch.uint8)
            y = torch.empty(3 * MiB, dtype=torch.uint8)
            del x
            z = torch.empty(MiB, dtype=torch.uint8)  # (4 MiB more than kept now: not the peak)
            del y, z
        with record_function("b"):
            w = torch.empty(MiB, dtype=torch.uint8)
            del w
        left = torch.empty(5 * MiB, dtype=torch.uint8)  # after both ranges: counts in neither
    (start_a, peak_a), (start_b, peak_b) = run.live_bytes_peaks(list(p.profiler.kineto_results.events()), ["a", "b"])
    assert (start_a, peak_a) == (MiB, 6 * MiB)
    assert (start_b, peak_b) == (MiB, 2 * MiB)
    del kept, left


def test_the_training_script_knows_nothing_of_nanpass():
    # `nanpass run` is measured on a script a user could have written: no import of nanpass
    text = pathlib.Path(run.TRAIN_SCRIPT).read_text()
    assert "import nanpass" not in text and "from nanpass" not in text
