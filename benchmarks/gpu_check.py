"""Checks that need a GPU, in one short run (a lent machine's time is scarce):

1. the guard contract on CUDA kernels, per rule and dtype, from the operands each rule carries:
   bad operands -> finite values and gradients; good operands -> the original's bits; an inf
   upstream gradient passes through;
2. GPT-2 (12 layers, 768 wide) train step, hardened vs plain, float32 and bfloat16 autocast:
   time and peak memory (torch.cuda.max_memory_allocated), and the compiled step vs inductor;
3. GradScaler with float16 autocast: the hardened run's scale trajectory equals the plain one;
4. check mode and ``detect_anomaly`` beside the plain step, and compiled check mode beside
   inductor (``check``); one step of each kind
   under ``torch.cuda.set_sync_debug_mode("error")`` (``sync_debug``: where the host is read);
   CUDA graphs (``mode="reduce-overhead"``) through ``compile(harden(m))`` and the backend
   against inductor's own (``cuda_graphs``).

    PYTHONPATH=. python benchmarks/gpu_check.py [--json out.json] [--no-compile] [--sections a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time

import torch

import nanpass
from nanpass._config import make_config
from nanpass._rewrite import make_guard
from nanpass._rules import RULES

DEV = "cuda"
CONFIG = make_config()


def _to_dev(args, kwargs):
    def mv(a):
        if isinstance(a, torch.Tensor):
            return a.detach().to(DEV).requires_grad_(a.requires_grad)
        return a

    return tuple(mv(a) for a in args), {k: mv(v) for k, v in kwargs.items()}


def _floats(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]


def _grads(fn, args, kwargs, upstream=None):
    torch.manual_seed(0)
    outs = _floats(fn(*args, **kwargs))
    leaves = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    ups = [torch.full_like(o, upstream) if upstream is not None else torch.ones_like(o) for o in outs]
    grads = torch.autograd.grad(outs, leaves, ups, allow_unused=True) if outs else []
    return outs, [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True)]


def contract() -> dict:
    res = {"checked": 0, "failures": []}
    for rule in RULES:
        if not rule.guarded or rule.sample is None:
            continue
        kind = "module" if rule.name == "multi_head_attention" else "function"
        sp = next(s for s in rule.spellings() if s.kind == kind)
        g = make_guard(rule, sp, CONFIG.consts(rule.name) if rule.constants else None)
        for dtype in rule.sample.dtypes:
            try:
                if sp.kind == "module":
                    torch.manual_seed(0)
                    mod = sp.target(*rule.sample.ctor[sp.name]).to(DEV, dtype)
                    guarded, original = (lambda *a, _g=g, _m=mod, **k: _g(_m, *a, **k)), mod
                else:
                    guarded, original = g, sp.call
                args, kwargs = _to_dev(*rule.sample.bad(dtype))
                outs, grads = _grads(guarded, args, kwargs)
                ok_bad = all(bool(torch.isfinite(t).all()) for t in outs + grads)
                args, kwargs = _to_dev(*rule.sample.good(dtype))
                ref, rgrads = _grads(original, args, kwargs)
                args, kwargs = _to_dev(*rule.sample.good(dtype))
                out, ograds = _grads(guarded, args, kwargs)
                ok_good = all(torch.equal(a, b) for a, b in zip(ref + rgrads, out + ograds, strict=True))
                args, kwargs = _to_dev(*rule.sample.good(dtype))
                _, up_ref = _grads(original, args, kwargs, upstream=float("inf"))
                args, kwargs = _to_dev(*rule.sample.good(dtype))
                _, up = _grads(guarded, args, kwargs, upstream=float("inf"))
                ok_up = all(torch.equal(~torch.isfinite(a), ~torch.isfinite(b)) for a, b in zip(up_ref, up, strict=True))
                res["checked"] += 1
                if not (ok_bad and ok_good and ok_up):
                    res["failures"].append(f"{rule.name} {dtype}: finite on bad {ok_bad}, bitwise on good "
                                           f"{ok_good}, upstream inf passes {ok_up}")
            except Exception as e:  # noqa: BLE001 - a kernel torch lacks on CUDA is reported, not fatal
                res["failures"].append(f"{rule.name} {dtype}: raised {type(e).__name__}: {str(e)[:120]}")
    return res


def gpt2():
    import transformers

    cfg = transformers.GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(DEV)


def _step(model, ids, autocast):
    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return step


def _time(fns: dict, repeats=10) -> dict:
    for fn in fns.values():
        fn()
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


class NullMode(torch.overrides.TorchFunctionMode):
    """A mode whose handler only calls the function: the floor of any design that runs
    Python for each torch call (issue 38 item 2)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _null(step):
    def run():
        with NullMode():
            step()

    return run


