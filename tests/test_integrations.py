"""StepGuard in loops that a framework owns: nanpass.GuardedOptimizer (an optimizer whose step()
is the guard's) and guarded.gate(scheduler) (a scheduler that advances only after a taken step),
in real CPU training runs of transformers.Trainer and PyTorch Lightning with a poisoned batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nanpass

N_FEATURES = 4

# lightning 2.6 on torch 2.13: a deprecation inside lightning's own pytree helper
pytestmark = pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")


def data(n: int, poison: tuple[int, ...] = ()):
    """n samples of a regression; each sample index in ``poison`` gets a NaN feature."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, N_FEATURES, generator=g)
    y = torch.randn(n, 1, generator=g)
    for i in poison:
        x[i, 0] = float("nan")
    return x, y


def without(x: torch.Tensor, y: torch.Tensor, rows: range):
    keep = [i for i in range(len(x)) if i not in rows]
    return x[keep], y[keep]


def decay(step: int) -> float:
    return 1.0 / (1 + step)


def guarded_pair(model: nn.Module, lr: float = 0.1, **options):
    opt = nanpass.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr), model=model, **options)
    return opt, opt.gate(torch.optim.lr_scheduler.LambdaLR(opt, decay))


def unchanged_across(snaps: list[torch.Tensor]) -> list[bool]:
    """For each step after the first snapshot: were the weights bit-identical across it?"""
    return [bool(torch.equal(a, b)) for a, b in zip(snaps, snaps[1:], strict=False)]


# ---------------------------------------------------------------- the wrapper on its own


def test_guarded_optimizer_in_a_plain_loop_skips_and_the_gate_holds_the_schedule():
    torch.manual_seed(0)
    model = nn.Linear(N_FEATURES, 1)
    opt, sched = guarded_pair(model)
    x, y = data(6, poison=(2,))
    lrs, weights = [], []
    for i in range(6):
        opt.zero_grad()
        ((model(x[i:i + 1]) - y[i:i + 1]) ** 2).mean().backward()
        opt.step()
        assert opt.last_step_taken is (i != 2)
        sched.step()
        lrs.append(sched.get_last_lr()[0])
        weights.append(model.weight.detach().clone())
    assert (opt.taken, opt.skipped, sched.held) == (5, 1, 1)
    assert sched.last_epoch == 5 and sched.scheduler.last_epoch == 5
    assert lrs == pytest.approx([0.1 * decay(s) for s in (1, 2, 2, 3, 4, 5)])
    assert unchanged_across(weights) == [False, True, False, False, False]
    assert "non-finite gradient in weight" in opt.last_skip_reason
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler) and sched.optimizer is opt


def test_step_runs_the_closure_first_and_checks_the_gradients_it_made():
    # Lightning hands optimizer.step a closure that zeroes, runs training_step and backward
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = nanpass.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()

    def closure(x):
        def run():
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss
        return run

    with torch.no_grad():  # the closure still gets gradients, as torch optimizers ensure
        loss = opt.step(closure(torch.tensor([[float("nan"), 1.0]])))
    assert torch.isnan(loss) and (opt.taken, opt.skipped) == (0, 1)
    assert torch.equal(model.weight, before)
    loss = opt.step(closure(torch.tensor([[1.0, 2.0]])))
    assert torch.isfinite(loss) and (opt.taken, opt.skipped) == (1, 1)
    assert torch.equal(model.weight, before - 0.1 * torch.tensor([[1.0, 2.0]]))


