"""The rewrite pass: stable forms first, then every op the rule table guards.

Invariants (docs/architecture.md): the graph stays valid (``lint``), a new node copies the
replaced node's metadata, no new aliasing is introduced (in-place spellings copy the guarded
result into their operand, as the original op did), and nothing the table names is skipped
without a ``Change`` that says why.
"""

from __future__ import annotations

import contextlib
import time
import types
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import _stable
from ._check import Site, check_input, checked, nonfinite_flag, tap
from ._compat import autocast_targets, data_dependent, fake_mode_of, no_dynamo_source
from ._config import Config
from ._constants import memo
from ._errors import RewriteError
from . import _guards
from ._guards import COUNTER, fenced, logits_loss
from ._rule import computes_in
from ._rules import BY_NAME, CALLS, GUARDED, Rule, Spelling, match
from ._source import input_name, module_path, user_frame
from ._stats import Counter, GuardWarning

Tensor = torch.Tensor


@dataclass(frozen=True)
class Change:
    """One op nanpass looked at: what it did there and why."""

    node: str  # node name in the rewritten graph ("" when left alone: then it is `original`)
    original: str  # node name in the captured graph, before the rewrite
    op: str  # rule name
    spelling: str  # as the user wrote it: "operator.truediv", "Tensor.log", "nn.Softmax"
    module: str  # module path as in named_modules(); "" for the root
    module_type: str
    source: str | None  # "file.py:12", the user's own frame
    code: str | None  # that source line
    action: str  # "guarded" | "stable" | "left" | "checked"
    guard: str  # the guard or stable form applied; "" when left alone
    reason: str  # why the op is unsafe, or why it was left alone
    dtype: str | None = None  # the operand dtype, when the capture recorded it
    constants: tuple[tuple[str, float], ...] = ()  # the guard's constants for that dtype
    after_stable: bool = False  # a guard on the result of a stable form: not another unsafe op

    @property
    def detail(self) -> str:
        return self.guard or self.reason


def _has_float(args, kwargs) -> bool:
    # a loop, not any(<genexpr>): this runs on every guarded call
    for a in (*args, *kwargs.values()):  # noqa: SIM110
        if isinstance(a, Tensor) and a.is_floating_point():
            return True
    return False


def _no_consts(dtype):  # pragma: no cover - rules without constants never call it
    return {}


def counted(guard, counter: Counter):
    """guard, with the elements it changes added to ``counter`` (on the device)."""

    def count(*args, **kwargs):
        token = COUNTER.set(counter)
        counter.begin()
        try:
            return guard(*args, **kwargs)
        finally:
            COUNTER.reset(token)

    count.__name__ = count.__qualname__ = guard.__name__
    count.__module__ = "nanpass"
    return count


@memo
def make_guard(rule: Rule, sp: Spelling, consts=None):
    """The function a rewritten node calls: the rule's guard bound to one spelling."""
    guard = guard_fn(rule, sp, consts)
    guard.__name__ = guard.__qualname__ = f"guard_{rule.name}"
    guard.__module__ = "nanpass"
    guard.__doc__ = f"nanpass guard for {sp.name}: {rule.action}"
    return guard


def guard_fn(rule: Rule, sp: Spelling, consts=None, impl=None):
    """``make_guard`` without its cache and names: what a region dynamo traces builds afresh
    (a cache keyed on rules, or a function's ``__name__`` set, is Python state dynamo cannot
    trace). ``impl``: another guard for the rule's calls (a composite's own, for its insides)."""
    impl = impl or rule.guard
    consts = consts or _no_consts
    if sp.kind == "module":

        def guard(module, *args, **kwargs):
            if not _has_float(args, kwargs):
                return module(*args, **kwargs)
            return fenced(impl, module, args, kwargs, consts)

        return guard
    if sp.inplace:
        written, plain = sp.call, sp.outplace

        def guard(*args, **kwargs):
            if not _has_float(args, kwargs):
                return written(*args, **kwargs)
            # guard a copy: autograd forbids writing into the base of the guard's views
            operand = (args[0].clone(), *args[1:])
            return args[0].copy_(fenced(impl, plain, operand, kwargs, consts))

        return guard
    fn = sp.call

    def guard(*args, **kwargs):
        if not _has_float(args, kwargs):
            return fn(*args, **kwargs)
        if kwargs.get("out") is not None:  # torch.log(x, out=y): guard, then write y
            out = kwargs.pop("out")
            return out.copy_(fenced(impl, fn, args, kwargs, consts))
        return fenced(impl, fn, args, kwargs, consts)

    return guard


