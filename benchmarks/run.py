"""nanpass benchmarks: overhead of the guards against the unguarded model, measured in one
process, interleaved, after warm-up, median of repeats. Prints a table and writes JSON.

    python benchmarks/run.py [--quick] [--json out.json] [--plots DIR]
    python benchmarks/run.py --run-script-only      # `nanpass run` of a training script vs python
    python benchmarks/run.py --peak-memory-only     # peak memory of a train step, check mode vs plain

Plots go to benchmarks/results/ (not tracked); ``--plots docs/img`` refreshes the docs' figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

import nanpass

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_SCRIPT = os.path.join(HERE, "scripts", "launch_bound_train.py")


def gpt2(n_layer: int, n_embd: int = 128, vocab_size: int = 1024):
    import transformers

    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=4, n_embd=n_embd, vocab_size=vocab_size,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def encoder(n_layer: int = 4, d: int = 128):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 10), nn.LogSoftmax(-1))


class MLPLoss(nn.Module):
    """A small MLP whose forward computes its own loss, as Hugging Face models return .loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                                 nn.Linear(512, 10))

    def forward(self, x, labels):
        return nn.functional.nll_loss(nn.functional.log_softmax(self.net(x), -1), labels)


def mlp_loss():
    torch.manual_seed(0)
    return MLPLoss()


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10), nn.Softmax(-1))


class VAE(nn.Module):
    def __init__(self, d: int = 256, z: int = 32):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 2 * z))
        self.dec = nn.Sequential(nn.Linear(z, 256), nn.ReLU(), nn.Linear(256, d))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, -1)
        zs = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        recon = ((self.dec(zs) - x) ** 2).mean()
        return recon - 0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(-1).mean()


class Timings(dict):
    """Median seconds per call of each fn; ``ratio(a, b)``: the median over rounds of a's time
    over b's in the same round, which drift within a run (another tenant, the CPU's clock)
    moves far less than a ratio of two medians."""

    def __init__(self, times: dict):
        super().__init__({k: statistics.median(v) for k, v in times.items()})
        self.times = times

    def ratio(self, a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(self.times[a], self.times[b], strict=True))


def interleaved(fns: dict, repeats: int, warmup: int = 2) -> Timings:
    """Each fn's times, run round-robin so drift hits all alike, in a fresh (seeded) order each
    round: a fixed order gives each fn the same predecessor, whose caches and allocations it
    inherits."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    order = list(fns)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for k in order:
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    return Timings(times)


def train_step(model, batch):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = out.loss if hasattr(out, "loss") else out if out.dim() == 0 else out.float().pow(2).mean()
        loss.backward()

    return step


def forward_only(model, batch):
    def fwd():
        with torch.no_grad():
            model(**batch) if isinstance(batch, dict) else model(batch)

    return fwd


def saved_numel(step) -> int:
    """Elements saved for backward during one train step, each storage counted once (a tensor
    several ops save costs its memory once): a CPU proxy for activation memory."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes() // max(t.element_size(), 1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def autocast_step(model, batch, dtype=torch.bfloat16):
    """A mixed-precision train step as users write it on CPU: forward and loss under autocast."""
    inner = train_step(model, batch)

    def step():
        with torch.autocast("cpu", dtype=dtype):
            inner()

    return step


def bench_autocast(model, batch, repeats):
    safe = nanpass.harden(model)
    t = interleaved({"plain": autocast_step(model, batch), "nanpass": autocast_step(safe, batch)}, repeats)
    return {"plain_ms": t["plain"] * 1e3, "nanpass_ms": t["nanpass"] * 1e3, "ratio": t.ratio("nanpass", "plain")}


def bench_eager(name, model, batch, repeats):
    safe = nanpass.harden(model)
    res = {}
    for kind, make in (("forward", forward_only), ("train step", train_step)):
        t = interleaved({"plain": make(model, batch), "nanpass": make(safe, batch)}, repeats)
        res[kind] = {"plain_ms": t["plain"] * 1e3, "nanpass_ms": t["nanpass"] * 1e3,
                     "ratio": t.ratio("nanpass", "plain")}
    plain_saved, safe_saved = saved_numel(train_step(model, batch)), saved_numel(train_step(safe, batch))
    res["saved_for_backward"] = {"plain": plain_saved, "nanpass": safe_saved, "ratio": safe_saved / plain_saved}
    res["guarded_ops"] = sum(c.action == "guarded" for c in safe.changes)
    return res