def test_state_dict_carries_the_counters_and_a_resumed_gate_still_steps():
    torch.manual_seed(0)
    model = nn.Linear(N_FEATURES, 1)
    opt, sched = guarded_pair(model, max_consecutive_skips=3)
    x, y = data(4, poison=(1, 3))
    for i in range(4):
        opt.zero_grad()
        ((model(x[i:i + 1]) - y[i:i + 1]) ** 2).mean().backward()
        opt.step()
        sched.step()
    state = opt.state_dict()
    assert state["nanpass_guard"]["taken"] == 2 and state["nanpass_guard"]["skipped"] == 2
    assert set(state) == {"state", "param_groups", "nanpass_guard"}

    restored, rsched = guarded_pair(model)
    rsched.load_state_dict(sched.state_dict())
    restored.load_state_dict(copy.deepcopy(state))
    assert (restored.taken, restored.skipped, restored.consecutive) == (2, 2, 1)
    assert restored.guard.max_consecutive_skips == 3  # the saved policy
    assert restored.optimizer.state_dict()["state"][0]["step"] == 2
    # after the load the gate still advances on the next taken step, and only then
    restored.zero_grad()
    model(x[:1]).sum().backward()
    restored.step()
    rsched.step()
    assert rsched.last_epoch == 3 and rsched.held == 0
    # a plain optimizer state dict loads too, and leaves the counters alone
    restored.load_state_dict(torch.optim.AdamW(model.parameters(), lr=0.1).state_dict())
    assert (restored.taken, restored.skipped) == (3, 2)
    # a rejected guard state changes neither the guard nor the optimizer
    bad = copy.deepcopy(state)
    bad["nanpass_guard"]["taken"] = -1
    with pytest.raises(nanpass.ConfigError, match="^nanpass: .*taken=-1"):
        restored.load_state_dict(bad)
    assert (restored.taken, restored.skipped) == (3, 2)


def test_a_gradscaler_skips_overflow_itself_and_the_gate_holds_then_too():
    torch.manual_seed(0)
    model = nn.Linear(N_FEATURES, 1)
    opt, sched = guarded_pair(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = data(4, poison=(1,))
    for i in range(4):
        opt.zero_grad()
        scaler.scale(((model(x[i:i + 1]) - y[i:i + 1]) ** 2).mean()).backward()
        scaler.step(opt)  # unscales, and calls opt.step() only without an inf
        scaler.update()
        sched.step()
    assert (opt.taken, opt.skipped) == (3, 0)  # the overflow never reached the guard
    assert scaler.get_scale() == 2.0**7 and sched.last_epoch == 3 and sched.held == 1


def test_fused_optimizer_no_sync_path_settles_for_the_gate():
    # fused AdamW, max_consecutive_skips=None: the guard hands the verdict to the kernel and
    # reads nothing back; the gate settles the counters when the scheduler is stepped
    torch.manual_seed(0)
    model = nn.Linear(N_FEATURES, 1)
    opt = nanpass.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True),
                                   max_consecutive_skips=None)
    sched = opt.gate(torch.optim.lr_scheduler.LambdaLR(opt, decay))
    x, y = data(4, poison=(1,))
    weights = []
    for i in range(4):
        opt.zero_grad()
        ((model(x[i:i + 1]) - y[i:i + 1]) ** 2).mean().backward()
        opt.step()
        assert opt.last_step_taken is None
        sched.step()
        weights.append(model.weight.detach().clone())
    assert (opt.taken, opt.skipped, sched.last_epoch, sched.held) == (3, 1, 3, 1)
    assert unchanged_across(weights) == [True, False, False]