def _is_shape_arith(node) -> bool:
    """A Python number computed from shapes (``x.shape[-1] ** 0.5``), not a tensor."""
    if not isinstance(node, fx.Node):
        return isinstance(node, (int, float))
    val = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(val, Tensor) or (isinstance(val, (tuple, list)) and any(isinstance(v, Tensor) for v in val)):
        return False  # a tensor, also one out of chunk/split/unbind (operator.getitem)
    if node.op == "call_method" and node.target in ("size", "dim", "numel"):
        return True
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",):
        return True
    if node.op == "call_function" and node.target.__module__ in ("_operator", "operator"):
        return all(_is_shape_arith(a) for a in node.args)
    return val is not None


def _operand_dtype(node: fx.Node) -> torch.dtype | None:
    """The floating dtype of the first tensor operand, when the capture recorded one."""
    for n in node.all_input_nodes:
        v = n.meta.get("example_value", n.meta.get("val"))
        if isinstance(v, Tensor):
            return v.dtype
    return None


def make_checker(rule: Rule, sp: Spelling, where: Site, warn: bool):
    """mode="check"/"warn": the original op, then a check of what it made (see _check.py)."""
    if sp.kind == "module":

        def check(module, *args, **kwargs):
            return checked(module, args, kwargs, where, warn)

    elif sp.inplace:
        plain = sp.outplace

        def check(*args, **kwargs):
            operand = (args[0].clone(), *args[1:]) if isinstance(args[0], Tensor) else args
            return args[0].copy_(checked(plain, operand, kwargs, where, warn))

    else:
        fn = sp.call

        def check(*args, **kwargs):
            return checked(fn, args, kwargs, where, warn)

    check.__name__ = check.__qualname__ = f"check_{rule.name}"
    check.__module__ = "nanpass"
    return check


def _site(node: fx.Node, gm: fx.GraphModule, rule: Rule, sp: Spelling) -> Site:
    path, cls = module_path(node)
    if node.op == "call_module":
        cls = type(gm.get_submodule(path)).__name__
    frame = user_frame(node.meta.get("stack_trace"))
    return Site(rule.name, sp.name, path, cls, frame[0] if frame else None, frame[1] if frame else None)


def _check_graph(gm: fx.GraphModule, config: Config, record) -> None:
    """Replace every op of the rule table by its checker; check the inputs for NaN."""
    graph = gm.graph
    warn = config.mode == "warn"
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    for node in inputs:
        if node.users:
            with graph.inserting_after(inputs[-1]):
                graph.call_function(check_input, (node, input_name(node), warn))
    for node in nodes:
        hit = match(node, gm)
        if hit is None or not hit[0].guarded:
            continue
        rule, sp = hit
        where = _site(node, gm, rule, sp)
        with graph.inserting_before(node):
            args = _operands(node, sp)
            if sp.kind == "module":
                args = (graph.get_attr(str(node.target)), *args)
            new = graph.call_function(make_checker(rule, sp, where, warn), args, dict(node.kwargs))
        new.meta = dict(node.meta)
        original = node.name
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        record(new, original, rule.name, sp.name, "checked", f"raises NonFiniteError here ({config.mode})",
               rule.reason)
    graph.lint()
    gm.recompile()