def step_times(compile_too: bool) -> dict:
    """Eager train steps: plain, harden (the swap: ``interception == "swap"``), harden under
    the mode (``fast=False``), and the null mode, interleaved; at 8 x 512 and, in bfloat16,
    8 x 1024."""
    model = gpt2()
    safe, mode = nanpass.harden(model), nanpass.harden(model, fast=False)
    out = {}
    for autocast, seq in ((None, 512), (torch.bfloat16, 512), (torch.float16, 512), (torch.bfloat16, 1024)):
        ids = torch.randint(0, 50257, (8, seq), device=DEV)
        t = _time({"plain": _step(model, ids, autocast), "nanpass": _step(safe, ids, autocast),
                   "mode": _step(mode, ids, autocast), "null": _null(_step(model, ids, autocast))})
        key = (f"{str(autocast)[6:]} autocast" if autocast else "float32") + f" 8x{seq}"
        out[key] = {"plain_ms": t["plain"], "nanpass_ms": t["nanpass"], "ratio": t["nanpass"] / t["plain"],
                    "fast_false_ratio": t["mode"] / t["plain"], "null_mode_ratio": t["null"] / t["plain"],
                    "interception": safe.interception,
                    "peak_mib_plain": _peak(_step(model, ids, autocast)),
                    "peak_mib_nanpass": _peak(_step(safe, ids, autocast))}
        print(f"GPT-2 12L 768 train step, {key}: {out[key]}", flush=True)
    if compile_too:
        torch._dynamo.reset()
        ind = torch.compile(model)
        npb = torch.compile(model, backend=nanpass.backend())
        hard = torch.compile(nanpass.harden(model))
        t = _time({"inductor": _step(ind, ids, None), "nanpass": _step(npb, ids, None),
                   "harden": _step(hard, ids, None)}, repeats=10)
        out["compiled float32"] = {"inductor_ms": t["inductor"], "nanpass_ms": t["nanpass"],
                                   "ratio": t["nanpass"] / t["inductor"],
                                   "compiled_harden_ms": t["harden"],
                                   "compiled_harden_ratio": t["harden"] / t["inductor"]}
        # where eager is launch-bound (autocast), compiling the hardened model traces the
        # mode away: nothing per call is left
        torch._dynamo.reset()
        ind, hard = torch.compile(model), torch.compile(nanpass.harden(model))
        t = _time({"inductor": _step(ind, ids, torch.bfloat16), "harden": _step(hard, ids, torch.bfloat16)})
        out["compiled bfloat16 autocast"] = {"inductor_ms": t["inductor"], "compiled_harden_ms": t["harden"],
                                             "compiled_harden_ratio": t["harden"] / t["inductor"]}
    return out


def check_rows() -> dict:
    """Check mode and ``torch.autograd.detect_anomaly`` beside the plain step (issue 38)."""
    model = gpt2()
    check = nanpass.harden(model, mode="check")
    ids = torch.randint(0, 50257, (8, 512), device=DEV)

    def anomaly(autocast):
        step = _step(model, ids, autocast)

        def run():
            with torch.autograd.detect_anomaly(check_nan=True):
                step()

        return run

    out = {}
    for autocast in (None, torch.bfloat16):
        t = _time({"plain": _step(model, ids, autocast), "check": _step(check, ids, autocast),
                   "detect_anomaly": anomaly(autocast)}, repeats=5)
        key = f"{str(autocast)[6:]} autocast" if autocast else "float32"
        out[key] = {**{f"{k}_ms": v for k, v in t.items()}, "check_ratio": t["check"] / t["plain"],
                    "anomaly_ratio": t["detect_anomaly"] / t["plain"],
                    **_enable_ratio(model, ids, autocast)}
    # compiled check mode: a scalar per new value inside the graph, read once after it
    torch._dynamo.reset()
    ind, chk = torch.compile(model), torch.compile(nanpass.harden(model, mode="check"))
    t = _time({"inductor": _step(ind, ids, None), "check": _step(chk, ids, None)}, repeats=5)
    out["compiled float32"] = {"inductor_ms": t["inductor"], "compiled_check_ms": t["check"],
                               "compiled_check_ratio": t["check"] / t["inductor"]}
    return out


def _enable_ratio(model, ids, autocast, blocks: int = 3, steps: int = 5) -> dict:
    """``nanpass.enable("check")`` (what ``nanpass run`` runs) beside the plain step, in blocks
    of ``steps`` timed steps inside one enable (its first steps check every op), alternated."""
    step = _step(model, ids, autocast)
    times = {"plain": [], "enable": []}
    for _ in range(blocks):
        for kind in ("plain", "enable"):
            ctx = nanpass.enable("check") if kind == "enable" else contextlib.nullcontext()
            with ctx:
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
                times[kind].append((time.perf_counter() - t) / steps * 1e3)
    plain, enabled = statistics.median(times["plain"]), statistics.median(times["enable"])
    return {"enable_ms": enabled, "enable_ratio": enabled / plain}


