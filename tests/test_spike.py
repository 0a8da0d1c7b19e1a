"""SpikeGuard (issue 22): a loss spike is detected with one read per step, the guard rewinds in
memory and skips the batch, the run ends bitwise where a run that never saw the batch ends; a
re-run tells a transient fault from a reproducible one; every rank of a DDP job agrees."""

from __future__ import annotations

import functools
import io
import json
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import nanpass
from tests.helpers import run_two_ranks

N, B, SPIKE = 240, 8, 13  # 30 batches of 8; batch 13 is the spiking one


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: a second intra-op thread only waits, badly so on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dataset(spike: int | None = SPIKE, scale: float = 1e3):
    """Sample index, x, y of a regression; batch ``spike`` scaled by ``scale`` (finite)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    if spike is not None:
        rows = slice(spike * B, (spike + 1) * B)
        x[rows] *= scale
        y[rows] *= scale
    return TensorDataset(torch.arange(N), x, y)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))


def parts(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.05 * s))


def batches(ds):
    return BatchSampler(SequentialSampler(ds), B, drop_last=False)


@functools.cache  # several tests compare with the same reference run
def run_clean(drop=(), ds=None, forward_only=()):
    """The reference: plain optimizer and scheduler, the batches in ``drop`` never seen, those in
    ``forward_only`` seen by the forward (dropout draws its mask) but never stepped on."""
    model = mlp()
    opt, sched = parts(model)
    ds = ds if ds is not None else dataset(spike=None)
    kept = [b for b in batches(ds) if b[0] // B not in drop]
    torch.manual_seed(1)  # dropout (and the loader's base seed, drawn as the guarded run draws it)
    for idx, x, y in DataLoader(ds, batch_sampler=kept):
        if int(idx[0]) // B in forward_only:
            model(x)
            continue
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()
    return model


def run_guarded(ds=None, hook=None, **options):
    model = mlp()
    opt, sched = parts(model)
    ds = ds if ds is not None else dataset()
    options = {"every": 5, "keep": 2, "window": 8, "scheduler": sched, **options}
    guard = nanpass.SpikeGuard(opt, model, **options)
    loader = DataLoader(ds, batch_sampler=nanpass.SkipSampler(batches(ds), guard))
    torch.manual_seed(1)
    if hook is not None:
        model[0].register_forward_hook(hook)
    for idx, x, y in loader:
        def forward_backward(x=x, y=y):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        opt.zero_grad()
        loss = forward_backward()
        guard.step(loss=loss, batch=idx, closure=forward_backward if guard.rerun else None)
    return model, guard


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def ids(batch: int) -> tuple:
    return tuple(range(batch * B, (batch + 1) * B))


# ---------------------------------------------------------------- detect, rewind, skip


def test_spike_rewinds_replays_and_ends_bitwise_on_the_run_that_never_saw_the_batch():
    model, guard = run_guarded()
    assert guard.rewinds == 1
    rewound, skipped = guard.events
    assert rewound["action"] == "rewound" and (rewound["position"], rewound["to"]) == (SPIKE, 10)
    assert rewound["reason"].startswith("loss spike: ")
    assert skipped["action"] == "skipped" and skipped["batch"] == ids(SPIKE) and skipped["step"] == SPIKE
    assert guard.skip_batches == [ids(SPIKE)]
    assert guard.position == 29 and guard.taken == 29 + 3  # batches 10-12 applied twice
    # dropout RNG, AdamW state and the LR schedule all rewound with the weights
    assert same(model, run_clean(drop=(SPIKE,)))
    assert not same(model, run_clean())  # the spike did matter


def test_skip_window_drops_every_batch_since_the_snapshot_as_palm_does():
    model, guard = run_guarded(skip="window")
    assert guard.skip_batches == [ids(SPIKE), ids(10), ids(11), ids(12)]
    assert all(e["reason"] for e in guard.events)
    assert same(model, run_clean(drop=(10, 11, 12, SPIKE)))


def test_a_non_finite_loss_is_skipped_without_a_rewind_and_recorded():
    ds = dataset(spike=SPIKE, scale=float("inf"))
    model, guard = run_guarded(ds=ds)
    assert guard.rewinds == 0 and guard.skipped == 1
    (event,) = guard.events
    assert event["batch"] == ids(SPIKE) and event["reason"].startswith("non-finite loss")
    # no rewind, so the skipped forward's dropout draw stays drawn, as under StepGuard
    assert same(model, run_clean(forward_only=(SPIKE,)))


def test_a_gradient_norm_spike_alone_rewinds_with_grad_factor():
    # a spike of 30x in x and y: loss x900, gradient norm far above 4 x median; the loss check
    # is made blind (factor 1e9) so only the gradient check can fire
    model, guard = run_guarded(ds=dataset(scale=30.0), factor=1e9, grad_factor=4.0)
    assert guard.rewinds == 1
    assert guard.events[0]["reason"].startswith("gradient-norm spike: ")
    assert same(model, run_clean(drop=(SPIKE,)))


def test_a_second_spike_skips_the_window_and_a_third_goes_further_back_until_none_is_left():
    # every batch from SPIKE on spikes: the level moved, and rewinding cannot help
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    x[SPIKE * B:] *= 1e3
    y[SPIKE * B:] *= 1e3
    with pytest.raises(nanpass.SpikeError, match=r"^nanpass: loss spike.*every kept snapshot \(keep=2\)"):
        run_guarded(ds=TensorDataset(torch.arange(N), x, y))


@pytest.mark.parametrize("rerun", [False, True])
def test_a_gradscaler_is_snapshotted_and_rewound_with_the_weights(rerun):
    """The scale grows every 2 steps here, so a rewind that forgot it would scale differently
    from the run without the batch (and the re-run must unscale its own gradients)."""

    def run(ds, guarded, drop=()):
        model = mlp()
        opt, sched = parts(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        guard = nanpass.SpikeGuard(opt, model, every=5, window=8, rerun=rerun, scheduler=sched,
                                   scaler=scaler) if guarded else None
        order = [b for b in batches(ds) if b[0] // B not in drop]
        loader = DataLoader(ds, batch_sampler=nanpass.SkipSampler(order, guard) if guarded else order)
        torch.manual_seed(1)
        for idx, x, y in loader:
            def forward_backward(x=x, y=y):
                loss = ((model(x) - y) ** 2).mean()
                scaler.scale(loss).backward()
                return loss

            opt.zero_grad()
            loss = forward_backward()
            if guarded:
                guard.step(loss=loss, batch=idx, closure=forward_backward if rerun else None)
            else:
                scaler.step(opt)
                scaler.update()
                sched.step()
        return model, guard, scaler

    model, guard, scaler = run(dataset(), True)
    assert guard.rewinds == 1 and guard.skip_batches == [ids(SPIKE)]
    clean, _, clean_scaler = run(dataset(spike=None), False, drop=(SPIKE,))
    assert scaler.get_scale() == clean_scaler.get_scale()
    assert same(model, clean)


# ---------------------------------------------------------------- classify


def test_rerun_calls_a_one_off_activation_fault_transient_and_keeps_the_batch():
    calls = []

    def poison_once(module, args, out):
        calls.append(None)
        if len(calls) == SPIKE + 1:  # the first forward of batch SPIKE only: finite, x1e3
            return out * 1e3

    model, guard = run_guarded(ds=dataset(spike=None), hook=poison_once, rerun=True)
    assert len(calls) == 30 + 1  # one re-run
    (event,) = guard.events
    assert (event["action"], event["classification"]) == ("kept", "transient")
    assert "possible hardware fault" in event["reason"] and event["batch"] == ids(SPIKE)
    assert guard.skip_batches == [] and guard.rewinds == 0
    assert same(model, run_clean())  # as if the fault never happened


def test_rerun_calls_a_poisoned_batch_reproducible_and_quarantines_it():
    model, guard = run_guarded(rerun=True)
    rewound, skipped = guard.events
    assert rewound["classification"] == skipped["classification"] == "reproducible"
    assert skipped["batch"] == ids(SPIKE) and skipped["reason"].startswith("reproducible: loss spike")
    assert guard.skip_batches == [ids(SPIKE)]
    assert same(model, run_clean(drop=(SPIKE,)))


# ---------------------------------------------------------------- cost, state, log


def test_one_host_read_per_step_and_none_extra_when_nothing_fires(monkeypatch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)  # Adam reads its own step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.05 * s))
    ds = dataset(spike=None)
    guard = nanpass.SpikeGuard(opt, model, every=4, window=8, grad_factor=10.0, scheduler=sched)
    steps = list(batches(ds))
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for b in steps:
        idx, x, y = ds[b]
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        assert guard.step(loss=loss, batch=idx)
    monkeypatch.undo()
    assert reads == ["tolist"] * len(steps), reads  # snapshots (every 4) read nothing either
    assert guard.events == []


def test_snapshot_round_trips_through_the_distributed_checkpoint_helpers():
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model = mlp()
    opt, sched = parts(model)
    ds = dataset(spike=None)
    guard = nanpass.SpikeGuard(opt, model, every=5, keep=2, scheduler=sched)
    for i, b in enumerate(batches(ds)):
        idx, x, y = ds[b]
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        guard.step(batch=idx)
        if i == 24:  # position 25: the older of the two kept snapshots
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            moments = [{k: t.clone() for k, t in s.items()} for s in opt.state.values()]
            lr = sched.get_last_lr()
    assert guard.snapshot_bytes == 3 * sum(p.numel() * 4 for p in model.parameters()) + 4 * 4
    buf = io.BytesIO()
    torch.save(guard.snapshot_state_dict(0), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert saved["position"] == 25
    plain = mlp()
    set_model_state_dict(plain, saved["model"])  # the helpers' own format
    assert all(torch.equal(v, weights[k]) for k, v in plain.state_dict().items())
    fresh = mlp()
    fopt, fsched = parts(fresh)
    nanpass.SpikeGuard(fopt, fresh, scheduler=fsched).load_snapshot(saved)
    assert all(torch.equal(v, weights[k]) for k, v in fresh.state_dict().items())
    assert fsched.get_last_lr() == lr
    for got, want in zip(fopt.state.values(), moments, strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_events_go_to_a_json_lines_log(tmp_path):
    path = tmp_path / "spikes.jsonl"
    _, guard = run_guarded(log=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["action"] for line in lines] == ["rewound", "skipped"]
    assert lines[1]["batch"] == list(ids(SPIKE)) and lines[1]["step"] == SPIKE


def test_guarded_optimizer_with_spike_rewinds_through_the_closure():
    model = mlp()
    inner, sched = parts(model)
    guarded = nanpass.GuardedOptimizer(inner, model=model, spike={"every": 5, "window": 8})
    gated = guarded.gate(sched)
    ds = dataset()
    loader = DataLoader(ds, batch_sampler=nanpass.SkipSampler(batches(ds), guarded))
    torch.manual_seed(1)
    for idx, x, y in loader:
        def closure(x=x, y=y):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        guarded.zero_grad()
        guarded.record(batch=idx)
        guarded.step(closure)  # as Lightning calls it: the closure's loss is the one checked
        gated.step()
    assert guarded.guard.rewinds == 1 and guarded.guard.skip_batches == [ids(SPIKE)]
    assert same(model, run_clean(drop=(SPIKE,)))


# ---------------------------------------------------------------- bad options


@pytest.mark.parametrize("option, value", [
    ("factor", 1), ("factor", 0.5), ("factor", float("inf")), ("every", 0), ("keep", 0),
    ("window", 1), ("warmup", 0), ("warmup", 65), ("grad_factor", 1.0), ("skip", "both"),
    ("snapshot_device", "gpu0"),
])
def test_bad_options_are_config_errors_naming_the_value(option, value):
    model = mlp()
    with pytest.raises(nanpass.ConfigError) as e:
        nanpass.SpikeGuard(torch.optim.SGD(model.parameters(), lr=0.1), model, **{option: value})
    msg = str(e.value)
    assert msg.startswith(f"nanpass: SpikeGuard {option}={value!r}") and "valid:" in msg


@pytest.mark.parametrize("option, value", [("factor", "4"), ("every", 2.5), ("rerun", 1)])
def test_options_of_the_wrong_type_are_type_errors(option, value):
    model = mlp()
    with pytest.raises(nanpass.NanpassTypeError, match=rf"^nanpass: SpikeGuard {option}="):
        nanpass.SpikeGuard(torch.optim.SGD(model.parameters(), lr=0.1), model, **{option: value})


def test_misuse_is_a_nanpass_error():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanpass.NanpassTypeError, match="^nanpass: SpikeGuard model="):
        nanpass.SpikeGuard(opt, None)
    guard = nanpass.SpikeGuard(opt, model, rerun=True)
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: SpikeGuard\(rerun=True\).step\(\) needs closure"):
        guard.step(loss=torch.tensor(1.0))
    with pytest.raises(nanpass.NanpassTypeError, match="^nanpass: SkipSampler guard="):
        nanpass.SkipSampler([[0]], nanpass.StepGuard(opt))
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: GuardedOptimizer\(spike=...\) needs model="):
        nanpass.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), spike=True)
    with pytest.raises(nanpass.NanpassTypeError, match="^nanpass: GuardedOptimizer spike= has unexpected"):
        nanpass.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                 spike={"factr": 3})


# ---------------------------------------------------------------- slow tier: GPT-2, DDP, frameworks


def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_run(spike: int | None, guard_options: dict | None, drop=(), steps: int = 20):
    """Next-token training of a tiny GPT-2 (dropout on) on 4 x 32 token batches; batch ``spike``
    has its loss scaled by 1e3 (a mis-weighted batch: finite everywhere). Returns the model, the
    guard and the loss of every step call."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (steps * 4, 32), generator=g)
    weight = torch.ones(steps * 4)
    if spike is not None:
        weight[spike * 4:(spike + 1) * 4] = 1e3
    ds = TensorDataset(torch.arange(steps * 4), tokens, weight)
    order = [b for b in BatchSampler(SequentialSampler(ds), 4, False) if b[0] // 4 not in drop]
    guard = None
    if guard_options is not None:
        guard = nanpass.SpikeGuard(opt, model, scheduler=sched, **guard_options)
        order = nanpass.SkipSampler(order, guard)
    losses = []
    torch.manual_seed(1)
    for idx, ids_, w in DataLoader(ds, batch_sampler=order):
        opt.zero_grad()
        loss = model(input_ids=ids_, labels=ids_).loss * w.mean()
        loss.backward()
        losses.append(float(loss.detach()))
        if guard is None:
            opt.step()
            sched.step()
        else:
            guard.step(loss=loss, batch=idx)
    return model, guard, losses


@pytest.mark.slow
def test_gpt2_spike_rewinds_skips_and_ends_bitwise_on_the_run_without_the_batch():
    model, guard, _ = gpt2_run(11, {"every": 4, "window": 6, "keep": 2})
    assert guard.rewinds == 1 and guard.skip_batches == [tuple(range(44, 48))]
    assert [e["action"] for e in guard.events] == ["rewound", "skipped"]
    assert guard.events[0]["to"] == 8 and guard.position == 19
    clean, _, _ = gpt2_run(None, None, drop=(11,))
    assert same(model, clean)
    unguarded, _, _ = gpt2_run(11, None)
    assert not same(unguarded, clean)


def _ddp_train(rank: int, mode: str, guarded: bool, drop=()):
    """Each rank trains on its own 20 batches; rank 1's batch 9 is scaled by 1e3."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(160, 16, generator=g)
    y = x.sum(1, keepdim=True)
    if guarded and rank == 1:
        x[72:80] *= 1e3
        y[72:80] *= 1e3
    ds = TensorDataset(torch.arange(160), x, y)
    order = [b for b in BatchSampler(SequentialSampler(ds), 8, False) if b[0] // 8 not in drop]
    guard = None
    if guarded:
        guard = nanpass.SpikeGuard(opt, model, every=4, window=6)
        order = nanpass.SkipSampler(order, guard)
    for idx, xb, yb in DataLoader(ds, batch_sampler=order):
        opt.zero_grad()
        loss = ((wrapped(xb) - yb) ** 2).mean()
        loss.backward()
        if guard is None:
            opt.step()
        else:
            guard.step(loss=loss, batch=idx)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
             for k, v in model.state_dict().items()}
    dist.barrier()
    return state, guard


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, mode: str):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        state, guard = _ddp_train(rank, mode, guarded=True)
        clean, _ = _ddp_train(rank, mode, guarded=False, drop=(9,))
        torch.save({"state": state, "clean": clean, "events": guard.events, "position": guard.position,
                    "skip": guard.skip_batches}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort at interpreter teardown (see test_distributed.py)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ddp_every_rank_rewinds_together_and_the_weights_agree(tmp_path, mode):
    run_two_ranks(_ddp_worker, tmp_path, mode)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for r, res in enumerate((r0, r1)):
        rewound = [e for e in res["events"] if e["action"] == "rewound"]
        assert [(e["step"], e["position"], e["to"], e["rank"]) for e in rewound] == [(9, 9, 8, r)]
        assert res["position"] == 19
        assert res["skip"] == [tuple(range(72, 80))]  # each rank skips its own batch 9
    assert "another rank" in r0["events"][0]["reason"] and r1["events"][0]["reason"].startswith("loss spike")
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k  # the ranks agree, bit for bit
        assert torch.equal(v, r0["clean"][k]), k  # and equal the run without batch 9


class Applied:
    """The batches in the final trajectory of a framework run: appended on a taken step, cut
    back to the restored position on a rewind (frameworks fetch a batch ahead, so the replayed
    batches come after the prefetched one: the order is the framework's, not the sampler's)."""

    def __init__(self):
        self.order: list[int] = []
        self.rewinds = 0

    def after_step(self, guarded, idx):
        guard = guarded.guard
        if guard.rewinds > self.rewinds:
            self.rewinds = guard.rewinds
            del self.order[guard.position:]
        elif guarded.last_step_taken:
            self.order.append(int(idx[0]) // B)


def plain_reference(order: list[int]):
    """A plain loop over ``order`` (batch numbers) with the same model, optimizer and schedule."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    opt, sched = parts(model)
    ds = dataset()
    for k in order:
        _, x, y = ds[list(range(k * B, (k + 1) * B))]
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()
    return model


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")
@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_lightning_through_guarded_optimizer_rewinds_and_replays():
    L = pytest.importorskip("lightning.pytorch")
    applied = Applied()

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            self.guarded.record(batch=idx)
            return ((self.lin(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return {"optimizer": self.guarded, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            applied.after_step(self.guarded, batch[0])

    torch.manual_seed(0)
    module = Regression()
    opt, sched = parts(module)  # built before fit: the loader's SkipSampler needs the guard
    module.guarded = nanpass.GuardedOptimizer(opt, model=module, spike={"every": 5, "window": 8})
    module.sched = module.guarded.gate(sched)
    ds = dataset()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
    # sized=False: Lightning runs the epoch until the sampler is exhausted, replays included
    trainer.fit(module, DataLoader(ds, batch_sampler=nanpass.SkipSampler(batches(ds), module.guarded,
                                                                         sized=False)))
    guard = module.guarded.guard
    assert guard.rewinds == 1 and guard.skip_batches == [ids(SPIKE)]
    assert SPIKE not in applied.order and sorted(applied.order) == [k for k in range(30) if k != SPIKE]
    assert all(torch.equal(a, b) for a, b in zip(module.lin.parameters(), plain_reference(applied.order).parameters(),
                                                  strict=True))


@pytest.mark.slow
def test_hf_trainer_through_guarded_optimizer_and_record_rewinds_and_replays(tmp_path):
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    applied = Applied()

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 1)

        def forward(self, idx, x, y):
            return {"loss": ((self.lin(x) - y) ** 2).mean()}

    class Rows(torch.utils.data.Dataset):
        def __init__(self, ds):
            self.ds = ds

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            idx, x, y = self.ds[i]
            return {"idx": idx, "x": x, "y": y}

    class Guarded(transformers.Trainer):
        def get_train_dataloader(self):
            loader = DataLoader(self.train_dataset, collate_fn=transformers.default_data_collator,
                                batch_sampler=nanpass.SkipSampler(batches(ds), guarded, sized=False))
            return self.accelerator.prepare(loader)

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            guarded.record(loss=loss, batch=inputs["idx"])  # the Trainer's step() has no closure
            self.last_idx = inputs["idx"]
            return loss

    class Track(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            applied.after_step(guarded, trainer.last_idx)

    torch.manual_seed(0)
    model = Regression()
    opt, sched = parts(model)
    guarded = nanpass.GuardedOptimizer(opt, model=model, spike={"every": 5, "window": 8})
    ds = dataset()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=33, max_grad_norm=0.0,
        save_strategy="no", logging_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    trainer = Guarded(model=model, args=args, train_dataset=Rows(ds), optimizers=(guarded, guarded.gate(sched)),
                      callbacks=[Track()])
    trainer.train()
    guard = guarded.guard
    assert guard.rewinds == 1 and guard.skip_batches == [ids(SPIKE)]
    assert sorted(applied.order) == [k for k in range(30) if k != SPIKE]  # 33 steps: 29 + 1 skipped + 3 replayed
    assert all(torch.equal(a, b) for a, b in zip(model.lin.parameters(), plain_reference(applied.order).parameters(),
                                                  strict=True))
