"""Options of ``harden`` and of the backend, validated once, with the valid choices in every error."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ._constants import bounds, memo
from ._errors import ConfigError
from ._rules import BY_NAME, GUARDED

MODES = ("guard", "off", "check", "warn", "guard+check")
INNERS = ("inductor", "aot_eager", "eager")


def _choices(values: Iterable[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _near(value: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _flag(what: str, value) -> bool:
    # a bool only: "false", "no", 0 or None read as True or False by accident, never silently
    if not isinstance(value, bool):
        raise ConfigError(f"nanpass: {what} must be True or False, got {value!r}")
    return value


def _names(what: str, value, valid: tuple[str, ...]) -> frozenset[str]:
    if isinstance(value, str):
        value = [value]
    try:
        names = list(value)
    except TypeError:
        raise ConfigError(f"nanpass: {what} must be a list of op names, got {value!r}") from None
    for name in names:
        if name not in valid:
            raise ConfigError(
                f"nanpass: unknown op {name!r} in {what}{_near(str(name), valid)}; "
                f"valid ops: {_choices(valid)}"
            )
    return frozenset(names)


@dataclass(frozen=True)
class Config:
    mode: str = "guard"
    ops: frozenset[str] = frozenset(GUARDED)
    exclude: tuple[str, ...] = ()  # module paths whose ops are left alone
    constants: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    stable: bool = False  # apply the exact stable-form rewrites (they change rounding: opt-in)
    inner: str = "inductor"  # backend only
    shape_checks: bool = False  # backend: shapes of the first compile are enforced on recompiles
    count: bool = False  # guard statistics: elements each guard changed
    quarantine: bool = False  # harden: rows with non-finite inputs are zeroed in, marked NaN out
    watch: int | None = 100  # harden: every `watch` calls, count what guards change; None: off
    dynamic_dims: tuple[tuple[int, str], ...] = ((0, "batch"),)
    # run the rule table's bad operands through the guards first (_selfcheck): None, on a torch
    # outside the tested releases (or with NANPASS_SELFCHECK=1); True always; False never
    selfcheck: bool | None = None
    # check mode: read the host at each op (a debugger's stop at the op itself) rather than
    # once after the forward and once after the backward
    stop_at_op: bool = False
    # check mode: look at every call of every forward and every autograd node of every
    # backward (the check before issue 47) rather than screen the step's outputs and gradients
    # and run it again at each op only on a hit
    every_op: bool = False
    # harden's guard mode: swap the table's spellings where they are looked up, so that other
    # calls never enter Python (_fastpath); False: a TorchFunctionMode sees every call
    fast: bool = True

    def excluded(self, module_path: str) -> bool:
        return any(module_path == p or module_path.startswith(p + ".") for p in self.exclude)

    def consts(self, op: str):
        overrides = dict(self.constants).get(op, ())
        return _consts_fn(op, overrides)

    def as_options(self) -> dict:
        return {
            "mode": self.mode,
            "ops": sorted(self.ops),
            "exclude": list(self.exclude),
            "constants": {op: dict(kv) for op, kv in self.constants},
            "stable": self.stable,
        }


@memo
def _consts_fn(op: str, overrides: tuple[tuple[str, float], ...]):
    defaults = BY_NAME[op].constants

    @memo
    def for_dtype(dtype: torch.dtype) -> dict[str, float]:
        b = bounds(dtype)
        values = {name: fn(b) for name, fn in defaults.items()}
        for name, user in overrides:
            # round the user's value into the dtype; it may only tighten the guard, so a
            # 1e-8 that is 0 in float16 falls back to the dtype's own safe bound
            v = float(torch.tensor(user, dtype=torch.float64).to(dtype))
            if not math.isfinite(v):
                continue
            values[name] = max(values[name], v) if name.startswith("lo") else min(values[name], v)
        return values

    return for_dtype


def _default32(op: str, name: str) -> float:
    return BY_NAME[op].constants[name](bounds(torch.float32))


def _tightens(op: str, name: str, v: float) -> None:
    """A constant may only tighten its bound: checked against float32's (the default dtype).
    Where it does not tighten a narrower dtype's (a 1e-8 is 0 in float16), that dtype's own
    bound is used."""
    safe = _default32(op, name)
    v32 = float(torch.tensor(v, dtype=torch.float64).to(torch.float32))
    lower = name.startswith("lo")
    if math.isfinite(v32) and (v32 >= safe if lower else v32 <= safe):
        return
    need = f"{name} >= {safe!r}" if lower else f"{name} <= {safe!r}"
    rounded = f" (float32 rounds it to {v32!r})" if v32 != v else ""
    raise ConfigError(
        f"nanpass: constants[{op!r}][{name!r}] = {v!r}{rounded} would loosen the {op} guard; its "
        f"float32 bound is {safe!r} and a constant may only tighten it: {need}"
    )


def _ordered(op: str, given: dict) -> None:
    names = BY_NAME[op].constants
    if "lo" in names and "hi" in names and given.keys() & {"lo", "hi"}:
        lo = given.get("lo", _default32(op, "lo"))
        hi = given.get("hi", _default32(op, "hi"))
        if lo > hi:
            raise ConfigError(f"nanpass: constants[{op!r}] gives lo = {lo!r} above hi = {hi!r}: "
                              f"the {op} guard would have no operand left")


def dynamic_dims_of(dynamic_dims) -> dict[int, str]:
    """Dims of the inputs that may vary; dim 0 (the batch) unless told otherwise."""
    if dynamic_dims is None:
        return {0: "batch"}
    if not isinstance(dynamic_dims, Mapping) or not all(isinstance(k, int) for k in dynamic_dims):
        raise ConfigError(f"nanpass: dynamic_dims maps dim index to a name, e.g. "
                          f"{{0: 'batch', 1: 'seq'}}, got {dynamic_dims!r}")
    return {int(k): str(v) for k, v in dynamic_dims.items()}


def make_config(
    *,
    mode: str = "guard",
    ops: Iterable[str] | None = None,
    exclude_ops: Iterable[str] = (),
    exclude: Iterable[str] = (),
    constants: Mapping[str, Mapping[str, float]] | None = None,
    stable: bool = False,
    inner: str = "inductor",
    shape_checks: bool = False,
    dynamic_dims: Mapping[int, str] | None = None,
    count: bool = False,
    quarantine: bool = False,
    watch: int | None = 100,
    module_paths: Iterable[str] | None = None,
    selfcheck: bool | None = None,
    stop_at_op: bool = False,
    fast: bool = True,
    every_op: bool = False,
) -> Config:
    if not isinstance(mode, str) or mode not in MODES:
        raise ConfigError(f"nanpass: unknown mode {mode!r}; valid modes: {_choices(MODES)}")
    if not isinstance(inner, str) or inner not in INNERS:
        raise ConfigError(f"nanpass: unknown inner compiler {inner!r}; valid: {_choices(INNERS)}")
    stable, shape_checks = _flag("stable", stable), _flag("shape_checks", shape_checks)
    count, quarantine = _flag("count", count), _flag("quarantine", quarantine)
    if selfcheck is not None:
        selfcheck = _flag("selfcheck", selfcheck)
    stop_at_op, fast = _flag("stop_at_op", stop_at_op), _flag("fast", fast)
    every_op = _flag("every_op", every_op)
    if watch is not None and (isinstance(watch, bool) or not isinstance(watch, int) or watch < 1):
        raise ConfigError(f"nanpass: watch is how many calls apart guards are sampled, a positive "
                          f"int (default 100), or None to turn the watch off; got {watch!r}")

    chosen = set(GUARDED) if ops is None else set(_names("ops", ops, GUARDED))
    chosen -= _names("exclude_ops", exclude_ops, GUARDED)
    if isinstance(exclude, str):
        exclude = [exclude]
    try:
        paths = tuple(exclude)
    except TypeError:
        raise ConfigError(f"nanpass: exclude must be a list of module paths (e.g. ['encoder.layers.0']), "
                          f"got {exclude!r}") from None
    for p in paths:
        if not isinstance(p, str):
            raise ConfigError(f"nanpass: exclude must be a list of module paths (e.g. ['encoder.layers.0']), "
                              f"got {p!r} in it")
    if module_paths is not None:
        valid = [p for p in module_paths if p]
        for p in paths:
            if p not in valid:
                shown = _choices(valid[:20]) + (", ..." if len(valid) > 20 else "")
                raise ConfigError(
                    f"nanpass: exclude names module {p!r}, which the model does not have"
                    f"{_near(p, valid)}; its modules: {shown or '(none)'}"
                )
    if constants is not None and not isinstance(constants, Mapping):
        raise ConfigError(f"nanpass: constants must be a dict of op name to a dict of constants "
                          f"(e.g. {{'log': {{'lo': 1e-6}}}}), got {constants!r}")
    consts = []
    for op, values in (constants or {}).items():
        if op not in GUARDED:
            raise ConfigError(
                f"nanpass: unknown op {op!r} in constants{_near(str(op), GUARDED)}; "
                f"valid ops: {_choices(GUARDED)}"
            )
        valid_names = tuple(BY_NAME[op].constants)
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"nanpass: constants[{op!r}] must be a dict of {_choices(valid_names) or 'nothing'}, "
                f"got {values!r}"
            )
        items = []
        for name, v in values.items():
            if name not in valid_names:
                raise ConfigError(
                    f"nanpass: op {op!r} has no constant {name!r}; "
                    f"its constants: {_choices(valid_names) or '(none)'}"
                )
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(
                    f"nanpass: constants[{op!r}][{name!r}] must be a finite number, got {v!r}"
                )
            _tightens(op, name, float(v))
            items.append((name, float(v)))
        _ordered(op, dict(items))
        consts.append((op, tuple(sorted(items))))
    return Config(
        mode=mode,
        ops=frozenset(chosen),
        exclude=paths,
        constants=tuple(sorted(consts)),
        stable=stable,
        shape_checks=shape_checks,
        count=count or mode == "guard+check",
        quarantine=quarantine,
        watch=watch,
        dynamic_dims=tuple(sorted(dynamic_dims_of(dynamic_dims).items())),
        inner=inner,
        selfcheck=selfcheck,
        stop_at_op=stop_at_op,
        fast=fast,
        every_op=every_op,
    )