def sync_debug() -> dict:
    """Host reads a bfloat16 training step makes, counted under
    ``torch.cuda.set_sync_debug_mode("warn")`` (each read warns, with where) over three steps
    after two warm ones (the first checks every op and records the sites; the screen's first
    step reads its forward at once): harden reads none, check mode's screen one a step
    (issue 47), ``nanpass.enable`` two (when ``loss.backward()`` starts and before the step)."""
    import warnings

    model = gpt2()
    ids = torch.randint(0, 50257, (8, 512), device=DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = {}

    kinds = [("plain", model), ("harden", nanpass.harden(model, watch=None)),
             ("harden watch=100", nanpass.harden(model)),
             ("check", nanpass.harden(model, mode="check")),
             ("check every_op", nanpass.harden(model, mode="check", every_op=True))]
    for name, m in kinds:
        step = _step(m, ids, torch.bfloat16)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(3):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        reads = [w for w in caught if "synchroniz" in str(w.message)]
        out[name] = f"{len(reads) / 3:g} host reads a step" + (
            f" (first: {str(reads[0].message).splitlines()[0][:160]})" if reads else "")
    # nanpass.enable: steps 3-5 of a program (its first calls check every op)
    step = _step(model, ids, torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught, nanpass.enable("check"):
        warnings.simplefilter("always")
        for k in range(5):
            if k == 2:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
                caught.clear()
            step()
            opt.step()
        torch.cuda.set_sync_debug_mode(0)
    reads = [w for w in caught if "synchroniz" in str(w.message)]
    out["nanpass.enable check"] = f"{len(reads) / 3:g} host reads a step"
    return out


def cuda_graph_rows() -> dict:
    """CUDA graphs (inductor's mode="reduce-overhead") with nanpass and without, bfloat16
    autocast at 4 x 256, where a step is launch-bound: recorded once, replayed each step."""
    from torch._dynamo.utils import counters

    model = gpt2()
    ids = torch.randint(0, 50257, (4, 256), device=DEV)

    def step_of(m):
        inner = _step(m, ids, torch.bfloat16)

        def run():
            torch.compiler.cudagraph_mark_step_begin()
            inner()

        return run

    if "nanpass" not in torch._dynamo.list_backends():  # run from a checkout (PYTHONPATH=.): no entry point
        from nanpass._backend import nanpass_backend

        torch._dynamo.register_backend(nanpass_backend, name="nanpass")
    torch._dynamo.reset()
    counters.clear()
    fns = {"inductor": step_of(torch.compile(model, mode="reduce-overhead")),
           "harden": step_of(torch.compile(nanpass.harden(model), mode="reduce-overhead")),
           "backend": step_of(torch.compile(model, backend="nanpass", mode="reduce-overhead"))}
    t = _time(fns, repeats=20)
    return {**{f"{k}_ms": v for k, v in t.items()},
            "harden_ratio": t["harden"] / t["inductor"], "backend_ratio": t["backend"] / t["inductor"],
            "cudagraph_skips": dict(counters["inductor"]).get("cudagraph_skips", 0),
            "inductor counters": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}}


def grad_scaler() -> dict:
    class Region(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x):
            with torch.autocast(DEV, dtype=torch.float16):
                h = self.fc(x)
                h = torch.log(h.abs() + 1) * torch.sqrt(h * h + 1)
                return self.head(h).float().sum()

    def run(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(DEV, init_scale=2.0**20, growth_interval=5)
        g = torch.Generator(device=DEV).manual_seed(0)
        scales = []
        for _ in range(50):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(32, 64, device=DEV, generator=g)
            scaler.scale(model(x)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    torch.manual_seed(0)
    plain = Region().to(DEV)
    safe = nanpass.harden(copy.deepcopy(plain))
    a, b = run(plain), run(safe)
    return {"same_trajectory": a == b, "distinct_scales": sorted(set(a)), "nanpass_distinct": sorted(set(b))}


SECTIONS = ("steps", "sync_debug", "check", "cuda_graphs", "contract", "grad_scaler")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of: {', '.join(SECTIONS)}")
    args = ap.parse_args()
    wanted = [x for x in args.sections.split(",") if x]
    unknown = [x for x in wanted if x not in SECTIONS]
    if unknown:
        ap.error(f"unknown section {unknown[0]!r}; valid: {', '.join(SECTIONS)}")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(f"{res['device']}, torch {res['torch']}", flush=True)
    for name in wanted:
        t0 = time.perf_counter()
        if name == "contract":
            res["contract"] = contract()
            print(f"contract on CUDA: {res['contract']['checked']} rule x dtype cases, "
                  f"{len(res['contract']['failures'])} failures", flush=True)
            for f in res["contract"]["failures"]:
                print("  ", f, flush=True)
        elif name == "grad_scaler":
            res["grad_scaler"] = grad_scaler()
            print("GradScaler float16 autocast:", res["grad_scaler"], flush=True)
        elif name == "steps":
            res["gpt2"] = step_times(not args.no_compile)
            for k, v in res["gpt2"].items():
                if k.startswith("compiled"):
                    print(f"GPT-2 12L 768 train step, {k}: {v}", flush=True)
        else:
            res[name] = {"check": check_rows, "sync_debug": sync_debug, "cuda_graphs": cuda_graph_rows}[name]()
            for k, v in res[name].items():
                print(f"{name}, {k}: {v}", flush=True)
        print(f"  ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        if args.json:  # after each section: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2, default=str)


if __name__ == "__main__":
    main()