def test_bad_arguments_are_nanpass_errors():
    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (lambda: nanpass.GuardedOptimizer(model), nanpass.NanpassTypeError, "not an optimizer"),
        (lambda: nanpass.GuardedOptimizer([sgd, sgd]), nanpass.NanpassTypeError, "list of optimizers"),
        (lambda: nanpass.GuardedOptimizer(nanpass.GuardedOptimizer(sgd)), nanpass.ConfigError, "already guarded"),
        (lambda: nanpass.GuardedOptimizer(torch.optim.LBFGS(model.parameters())), nanpass.ConfigError, "LBFGS"),
        (lambda: nanpass.GuardedOptimizer(sgd, max_norm=0), nanpass.ConfigError, "max_norm=0"),
        (lambda: nanpass.GuardedOptimizer(sgd, clip=1.0), nanpass.NanpassTypeError, "unexpected option 'clip'"),
        (lambda: nanpass.GuardedOptimizer(sgd, scheduler=None), nanpass.ConfigError, "gate"),
        (lambda: nanpass.GuardedOptimizer(sgd, scaler=None), nanpass.ConfigError, "scaler.step"),
        (lambda: nanpass.GuardedOptimizer(sgd).gate(torch.optim.lr_scheduler.ReduceLROnPlateau(sgd)),
         nanpass.ConfigError, "ReduceLROnPlateau"),
        (lambda: nanpass.GuardedOptimizer(sgd).gate(torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD(model.parameters(), lr=0.1), decay)), nanpass.ConfigError, "neither"),
        (lambda: nanpass.GuardedOptimizer(sgd).gate(object()), nanpass.NanpassTypeError, "no step"),
        (lambda: nanpass.GuardedOptimizer(sgd).load_state_dict([1]), nanpass.NanpassTypeError, "list"),
    ]
    for make, error, words in cases:
        with pytest.raises(error, match=f"^nanpass: .*{words}"):
            make()
    g = nanpass.GuardedOptimizer(sgd)
    s = g.gate(torch.optim.lr_scheduler.LambdaLR(sgd, decay))
    assert g.gate(s) is s
    with pytest.raises(nanpass.ConfigError, match="^nanpass: .*another GuardedOptimizer"):
        nanpass.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).gate(s)


# ---------------------------------------------------------------- transformers.Trainer


def hf():
    pytest.importorskip("accelerate")
    return pytest.importorskip("transformers")


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(N_FEATURES, 1)

    def forward(self, x, y):
        return {"loss": ((self.lin(x) - y) ** 2).mean()}


class Samples(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def in_order(transformers):
    """A Trainer that reads the data in order (transformers 5 also has
    ``train_sampling_strategy="sequential"``; this works on 4.x too)."""

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def run_trainer(tmp_path, x, y, batch=2, scaler=None, **args):
    """One epoch of transformers.Trainer, in order; a snapshot of the weights after every
    optimizer step (on_step_end)."""
    transformers = hf()

    class Snapshots(transformers.TrainerCallback):
        def __init__(self):
            self.weights = []

        def on_step_end(self, args, state, control, model=None, **kw):
            self.weights.append(model.lin.weight.detach().clone())

    torch.manual_seed(0)
    model = Regression()
    opt, sched = guarded_pair(model)
    snaps = Snapshots()
    args = {"save_strategy": "no", "logging_strategy": "no", **args}
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=batch,
        num_train_epochs=1, disable_tqdm=True, **args)
    trainer = in_order(transformers)(model=model, args=targs, train_dataset=Samples(x, y),
                                   optimizers=(opt, sched), callbacks=[snaps])
    if scaler is not None:  # accelerate's fp16 path (GPU only) with a CPU GradScaler
        trainer.accelerator.scaler = scaler
    trainer.train()
    return model, opt, sched, snaps.weights, trainer