def _flag_graph(gm: fx.GraphModule, record, sites: list) -> None:
    """The compiled check mode: one fused finiteness check of the graph's floating outputs,
    an extra graph output (one sync per call); the op is named by an eager re-run only when
    it fires (``_check.flagged``). Every op of the rule table is recorded as checked."""
    graph = gm.graph
    nodes = list(graph.nodes)
    probe = None
    for node in nodes:
        hit = match(node, gm)
        if hit is None or not hit[0].guarded or node.op == "call_module":
            continue
        rule, sp = hit
        sites.append(_site(node, gm, rule, sp))
        record(node, node.name, rule.name, sp.name, "checked",
               "one fused NaN/Inf check of the graph's outputs and gradients; an eager re-run "
               "names the op when it fires", rule.reason)
        # taps cost a reduction each in backward: not where the op cannot make a gradient
        # non-finite (a float32 matmul, an integer power: the rule's own dtype and static
        # tests), nor at a loss (cross_entropy, nll_loss): a finite loss has a finite gradient,
        # its value is the graph's output, which the forward flag reads, and its logits are the
        # step's largest tensor
        safe = _out_of_dtype(rule, node) or _statically_safe(rule, sp, node) is not None
        if torch.is_grad_enabled() and not safe and rule.guard is not logits_loss:
            probe = _tap_operands(graph, node, sp, probe)
    if probe is not None:
        gm.meta["nanpass_probe"] = True
    output = next(n for n in nodes if n.op == "output")
    outs = output.args[0]
    floats = [n for n in _flat_nodes(outs) if _is_float_node(n)]
    with graph.inserting_before(output):
        bad = graph.call_function(nonfinite_flag, tuple(floats))
    output.args = ((*outs, bad) if isinstance(outs, (tuple, list)) else (outs, bad),)
    graph.lint()
    gm.recompile()


def _out_of_dtype(rule: Rule, node: fx.Node) -> bool:
    """The rule's op is unsafe only in other dtypes (a float32 matmul), and this call does not
    compute in one of them: no operand of such a dtype, and no autocast to one where it runs
    (read from the thread's autocast state, which ``_autocast_state`` sets to the node's)."""
    if not rule.only_dtypes or _operand_dtype(node) is None:
        return False
    return not computes_in((*node.args, *node.kwargs.values()), rule.only_dtypes, rule.autocast_float32)


def _autocast_state(regions: tuple):
    """The thread's autocast state as it is where a node runs: the state around the compiled
    call (which the backend runs in) with each region of the graph around the node entered in
    turn (``regions``: the arguments of ``torch.autocast`` as dynamo recorded them)."""
    if not regions:
        return contextlib.nullcontext()
    return _entered_regions(regions)


@contextlib.contextmanager
def _entered_regions(regions: tuple):
    saved = []
    try:
        for vals in regions:
            device = vals[0]
            dtype = vals[1] if len(vals) > 1 else None
            enabled = vals[2] if len(vals) > 2 and vals[2] is not None else True
            saved.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
            torch.set_autocast_enabled(device, bool(enabled))
            if dtype is not None:
                torch.set_autocast_dtype(device, dtype)
        yield
    finally:
        for device, enabled, dtype in reversed(saved):
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)


def _track_region(node: fx.Node, regions: list, bodies: dict) -> None:
    """Follow the autocast regions of a dynamo graph (``_enter_autocast``/``_exit_autocast``
    nodes around a region) and note the regions each higher-order op's body runs in (and the
    region ``wrap_with_autocast`` itself opens for its body)."""
    if node.op != "call_function":
        return
    enter, leave, wrap = autocast_targets()
    target = node.target
    if target in enter:
        regions.append(tuple(node.args))
        return
    if target in leave:
        if regions:
            regions.pop()
        return
    inner = (tuple(node.args[:4]),) if target in wrap else ()
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            bodies[str(a.target)] = (*regions, *inner)


def _operands(node: fx.Node, sp: Spelling) -> tuple:
    """The node's positional operands in the op's own order: a reflected dunder written out
    (``x.__rtruediv__(2.0)``, 2 / x) holds its right operand first."""
    if sp.reflected and len(node.args) >= 2:
        return (node.args[1], node.args[0], *node.args[2:])
    return node.args


def _statically_safe(rule: Rule, sp: Spelling, node: fx.Node) -> str | None:
    """Why this call is safe from its arguments alone (``Rule.safe_if``: x ** 3 in float32)."""
    if sp.kind == "module" or rule.safe_if is None:
        return None
    return rule.safe_if(_operands(node, sp), node.kwargs)


def _tap_operands(graph: fx.Graph, node: fx.Node, sp: Spelling, probe: fx.Node | None):
    """Route each floating operand of ``node`` that needs a gradient through ``_check.tap``
    (not the one an in-place spelling writes into); the graph gains one input, the probe."""
    first = 1 if sp.inplace else 0
    args, kwargs = list(node.args), dict(node.kwargs)
    slots = [(args, i) for i in range(first, len(args))] + [(kwargs, k) for k in kwargs]
    for box, key in slots:
        a = box[key]
        v = a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else None
        if not (isinstance(v, Tensor) and v.is_floating_point() and v.requires_grad):
            continue
        if probe is None:
            last = [n for n in graph.nodes if n.op == "placeholder"][-1]
            with graph.inserting_after(last):
                probe = graph.placeholder("nanpass_probe")
            no_dynamo_source(probe)
        with graph.inserting_before(node):
            box[key] = graph.call_function(tap, (a, probe))
    node.args, node.kwargs = tuple(args), kwargs
    return probe