def bench_check_mode(model, batch, repeats):
    """Check mode against torch.autograd.detect_anomaly, same model, same run."""
    checked = nanpass.harden(model, mode="check")
    plain = train_step(model, batch)

    def anomaly():
        with torch.autograd.detect_anomaly(check_nan=True):
            plain()

    def enabled():  # nanpass run / nanpass.enable: the model and the loss code around it
        with nanpass.enable(mode="check"):
            plain()

    t = interleaved({"plain": plain, "check": train_step(checked, batch), "anomaly": anomaly,
                     "enable": enabled}, repeats)
    return {"plain_ms": t["plain"] * 1e3, "check_ratio": t.ratio("check", "plain"),
            "enable_check_ratio": t.ratio("enable", "plain"),
            "detect_anomaly_ratio": t.ratio("anomaly", "plain")}


class NullMode(torch.overrides.TorchFunctionMode):
    """A torch-function mode whose handler only calls the function: the floor of any design
    that runs Python for each torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def bench_launch_bound(repeats):
    """Tiny tensors, one thread: each call's fixed cost dominates, as a kernel launch does on a
    GPU (GPT-2, 12 layers, 32 wide, 1 x 8 tokens, a train step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = gpt2(12, 32)
        batch = {"input_ids": torch.randint(0, 1024, (1, 8)), "labels": torch.randint(0, 1024, (1, 8))}
        plain = train_step(model, batch)

        def null():
            with NullMode():
                plain()

        def anomaly():
            with torch.autograd.detect_anomaly(check_nan=True):
                plain()

        fns = {"plain": plain, "null_mode": null,
               "harden": train_step(nanpass.harden(model), batch),
               "check": train_step(nanpass.harden(model, mode="check"), batch),
               "check_every_op": train_step(nanpass.harden(model, mode="check", every_op=True), batch),
               "check_stop_at_op": train_step(nanpass.harden(model, mode="check", stop_at_op=True), batch),
               "detect_anomaly": anomaly}
        t = interleaved(fns, repeats)
        return {"plain_ms": t["plain"] * 1e3,
                **{f"{k}_ratio": t.ratio(k, "plain") for k in fns if k != "plain"}}
    finally:
        torch.set_num_threads(threads)


def bench_check_screen(repeats):
    """Issue 47: eager check mode's screen against the plain step and against the check of
    every call (``every_op=True``), one process, interleaved: the launch-bound row (one thread)
    and GPT-2 12L 128 wide at 4 x 64 (the machine's threads)."""
    out = {}
    threads = torch.get_num_threads()
    for name, one in (("launch-bound", True), ("gpt2-12L", False)):
        torch.set_num_threads(1 if one else threads)
        try:
            if one:
                model = gpt2(12, 32)
                batch = {"input_ids": torch.randint(0, 1024, (1, 8)), "labels": torch.randint(0, 1024, (1, 8))}
            else:
                model, batch = MODELS["gpt2-12L"]()
            fns = {"plain": train_step(model, batch),
                   "check": train_step(nanpass.harden(model, mode="check"), batch),
                   "every_op": train_step(nanpass.harden(model, mode="check", every_op=True), batch)}
            t = interleaved(fns, repeats if one else max(3, repeats // 3))
            out[name] = {"plain_ms": t["plain"] * 1e3, "check_ratio": t.ratio("check", "plain"),
                         "every_op_ratio": t.ratio("every_op", "plain")}
        finally:
            torch.set_num_threads(threads)
    return out


def print_check_screen(x: dict) -> None:
    for name, r in x.items():
        print(f"{name:26} {'check (screen)':16} {r['plain_ms']:10.2f} {'':11} {r['check_ratio']:7.3f}"
              f"  every_op=True {r['every_op_ratio']:.3f}")


def print_launch_bound(x: dict) -> None:
    print(f"{'gpt2-12L-32w 1x8, 1 thread':26} {'launch-bound':16} {x['plain_ms']:10.2f} {'':11} "
          f"{x['harden_ratio']:7.3f}  harden; null mode {x['null_mode_ratio']:.3f}; check "
          f"{x['check_ratio']:.3f} (every_op {x['check_every_op_ratio']:.3f}, stop_at_op "
          f"{x['check_stop_at_op_ratio']:.3f}); detect_anomaly "
          f"{x['detect_anomaly_ratio']:.3f}")


def child_env(one_thread: bool) -> dict:
    """The environment of a benchmark's subprocess: this nanpass first on the path (the checkout
    this file belongs to, not an installed copy), and one thread where the row asks for it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(nanpass.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    if one_thread:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _child(cmd: list[str], env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=os.path.dirname(HERE))
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return res


def run_script_commands(env: dict) -> dict[str, list[str]]:
    """The launch-bound training script as python runs it, as `nanpass run` runs it (check mode,
    the default) and, where this nanpass's CLI has the option, as `nanpass run --every-op`."""
    py = sys.executable
    cmds = {"python": [py, TRAIN_SCRIPT], "nanpass_run": [py, "-m", "nanpass", "run", TRAIN_SCRIPT]}
    usage = subprocess.run([py, "-m", "nanpass", "run", "--help"], capture_output=True, text=True, env=env,
                           cwd=os.path.dirname(HERE)).stdout
    if "--every-op" in usage:
        cmds["nanpass_run_every_op"] = [py, "-m", "nanpass", "run", "--every-op", TRAIN_SCRIPT]
    return cmds


def bench_run_script(rounds: int, steps: int = 100, warmup: int = 10) -> dict:
    """Issue 47: `nanpass run` of an unmodified training script (benchmarks/scripts/
    launch_bound_train.py: the launch-bound row's GPT-2, AdamW, one thread) against `python`
    running it. Each run is its own process; the processes are interleaved (python, nanpass
    run, [--every-op], python, ...) after one untimed round that warms the disk caches. The
    script times its own steps after ``warmup`` untimed ones, so start-up and imports do not
    count; a process's time is the median of its ``steps`` steps, and each ratio the median over
    rounds of the two processes' times in the same round (as ``Timings.ratio``)."""
    env = child_env(one_thread=True)
    cmds = run_script_commands(env)
    extra = ["--steps", str(steps), "--warmup", str(warmup)]

    def once(cmd):
        t = time.perf_counter()
        res = _child(cmd + extra, env)
        wall = time.perf_counter() - t
        line = next(x for x in reversed(res.stdout.splitlines()) if x.startswith("step_ms "))
        return float(line.split()[1]) / 1e3, wall

    for cmd in cmds.values():
        once(cmd)
    times, walls = {k: [] for k in cmds}, {k: [] for k in cmds}
    for _ in range(rounds):
        for k, cmd in cmds.items():
            step, wall = once(cmd)
            times[k].append(step)
            walls[k].append(wall)
    t = Timings(times)
    return {"rounds": rounds, "steps": steps, "warmup": warmup, "every_op_flag": "nanpass_run_every_op" in cmds,
            **{f"{k}_ms": t[k] * 1e3 for k in cmds},
            **{f"{k}_ratio": t.ratio(k, "python") for k in cmds if k != "python"},
            "per_round_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
            "process_wall_s": {k: statistics.median(v) for k, v in walls.items()}}


def print_run_script(x: dict) -> None:
    every = (f"; --every-op {x['nanpass_run_every_op_ratio']:.3f}" if x["every_op_flag"]
             else "; --every-op: not in this CLI")
    wall, per = x["process_wall_s"], x["per_round_ms"]
    rounds = [a / b for a, b in zip(per["nanpass_run"], per["python"], strict=True)]
    print(f"{'gpt2-12L-32w 1x8 script':26} {'nanpass run':16} {x['python_ms']:10.2f} {x['nanpass_run_ms']:11.2f} "
          f"{x['nanpass_run_ratio']:7.3f}  per step vs python ({min(rounds):.2f}-{max(rounds):.2f} over "
          f"{x['rounds']} rounds of {x['steps']} steps){every}; whole process {wall['python']:.1f} s vs "
          f"{wall['nanpass_run']:.1f} s")


class BNNet(nn.Module):
    """A small convolutional net with batch norm: its forward writes buffers (the running
    statistics), which check mode's screen copies before each forward for a run again."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                 nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.net(x), labels)


def bn_net():
    torch.manual_seed(0)
    return BNNet()


# models of the peak-memory row: GPT-2 12L as the GPT-2 rows build it (no batch norm; its
# forward writes no buffer), the same with GPT-2's own vocabulary (50257: the float32 logits,
# an output of the forward, are then the step's largest tensor, as on the GPU rows), and a
# batch-norm net (its forward writes six buffers)
MEMORY_MODELS = {
    "gpt2-12L": lambda: MODELS["gpt2-12L"](),
    "gpt2-12L-vocab50257": lambda: (gpt2(12, vocab_size=50257), (lambda ids: {"input_ids": ids, "labels": ids})(
        torch.randint(0, 50257, (4, 64)))),
    "bn-cnn": lambda: (bn_net(), {"x": torch.randn(32, 3, 32, 32), "labels": torch.randint(0, 10, (32,))}),
}
# plain; harden(m, mode="check") (the screen); the same with every_op=True; and
# nanpass.enable(mode="check") on from before the model is built, as `nanpass run` has it
MEMORY_CONFIGS = ("plain", "check", "every_op", "enable")


def live_bytes_peaks(events, ranges: list[str]) -> list[tuple[int, int]]:
    """From a CPU profile with ``profile_memory=True``: for each named range (a
    ``record_function``), (live bytes when it began, most live bytes at any moment inside it).
    Live bytes: the running sum of every allocation (+) and free (-) the profiler saw, in time
    order. Started before the model was built, that sum is every tensor byte alive."""
    cpu = torch.autograd.DeviceType.CPU
    mem = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == cpu),
                 key=lambda e: e.start_ns())
    spans = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in ranges}
    out = []
    for name in ranges:
        begin, end = spans[name]
        live, start, peak = 0, None, None
        for e in mem:
            if e.start_ns() > end:
                break
            if e.start_ns() >= begin and start is None:
                start = peak = live
            live += e.nbytes()
            if start is not None:
                peak = max(peak, live)
        if start is None:  # no allocation inside the range
            start = peak = live
        out.append((start, peak))
    return out


PHASES = ("zero_grad", "forward", "backward", "optimizer")


def memory_step(model, batch, opt, phase=lambda name: contextlib.nullcontext()):
    """A train step in ``PHASES``, each inside ``phase(name)`` (where the peak is measured)."""
    def step():
        with phase("zero_grad"):
            opt.zero_grad(set_to_none=True)
        with phase("forward"):  # (and the loss)
            out = model(**batch) if isinstance(batch, dict) else model(batch)
            loss = out.loss if hasattr(out, "loss") else out if out.dim() == 0 else out.float().pow(2).mean()
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()

    return step


def peak_memory_child(name: str, config: str, measure: str, steps: int = 3, warmup: int = 3) -> dict:
    """In a fresh process: the peak memory of a train step (zero_grad, forward and loss,
    backward, AdamW step) of ``MEMORY_MODELS[name]`` as ``config`` runs it, after ``warmup``
    steps (check mode's first step is checked at every op, its second learns which buffers the
    forward writes), the largest of ``steps`` steps, and the phase where it is reached.

    ``measure``: "tensors": on CUDA ``torch.cuda.max_memory_allocated`` after a reset at each
    phase's start; on the CPU, the largest number of tensor bytes alive at once during the step,
    from the profiler's record of every allocation and free (``profile_memory=True``), started
    before the model is built. "rss" (CPU): the process's peak resident size (VmHWM) over the
    steps, after resetting it to the resident size at their start (``/proc/self/clear_refs``)."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    prof = None
    if measure == "tensors" and not cuda:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
    on = nanpass.enable(mode="check") if config == "enable" else None  # (left on: the process ends)
    model, batch = MEMORY_MODELS[name]()
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    hardened = config in ("check", "every_op")
    run = nanpass.harden(model, mode="check", every_op=config == "every_op") if hardened else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(warmup):
        memory_step(run, batch, opt)()
    out = {"model": name, "config": config, "measure": measure, "device": device, "steps": steps,
           "enabled": on is not None}
    if measure == "tensors":
        spans = {}  # (step, phase) -> (bytes alive at its start, most alive inside it)
        if cuda:
            @contextlib.contextmanager
            def phase(what, k):
                torch.cuda.synchronize()
                begin = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                yield
                torch.cuda.synchronize()
                spans[k, what] = (begin, torch.cuda.max_memory_allocated())
        else:
            def phase(what, k):
                return torch.profiler.record_function(f"nanpass_peak_{k}_{what}")
        for k in range(steps):
            memory_step(run, batch, opt, lambda what, k=k: phase(what, k))()
        if prof is not None:
            prof.__exit__(None, None, None)
            keys = [(k, what) for k in range(steps) for what in PHASES]
            got = live_bytes_peaks(list(prof.profiler.kineto_results.events()),
                                   [f"nanpass_peak_{k}_{what}" for k, what in keys])
            spans = dict(zip(keys, got, strict=True))
        per_step = [max(spans[k, what][1] for what in PHASES) for k in range(steps)]
        k = max(range(steps), key=per_step.__getitem__)
        where = max(PHASES, key=lambda what: spans[k, what][1])
        return {**out, "peak_bytes": per_step[k], "start_bytes": spans[k, "zero_grad"][0], "peak_phase": where,
                "per_step_peak": per_step, "phase_peak": {what: spans[k, what][1] for what in PHASES}}
    step = memory_step(run, batch, opt)

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith(field + ":"))

    rss = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # 5: the high-water mark = the resident size now
        f.write("5")
    for _ in range(steps):
        step()
    return {**out, "peak_bytes": status("VmHWM"), "start_bytes": rss}


def bench_peak_memory(names=tuple(MEMORY_MODELS), configs=MEMORY_CONFIGS) -> dict:
    """Issue 47: peak memory of a train step, check mode's screen against the plain model, each
    (model, configuration, measure) in its own process (a process's allocator and resident size
    keep what an earlier configuration left). On CUDA the allocator's peak; on the CPU the
    profiler's count of live tensor bytes, and the peak resident size as a cross-check (with
    glibc's mmap threshold fixed, so that a freed large tensor leaves the resident set)."""
    cuda = torch.cuda.is_available()
    env = child_env(one_thread=False)
    rss_env = {**env, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = {}
    for name in names:
        row = {}
        for measure in ("tensors",) if cuda else ("tensors", "rss"):
            for config in configs:
                call = f"run.peak_memory_child({name!r}, {config!r}, {measure!r})"
                code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import run; "
                        f"print('peak_json', json.dumps({call}))")
                res = _child([sys.executable, "-c", code], rss_env if measure == "rss" else env)
                line = next(x for x in reversed(res.stdout.splitlines()) if x.startswith("peak_json "))
                row[f"{measure}:{config}"] = json.loads(line[len("peak_json "):])
        for measure in ("tensors", "rss"):
            plain = row.get(f"{measure}:plain")
            for config in configs:
                got = row.get(f"{measure}:{config}")
                if plain and got and config != "plain":
                    got["ratio"] = got["peak_bytes"] / plain["peak_bytes"]
                    got["extra_bytes"] = got["peak_bytes"] - plain["peak_bytes"]
        out[name] = row
    return out


def print_peak_memory(x: dict) -> None:
    for name, row in x.items():
        for measure in ("tensors", "rss"):
            plain = row.get(f"{measure}:plain")
            if not plain:
                continue
            others = {c: row[f"{measure}:{c}"] for c in MEMORY_CONFIGS if c != "plain" and f"{measure}:{c}" in row}
            if measure == "rss":
                what = "peak RSS (VmHWM)"
            else:
                what = "cuda max_allocated" if plain["device"] == "cuda" else "live tensor bytes"
                what += f" (plain's peak in its {plain['peak_phase']})"
            rest = "; ".join(f"{c} {r['ratio']:.4f} ({r['extra_bytes'] / 2**20:+.2f} MiB)" for c, r in others.items())
            print(f"{name:26} {'peak memory':16} {plain['peak_bytes'] / 2**20:9.2f}M {'':11} {'':7}  {what}: {rest}")
            if "phase_peak" in plain:  # where each configuration's memory rises
                over = "; ".join(f"{c} " + ", ".join(
                    f"{ph} {(r['phase_peak'][ph] - plain['phase_peak'][ph]) / 2**20:+.2f}"
                    for ph in ("forward", "backward", "optimizer")) for c, r in others.items())
                print(f"{'':26} {'':16} {'':22} {'':7}  each phase's peak over plain's, MiB: {over}")


def bench_compiled(model, batch, repeats, shapes=False):
    torch._dynamo.reset()
    t0 = time.perf_counter()
    ind = torch.compile(model, backend="inductor")
    train_step(ind, batch)()
    t_ind = time.perf_counter() - t0
    t0 = time.perf_counter()
    npb = torch.compile(model, backend=nanpass.backend())
    train_step(npb, batch)()
    t_np = time.perf_counter() - t0
    # torch.compile(nanpass.harden(model)): the guards traced into inductor's graph by dynamo
    hard = torch.compile(nanpass.harden(model), backend="inductor")
    train_step(hard, batch)()
    # compiled check mode: names the op where a NaN/Inf is born, forward and backward
    chk = torch.compile(model, backend=nanpass.backend(mode="check"))
    train_step(chk, batch)()
    # and torch.compile(nanpass.harden(model, mode="check")): a scalar per new value, read once
    hchk = torch.compile(nanpass.harden(model, mode="check"), backend="inductor")
    train_step(hchk, batch)()
    fns = {"inductor": train_step(ind, batch), "nanpass": train_step(npb, batch),
           "harden": train_step(hard, batch), "check": train_step(chk, batch),
           "harden_check": train_step(hchk, batch)}
    if shapes:  # shape asserts: checked when a graph compiles, so nothing per call
        sh = torch.compile(model, backend=nanpass.backend(shape_checks=True))
        train_step(sh, batch)()
        fns["shapes"] = train_step(sh, batch)
    t = interleaved(fns, repeats)
    out = {"inductor_ms": t["inductor"] * 1e3, "nanpass_ms": t["nanpass"] * 1e3,
           "ratio": t.ratio("nanpass", "inductor"), "compiled_harden_ms": t["harden"] * 1e3,
           "compiled_harden_ratio": t.ratio("harden", "inductor"),
           "compiled_check_ms": t["check"] * 1e3, "compiled_check_ratio": t.ratio("check", "inductor"),
           "compiled_harden_check_ms": t["harden_check"] * 1e3,
           "compiled_harden_check_ratio": t.ratio("harden_check", "inductor"),
           "compile_s_inductor": t_ind,
           "compile_s_nanpass": t_np, "compile_ratio": t_np / t_ind}
    if shapes:
        out["shape_checks_ratio"] = t.ratio("shapes", "inductor")
    return out


def bench_cold_compile(name: str):
    """Compile time of inductor alone and of the nanpass backend, each in a fresh process with
    an empty inductor cache, so neither benefits from the other's cache."""
    import subprocess
    import sys
    import tempfile

    out = {}
    for backend in ("inductor", "nanpass"):
        code = (
            "import time, torch, sys; sys.path.insert(0, 'benchmarks'); import run, nanpass;"
            f"m, b = run.MODELS['{name}'](); "
            f"c = torch.compile(m, backend={'nanpass.backend()' if backend == 'nanpass' else repr('inductor')});"
            "t = time.perf_counter(); run.train_step(c, b)(); print(time.perf_counter() - t)"
        )
        with tempfile.TemporaryDirectory() as cache:
            env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                 timeout=900)
        out[backend] = float(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
    if out["inductor"] and out["nanpass"]:
        out["ratio"] = out["nanpass"] / out["inductor"]
    return out


def bench_first_call(layers):
    """harden() plus the first call (where call sites are found) of a Hugging Face GPT-2, next
    to the plain model's first call and dynamo's own first call (torch.compile, eager backend)."""
    rows = []
    for n in layers:
        batch = {"input_ids": torch.randint(0, 1024, (1, 16))}
        row = {"layers": n}
        for what in ("plain", "nanpass", "dynamo"):
            m = gpt2(n)
            torch._dynamo.reset()
            t = time.perf_counter()
            if what == "nanpass":
                m = nanpass.harden(m)
            elif what == "dynamo":
                m = torch.compile(m, backend="eager")
            with torch.no_grad():
                m(**batch)
            row[f"{what}_s"] = time.perf_counter() - t
        row["ratio_vs_dynamo"] = row["nanpass_s"] / row["dynamo_s"]
        rows.append(row)
    return rows


MODELS = {
    "mlp": lambda: (mlp(), torch.randn(64, 256)),
    "mlp+loss": lambda: (mlp_loss(), {"x": torch.randn(64, 256), "labels": torch.randint(0, 10, (64,))}),
    "cnn": lambda: (cnn(), torch.randn(16, 3, 32, 32)),
    "vae": lambda: (VAE(), torch.randn(64, 256)),
    "transformer-encoder-4L": lambda: (encoder(), torch.randn(8, 64, 128)),
    "gpt2-12L": lambda: (gpt2(12), (lambda ids: {"input_ids": ids, "labels": ids})(torch.randint(0, 1024, (4, 64)))),
}


def plots(results: dict, out_dir: str) -> list[str]:
    """Overhead per model and harden() time by depth, as PNGs for the docs (if matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    import os

    os.makedirs(out_dir, exist_ok=True)
    names = list(results["eager"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [results["eager"][n]["train step"]["ratio"] for n in names], 0.4,
           label="eager train step / plain")
    if "compiled" in results:
        ax.bar([x + 0.2 for x in xs], [results["compiled"][n]["ratio"] for n in names], 0.4,
               label="compiled train step / inductor")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("time ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    a = os.path.join(out_dir, "overhead.png")
    fig.savefig(a, dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    rows = results["first_call"]
    for what, label in (("plain", "plain first call"), ("nanpass", "harden() + first call"),
                        ("dynamo", "torch.compile(backend='eager') first call")):
        ax.plot([r["layers"] for r in rows], [r[f"{what}_s"] * 1e3 for r in rows], "o-", label=label)
    ax.set_xlabel("GPT-2 layers")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    b = os.path.join(out_dir, "harden_time.png")
    fig.savefig(b, dpi=120)
    return [a, b]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no inductor compile")
    ap.add_argument("--json", default="benchmarks/results/latest.json")
    ap.add_argument("--plots", default="benchmarks/results", metavar="DIR",
                    help="where the figures go (default benchmarks/results; docs/img for the docs)")
    ap.add_argument("--spike-only", action="store_true", help="only the SpikeGuard rows")
    ap.add_argument("--launch-bound-only", action="store_true", help="only the launch-bound row")
    ap.add_argument("--check-only", action="store_true",
                    help="only eager check mode's rows (issue 47: the screen, every_op=True)")
    ap.add_argument("--run-script-only", action="store_true",
                    help="only the `nanpass run` row (issue 47: benchmarks/scripts/launch_bound_train.py "
                    "as python, nanpass run and nanpass run --every-op run it, interleaved processes)")
    ap.add_argument("--peak-memory-only", action="store_true",
                    help="only the peak-memory row (issue 47: a train step, check mode vs plain, each in "
                    "its own process)")
    args = ap.parse_args()
    repeats = 5 if args.quick else 15
    script_rounds = 3 if args.quick else 7
    if args.spike_only:
        return print_spike(bench_spike(repeats))
    if args.check_only:
        return print_check_screen(bench_check_screen(3 * repeats))
    if args.launch_bound_only:
        return print_launch_bound(bench_launch_bound(3 * repeats))
    if args.run_script_only:
        return print_run_script(bench_run_script(script_rounds))
    if args.peak_memory_only:
        return print_peak_memory(bench_peak_memory())
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {"machine": f"{platform.machine()} {platform.processor() or ''} "
                          f"{torch.get_num_threads()} threads, torch {torch.__version__}".strip()}
    models = {name: make() for name, make in MODELS.items()}
    results["eager"] = {name: bench_eager(name, m, b, repeats) for name, (m, b) in models.items()}
    results["check_mode"] = {name: bench_check_mode(m, b, repeats) for name, (m, b) in models.items()}
    results["autocast_bf16"] = {name: bench_autocast(*models[name], repeats) for name in ("mlp", "gpt2-12L")}
    results["launch_bound"] = bench_launch_bound(3 * repeats)
    results["check_screen"] = bench_check_screen(3 * repeats)
    results["run_script"] = bench_run_script(script_rounds)
    results["peak_memory"] = bench_peak_memory()
    if not args.quick:
        results["compiled"] = {name: bench_compiled(m, b, 3 * repeats, shapes=name.startswith("transformer"))
                               for name, (m, b) in models.items()}
    results["first_call"] = bench_first_call([1, 12] if args.quick else [1, 6, 12, 24])
    if not args.quick:
        results["cold_compile"] = {n: bench_cold_compile(n) for n in ("mlp", "transformer-encoder-4L")}

    print(f"machine: {results['machine']}")
    print(f"{'model':26} {'what':16} {'plain ms':>10} {'nanpass ms':>11} {'ratio':>7}  notes")
    for name, r in results["eager"].items():
        for kind in ("forward", "train step"):
            x = r[kind]
            print(f"{name:26} {'eager ' + kind:16} {x['plain_ms']:10.2f} {x['nanpass_ms']:11.2f} "
                  f"{x['ratio']:7.3f}")
        m = r["saved_for_backward"]
        print(f"{name:26} {'saved for bwd':16} {m['plain']:10d} {m['nanpass']:11d} {m['ratio']:7.3f}  elements")
    for name, x in results["autocast_bf16"].items():
        print(f"{name:26} {'bf16 autocast':16} {x['plain_ms']:10.2f} {x['nanpass_ms']:11.2f} {x['ratio']:7.3f}"
              "  train step")
    for name, x in results["check_mode"].items():
        print(f"{name:26} {'check mode':16} {x['plain_ms']:10.2f} {'':11} {x['check_ratio']:7.3f}"
              f"  detect_anomaly: {x['detect_anomaly_ratio']:.3f}; nanpass.enable(check), loss code "
              f"included: {x['enable_check_ratio']:.3f}")
    print_launch_bound(results["launch_bound"])
    print_check_screen(results["check_screen"])
    print_run_script(results["run_script"])
    print_peak_memory(results["peak_memory"])
    for name, x in results.get("compiled", {}).items():
        extra = f", with shape_checks {x['shape_checks_ratio']:.3f}" if "shape_checks_ratio" in x else ""
        print(f"{name:26} {'compiled step':16} {x['inductor_ms']:10.2f} {x['nanpass_ms']:11.2f} {x['ratio']:7.3f}"
              f"  vs inductor{extra}; compile {x['compile_s_inductor']:.1f}s vs {x['compile_s_nanpass']:.1f}s")
        print(f"{name:26} {'compile(harden)':16} {x['inductor_ms']:10.2f} {x['compiled_harden_ms']:11.2f} "
              f"{x['compiled_harden_ratio']:7.3f}  vs inductor")
        print(f"{name:26} {'compiled check':16} {x['inductor_ms']:10.2f} {x['compiled_check_ms']:11.2f} "
              f"{x['compiled_check_ratio']:7.3f}  vs inductor (mode='check')")
        print(f"{name:26} {'compile(check)':16} {x['inductor_ms']:10.2f} {x['compiled_harden_check_ms']:11.2f} "
              f"{x['compiled_harden_check_ratio']:7.3f}  vs inductor (compile(harden(m, mode='check')))")
    for row in results["first_call"]:
        print(f"first call, GPT-2 {row['layers']:2d} layers: plain {row['plain_s'] * 1e3:.0f} ms, "
              f"harden() + first call {row['nanpass_s'] * 1e3:.0f} ms, dynamo (eager backend) "
              f"{row['dynamo_s'] * 1e3:.0f} ms; nanpass / dynamo {row['ratio_vs_dynamo']:.3f}")
    for name, x in results.get("cold_compile", {}).items():
        ratio = f"{x['ratio']:.2f}" if "ratio" in x else "n/a"
        print(f"cold compile {name}: inductor {x['inductor']} s, nanpass {x['nanpass']} s, ratio {ratio}")
    results["spike_guard"] = bench_spike(repeats)
    print_spike(results["spike_guard"])
    for path in plots(results, args.plots):
        print(f"wrote {path}")
    import os

    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


def bench_spike(repeats: int, every: int = 100) -> dict:
    """nanpass.SpikeGuard on the GPT-2 train step: the whole step with no spike against a plain
    StepGuard (interleaved); the guards alone on the same gradients (SGD with lr=0, so the
    optimizer costs next to nothing: the difference is the spike check, stable even on a busy
    machine); one snapshot's time amortised over ``every`` steps; the bytes one kept snapshot
    holds (parameters, buffers, AdamW state)."""
    import copy

    model, batch = MODELS["gpt2-12L"]()
    other = copy.deepcopy(model)
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (model, other))
    plain = nanpass.StepGuard(opt_a, model=model)
    spike = nanpass.SpikeGuard(opt_b, other, every=10**9, keep=2)  # snapshots timed apart below

    def step(m, opt, guard, spiky):
        def fn():
            opt.zero_grad(set_to_none=True)
            loss = m(**batch).loss
            loss.backward()
            guard.step(loss=loss) if spiky else guard.step()
        return fn

    t = interleaved({"stepguard": step(model, opt_a, plain, False),
                     "spikeguard": step(other, opt_b, spike, True)}, repeats)
    snaps = []
    for _ in range(5):
        spike._slots[-1].position = -1  # force a snapshot now (the ring's buffers are reused)
        t0 = time.perf_counter()
        spike._snapshot()
        snaps.append(time.perf_counter() - t0)
    params = sum(p.numel() * p.element_size() for p in other.parameters())
    state = sum(v.numel() * v.element_size() for s in opt_b.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    # the guards alone: same gradients, an optimizer that does next to nothing
    sgd = torch.optim.SGD(other.parameters(), lr=0.0)
    alone_plain = nanpass.StepGuard(sgd, model=other)
    alone_spike = nanpass.SpikeGuard(sgd, other, every=10**9, grad_factor=10.0)
    loss = torch.tensor(5.0)
    alone = interleaved({"stepguard": alone_plain.step,
                         "spikeguard": lambda: alone_spike.step(loss=loss)}, 4 * repeats)
    snap = statistics.median(snaps)
    increment = alone["spikeguard"] - alone["stepguard"]
    return {"stepguard_ms": t["stepguard"] * 1e3, "spikeguard_ms": t["spikeguard"] * 1e3,
            "no_spike_ratio": t.ratio("spikeguard", "stepguard"),
            "guard_alone_ms": {k: v * 1e3 for k, v in alone.items()}, "increment_ms": increment * 1e3,
            "no_spike_ratio_from_increment": 1 + increment / t["stepguard"],
            "snapshot_ms": snap * 1e3, "every": every,
            "amortised_snapshot_fraction": snap / (every * t["stepguard"]),
            "snapshot_bytes": spike.snapshot_bytes, "param_bytes": params, "optimizer_state_bytes": state}


def print_spike(x: dict) -> None:
    print(f"{'gpt2-12L':26} {'SpikeGuard':16} {x['stepguard_ms']:10.2f} {x['spikeguard_ms']:11.2f} "
          f"{x['no_spike_ratio']:7.3f}  train step, no spike, vs a plain StepGuard")
    a = x["guard_alone_ms"]
    print(f"{'gpt2-12L':26} {'guard alone':16} {a['stepguard']:10.2f} {a['spikeguard']:11.2f} "
          f"{x['no_spike_ratio_from_increment']:7.4f}  +{x['increment_ms']:.2f} ms a step (SGD lr=0, "
          "grad_factor on): the ratio this adds to the train step")
    print(f"{'gpt2-12L':26} {'snapshot':16} {x['snapshot_ms']:10.2f} {'':11} "
          f"{x['amortised_snapshot_fraction']:7.4f}  of a step, one every {x['every']} steps; "
          f"{x['snapshot_bytes'] / 2**20:.1f} MiB per kept snapshot (params {x['param_bytes'] / 2**20:.1f} "
          f"MiB + AdamW state {x['optimizer_state_bytes'] / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