def test_trainer_skips_the_poisoned_step_and_holds_the_schedule(tmp_path):
    x, y = data(12, poison=(5,))  # batch 2 of 6
    model, opt, sched, snaps, trainer = run_trainer(tmp_path / "a", x, y, logging_strategy="steps",
                                                    logging_steps=1)
    assert trainer.state.global_step == 6
    assert (opt.taken, opt.skipped) == (5, 1)
    assert "non-finite gradient in lin.weight" in opt.last_skip_reason
    assert sched.last_epoch == 5 and sched.held == 1  # the Trainer stepped it 6 times
    # the rate the Trainer logged for each step: the skipped step 2 did not move it for step 3
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert logged == pytest.approx([0.1 * decay(s) for s in (0, 1, 2, 2, 3, 4)])
    assert unchanged_across(snaps) == [False, True, False, False, False]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the skip left no trace: the same as a run that never saw that batch
    ref, ref_opt, ref_sched, _, _ = run_trainer(tmp_path / "b", *without(x, y, range(4, 6)))
    assert (ref_opt.taken, ref_opt.skipped, ref_sched.last_epoch) == (5, 0, 5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(opt.optimizer.state_dict()["state"][0]["exp_avg_sq"],
                       ref_opt.optimizer.state_dict()["state"][0]["exp_avg_sq"])


def test_trainer_gradient_accumulation_counts_optimizer_steps(tmp_path):
    x, y = data(16, poison=(6,))  # 8 micro-batches, 4 optimizer steps; micro-batch 3 is step 1
    model, opt, sched, snaps, trainer = run_trainer(tmp_path, x, y, gradient_accumulation_steps=2)
    assert trainer.state.global_step == 4
    assert (opt.taken, opt.skipped) == (3, 1)
    assert sched.last_epoch == 3 and sched.held == 1
    assert unchanged_across(snaps) == [True, False, False]


def test_trainer_bf16_autocast(tmp_path):
    x, y = data(12, poison=(5,))
    model, opt, sched, snaps, trainer = run_trainer(tmp_path, x, y, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16"
    assert (opt.taken, opt.skipped, sched.last_epoch) == (5, 1, 5)
    assert unchanged_across(snaps) == [False, True, False, False, False]


def test_trainer_gradscaler_path(tmp_path):
    # accelerate's fp16 path: AcceleratedOptimizer.step calls scaler.step(guarded), which skips
    # an overflow without calling it, and the Trainer then holds the scheduler itself
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = data(12, poison=(5,))
    model, opt, sched, snaps, trainer = run_trainer(tmp_path, x, y, scaler=scaler, max_grad_norm=0.0)
    assert trainer.optimizer.scaler is scaler
    assert (opt.taken, opt.skipped) == (5, 0) and scaler.get_scale() == 2.0**7
    assert sched.last_epoch == 5
    assert unchanged_across(snaps) == [False, True, False, False, False]


def test_trainer_checkpoint_carries_the_counters(tmp_path):
    x, y = data(12, poison=(5,))
    _, opt, _, _, trainer = run_trainer(tmp_path, x, y, save_strategy="steps", save_steps=6)
    saved = torch.load(tmp_path / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert saved["nanpass_guard"]["taken"] == 5 and saved["nanpass_guard"]["skipped"] == 1
    fresh, _ = guarded_pair(Regression())
    fresh.load_state_dict(saved)
    assert (fresh.taken, fresh.skipped) == (5, 1)


def test_trainer_with_a_gpt2_model_and_a_warmup_schedule(tmp_path):
    transformers = hf()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(8, 8, 16, generator=g)
    embeds[3, 2, 5] = float("nan")  # sample 3: batch 1 of 4
    labels = torch.randint(0, 32, (8, 8), generator=g)

    class Embedded(torch.utils.data.Dataset):
        def __len__(self):
            return len(embeds)

        def __getitem__(self, i):
            return {"inputs_embeds": embeds[i], "labels": labels[i]}

    opt = nanpass.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    sched = opt.gate(transformers.get_linear_schedule_with_warmup(opt, 2, 10))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=2,
        num_train_epochs=1, save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = in_order(transformers)(model=model, args=args, train_dataset=Embedded(),
                                   optimizers=(opt, sched))
    trainer.train()
    assert trainer.state.global_step == 4
    assert (opt.taken, opt.skipped, sched.last_epoch) == (3, 1, 3)
    assert opt.last_skip_reason.startswith("non-finite gradient in transformer.")
    assert sched.get_last_lr()[0] == pytest.approx(1e-3 * (10 - 3) / (10 - 2))
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------- PyTorch Lightning


def pl():
    return pytest.importorskip("lightning.pytorch")


def lightning_module(interval: str = "step"):
    L = pl()

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(N_FEATURES, 1)
            self.snaps: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.lin(x) - y) ** 2).mean()

        def configure_optimizers(self):
            self.guarded, self.sched = guarded_pair(self)
            return {"optimizer": self.guarded,
                    "lr_scheduler": {"scheduler": self.sched, "interval": interval}}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.snaps.append(self.lin.weight.detach().clone())

    torch.manual_seed(0)
    return Regression()


def run_lightning(x, y, module=None, batch=2, ckpt_path=None, **options):
    L = pl()
    module = module or lightning_module()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    options = {"max_epochs": 1, **options}
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **options)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize("clip", [None, 1.0])
def test_lightning_skips_the_poisoned_step_and_holds_the_schedule(clip):
    x, y = data(12, poison=(5,))  # batch 2 of 6
    m, trainer = run_lightning(x, y, gradient_clip_val=clip)
    assert trainer.global_step == 6
    assert (m.guarded.taken, m.guarded.skipped) == (5, 1)
    assert "non-finite gradient in lin.weight" in m.guarded.last_skip_reason
    assert m.sched.last_epoch == 5 and m.sched.held == 1  # Lightning stepped it 6 times
    assert unchanged_across(m.snaps) == [False, True, False, False, False]
    assert all(torch.isfinite(p).all() for p in m.parameters())
    ref, _ = run_lightning(*without(x, y, range(4, 6)), gradient_clip_val=clip)
    assert (ref.guarded.taken, ref.guarded.skipped, ref.sched.last_epoch) == (5, 0, 5)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_lightning_gradient_accumulation_counts_optimizer_steps():
    x, y = data(16, poison=(6,))  # 8 batches, 4 optimizer steps; batch 3 closes step 1
    m, trainer = run_lightning(x, y, accumulate_grad_batches=2)
    assert trainer.global_step == 4
    assert (m.guarded.taken, m.guarded.skipped) == (3, 1)
    assert m.sched.last_epoch == 3 and m.sched.held == 1
    # snapshots after every batch: a change only where an optimizer step was taken (after
    # batches 1, 5 and 7; batch 3 closed the skipped step)
    assert unchanged_across(m.snaps) == [False, True, True, True, False, True, False]