def eagerly(gm: fx.GraphModule, inner: str, err: Exception):
    """The rewritten graph run as it is, where the inner compiler cannot trace it because
    torch's own code in it reads a value known only at run time (the backward of
    ``torch._higher_order_ops.while_loop`` calls ``.item()`` when an input requires grad):
    dynamo would graph-break there and run the region eagerly without its guards; here it
    runs eagerly with them, and says so. Any other failure is raised as it came."""
    if not data_dependent(err):
        raise err
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    warnings.warn(
        f"nanpass: the inner compiler {inner!r} cannot trace this graph ({type(err).__name__}"
        f"{': ' + first[:120] if first else ''}); it runs eagerly, with its guards",
        GuardWarning, stacklevel=2)
    return gm.forward


def untap(gm: fx.GraphModule) -> None:
    """Take the taps and the probe out again once the inner compiler has traced the graph:
    dynamo reads its graph's inputs after the backend returns, and the probe is not one."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is tap:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name == "nanpass_probe" and not node.users:
            graph.erase_node(node)
    gm.meta.pop("nanpass_probe", None)
    gm.recompile()


def _flat_nodes(arg) -> list:
    found: list = []
    fx.node.map_arg(arg, found.append)
    return found


def _is_float_node(node: fx.Node) -> bool:
    v = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(v, Tensor) and v.is_floating_point()


def _static_non_float(node: fx.Node) -> str | None:
    """Why the operands are known not to be floating tensors, from the graph alone."""
    if node.all_input_nodes and all(_is_shape_arith(a) for a in node.args):
        return "Python numbers (shape arithmetic), not tensors"
    vals = [n.meta.get("example_value", n.meta.get("val")) for n in node.all_input_nodes]
    tensors = [v for v in vals if isinstance(v, Tensor)]
    if not tensors or len(tensors) != len(vals):
        return None
    if not any(t.is_floating_point() for t in tensors):
        return "integer/bool/complex operands keep their exact semantics"
    return None


def rewrite(gm: fx.GraphModule, config: Config, counters: list | None = None,
            sites: list | None = None, autocast: tuple = ()) -> list[Change]:
    """Rewrite ``gm`` in place; return one Change per op looked at. With ``config.count``,
    each guard gets a Counter, appended to ``counters``. ``autocast``: the autocast regions
    ``gm`` runs in (a higher-order op's body inside one)."""
    changes: list[Change] = []
    if config.mode == "off":
        return changes

    stable_nodes: set[str] = set()

    def record(node, original, rule_name, spelling, action, guard, reason):
        path, cls = module_path(node)
        if node.op == "call_module" or (not cls and path):
            cls = type(gm.get_submodule(path)).__name__ if path else cls
        frame = user_frame(node.meta.get("stack_trace"))
        dtype = _operand_dtype(node)
        consts = ()
        rule = BY_NAME[rule_name]
        if action == "guarded" and rule.constants and dtype is not None:
            consts = tuple(sorted(config.consts(rule_name)(dtype).items()))
        changes.append(
            Change(
                node="" if action == "left" else node.name, original=original, op=rule_name,
                spelling=spelling, module=path, module_type=cls,
                source=frame[0] if frame else None, code=frame[1] if frame else None,
                action=action, guard=guard, reason=reason,
                dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
                constants=consts, after_stable=original in stable_nodes,
            )
        )
        if action == "stable":
            stable_nodes.add(node.name)

    def record_stable(node, original, description):
        record(node, original, match(node, gm)[0].name, description.split(" -> ")[0], "stable",
               description, "exact stable form (changes rounding on safe inputs, so opt-in): the naive form "
               "loses the value or overflows")

    if config.mode in ("check", "warn"):
        if sites is not None:  # compiled: flags on the device
            _flag_graph(gm, record, sites)
        else:
            _check_graph(gm, config, record)
        return changes

    if config.stable:
        _stable.apply(gm, gm, record_stable)

    graph = gm.graph
    regions: list = list(autocast)
    bodies: dict = {}  # a higher-order op's body -> the autocast regions it runs in
    for node in list(graph.nodes):
        _track_region(node, regions, bodies)
        hit = match(node, gm)
        if hit is None:
            if _opaque_function(node) and not config.excluded(module_path(node)[0]):
                _guard_opaque(gm, node, config, record)
            continue
        rule, sp = hit
        with _autocast_state(tuple(regions)):
            why = _decide(rule, sp, node, config)
        if why is _NOT_LOOKED_AT:
            continue  # not unsafe in the dtype it computes in: not looked at (as under harden)
        if why is not None:
            if why:
                record(node, node.name, rule.name, sp.name, "left", "", why)
            continue
        guard = make_guard(rule, sp, config.consts(rule.name) if rule.constants else None)
        counter = None
        if config.count and counters is not None:
            counter = Counter(None)
            guard = counted(guard, counter)
        original = node.name
        try:
            with graph.inserting_before(node):
                args = _operands(node, sp)
                if sp.kind == "module":
                    args = (graph.get_attr(str(node.target)), *args)
                new = graph.call_function(guard, args, dict(node.kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        except Exception as e:  # pragma: no cover - a bug, reported with the node
            frame = user_frame(node.meta.get("stack_trace"))
            raise RewriteError(
                f"nanpass: could not rewrite {sp.name} at node {node.name!r}"
                f"{' (' + frame[0] + ')' if frame else ''}: {e}"
            ) from e
        record(new, original, rule.name, sp.name, "guarded", rule.action, rule.reason)
        if counter is not None:
            counter.change = changes[-1]
            counters.append(counter)
    graph.lint()
    gm.recompile()
    # the bodies of higher-order ops (a checkpointed region, a wrap, cond branches) are graphs
    # of their own: their unsafe ops are the model's too
    for name, body in gm.named_children():
        if isinstance(body, fx.GraphModule):
            changes.extend(rewrite(body, config, counters, sites, bodies.get(name, tuple(autocast))))
    return changes


_NOT_LOOKED_AT = object()


def _opaque_function(node: fx.Node) -> bool:
    """A call of a Python function dynamo put into the graph whole, its body untraced
    (``torch._dynamo.allow_in_graph(fn)``, as einops does): a function of the user's or a
    library's, not torch's own (which dynamo keeps whole on purpose: F.layer_norm) or nanpass's."""
    fn = node.target
    if node.op != "call_function" or not isinstance(fn, types.FunctionType):
        return False
    module = getattr(fn, "__module__", None) or ""
    return not (module == "torch" or module.startswith(("torch.", "nanpass")))


def _as_written(fn, args, kwargs, consts, fence):
    return fn(*args, **kwargs)


def _within_guards(fn, config: Config):
    """``fn`` run with each call it makes that the rule table names guarded (``config``'s
    constants; the ops it excludes as written): the calls of a function dynamo keeps whole are
    the model's too. Traced by the inner compiler, the guards go into its graph."""
    mode = _guards._GUARDED_CALLS[0]
    excluded = {name: _as_written for name in GUARDED if name not in config.ops}

    def guarded(*args, **kwargs):
        with mode(excluded, config):
            return fn(*args, **kwargs)

    guarded.__name__ = guarded.__qualname__ = f"guarded_{getattr(fn, '__name__', 'call')}"
    guarded.__module__ = "nanpass"
    guarded.__wrapped__ = fn
    return guarded


class _Calls(torch.overrides.TorchFunctionMode):
    """The rule table's calls a function makes, in order (run once on dynamo's fake values)."""

    def __init__(self):
        super().__init__()
        self.hits: list = []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        try:
            hit = CALLS.get(func)
        except TypeError:
            hit = None
        if hit is not None and hit[0].guarded and hit not in self.hits:
            self.hits.append(hit)
        return func(*args, **(kwargs or {}))


def _calls_of(node: fx.Node) -> list | None:
    """The rule table's calls ``node``'s function makes on its example values (fake tensors,
    nothing computed), or None where they cannot be run."""
    def value(n):
        return n.meta.get("example_value", n.meta.get("val"))

    args = fx.node.map_arg(node.args, value)
    kwargs = fx.node.map_arg(node.kwargs, value)
    found: list = []
    fx.node.map_aggregate((args, kwargs), lambda a: found.append(a) or a)
    fake = fake_mode_of(found)
    if fake is None:
        return None
    survey = _Calls()
    try:
        with fake, survey, torch.no_grad():
            node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - its calls stay guarded; only the report is unknown
        return None
    return survey.hits


def _guard_opaque(gm: fx.GraphModule, node: fx.Node, config: Config, record) -> None:
    """Run an opaque function's calls under the guards, and report each unsafe op it makes
    (a ``Change`` at the line that calls it); where they cannot be listed, a GuardWarning."""
    fn = node.target
    hits = _calls_of(node)
    node.target = _within_guards(fn, config)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    if hits is None:
        frame = user_frame(node.meta.get("stack_trace"))
        warnings.warn(
            f"nanpass: {name} runs whole in the graph (torch._dynamo.allow_in_graph)"
            f"{' at ' + frame[0] if frame else ''}: its calls are guarded, and the report cannot "
            "list them", GuardWarning, stacklevel=2)
        return
    for rule, sp, _ in hits:
        if rule.name in config.ops:
            record(node, node.name, rule.name, f"{sp.name} in {name}", "guarded",
                   rule.action + " (inside a function dynamo keeps whole)",
                   rule.reason)


def _decide(rule: Rule, sp: Spelling, node: fx.Node, config: Config):
    """Why a node the table names is left as written (``""``: left and not reported; the
    sentinel ``_NOT_LOOKED_AT``: not unsafe in the dtype it computes in, not looked at, as
    under harden), or None: guard it. Read under the autocast state where the node runs."""
    if _out_of_dtype(rule, node):
        return _NOT_LOOKED_AT
    if not rule.guarded:
        return rule.reason if rule.safe else ""
    path, _ = module_path(node)
    if rule.name not in config.ops:
        return "op excluded by config"
    if config.excluded(path):
        return f"module {path!r} excluded by config"
    why = _statically_safe(rule, sp, node)
    return why if why is not None else _static_non_float(node)


@dataclass(frozen=True)
class GraphRecord:
    """One captured graph and what the rewrite did to it, kept before any inner compiler
    takes the graph (inductor mutates it)."""

    capture: str  # "fx" | "dynamo"
    code_before: str
    code: str  # after the rewrite
    changes: list[Change]
    rewrite_s: float  # wall time of the pass
    params: tuple = ()  # weak references to the parameters the graph reads (to find its model)
    asserts: tuple = ()  # ShapeAsserts inserted into the graph
    counters: tuple = ()  # guard statistics, with count=True


def rewrite_and_record(gm: fx.GraphModule, config: Config, capture: str, example_inputs=(),
                       sites: list | None = None) -> GraphRecord:
    t = time.perf_counter()
    before = gm.code
    counters: list = []
    changes = rewrite(gm, config, counters, sites)
    params = tuple(weakref.ref(x) for x in example_inputs if isinstance(x, torch.nn.Parameter))
    return GraphRecord(capture, before, gm.code, changes, time.perf_counter() - t, params,
                       counters=tuple(counters))


def summary(changes: list[Change]) -> str:
    """One line: ``5 unsafe ops in 2 modules: 3 div, 2 log — 4 guarded, 1 stable form, 0 left alone``."""
    done = [c for c in changes if c.action in ("guarded", "stable", "checked") and not c.after_stable]
    left = [c for c in changes if c.action == "left"]
    counts: dict[str, int] = {}
    for c in done:
        counts[c.op] = counts.get(c.op, 0) + 1
    by_op = ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    modules = len({c.module for c in done})
    guarded = sum(c.action == "guarded" for c in done)
    checked = sum(c.action == "checked" for c in done)
    stable = len(done) - guarded - checked
    head = (f"{len(done)} unsafe op{'s' if len(done) != 1 else ''} in {modules} "
            f"module{'s' if modules != 1 else ''}{': ' + by_op if by_op else ''} \u2014 ")
    if checked:
        return f"{head}{checked} checked for NaN/Inf"
    return (
        f"{head}{guarded} guarded, {stable} stable form"
        f"{'s' if stable != 1 else ''}, {len(left)} left alone"
    )