def test_lightning_bf16_mixed():
    x, y = data(12, poison=(5,))
    m, trainer = run_lightning(x, y, precision="bf16-mixed")
    assert (m.guarded.taken, m.guarded.skipped, m.sched.last_epoch) == (5, 1, 5)
    assert unchanged_across(m.snaps) == [False, True, False, False, False]


def test_lightning_fp16_gradscaler():
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = data(12, poison=(5,))
    m, trainer = run_lightning(x, y, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    # the scaler skips the overflow before the guard (and backs off); the gate holds anyway
    assert (m.guarded.taken, m.guarded.skipped) == (5, 0) and scaler.get_scale() == 2.0**7
    assert m.sched.last_epoch == 5 and m.sched.held == 1
    assert unchanged_across(m.snaps) == [False, True, False, False, False]


def test_lightning_epoch_interval_advances_once_per_epoch_with_a_taken_step():
    x, y = data(8, poison=(0, 1, 2, 3))  # batches 0 and 1 of 4 poisoned, every epoch
    m, trainer = run_lightning(x, y, module=lightning_module(interval="epoch"), max_epochs=2)
    assert (m.guarded.taken, m.guarded.skipped) == (4, 4)
    assert m.sched.last_epoch == 2 and m.sched.held == 0


def test_lightning_checkpoint_resume_continues_the_counters_and_the_schedule(tmp_path):
    x, y = data(12, poison=(5,))
    m, trainer = run_lightning(x, y)
    path = tmp_path / "one-epoch.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["optimizer_states"][0]["nanpass_guard"]
    assert (saved["taken"], saved["skipped"]) == (5, 1)
    resumed, trainer = run_lightning(x, y, module=lightning_module(), ckpt_path=path, max_epochs=2)
    assert trainer.global_step == 12
    assert (resumed.guarded.taken, resumed.guarded.skipped) == (10, 2)
    assert resumed.sched.last_epoch == 10 and resumed.sched.held == 1
