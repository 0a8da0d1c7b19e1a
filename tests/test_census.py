"""The census (benchmarks/census.py, docs/census.md) stays true: a fast re-run over a fixed
subset of PyTorch's OpInfo ops in float32 and float16 finds no op that turns finite operands
into NaN/Inf and is neither guarded, nor accepted with a reason, nor a known unguarded op; the
guards of the guarded ones hold under ``nanpass.harden``; and docs/census.md agrees with the
lists here. Needs ``expecttest`` (OpInfo's ``op_db`` imports it).

When a test here fails: guard the op (nanpass/_rules.py), or give it a reason in
``ACCEPTED`` (benchmarks/census.py), or add it to ``KNOWN_UNGUARDED``; then regenerate the
census: ``python benchmarks/census.py --out docs/census.md``.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import re
import sys

import pytest

from nanpass._compat import torch_release
from nanpass._rule import _resolve

ROOT = pathlib.Path(__file__).resolve().parent.parent
CENSUS_MD = ROOT / "docs" / "census.md"


def _load_census():
    spec = importlib.util.spec_from_file_location("nanpass_census", ROOT / "benchmarks" / "census.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


census = _load_census()

# what the full census (docs/census.md) reports as UNGUARDED; guarding one of them fails
# test_known_unguarded_are_still_unguarded until it is removed here
KNOWN_UNGUARDED: frozenset[str] = frozenset()

# a fixed subset: guarded, accepted, unguarded and finite ops; seconds in all
SUBSET = (
    # guarded
    "log", "div.no_rounding_mode", "sqrt", "pow", "acos", "xlogy", "exp", "logit",
    "nn.functional.cross_entropy", "cosh", "acosh", "lgamma", "logaddexp",
    "nn.functional.normalize", "nn.functional.layer_norm",
    # accepted (a reason, or overflow of huge operands only)
    "mul", "matmul", "prod", "special.bessel_y0",
    # unguarded until this table named them (docs/census.md had 81 such ops)
    "remainder", "hypot", "nn.functional.binary_cross_entropy", "nn.functional.mish", "addcdiv",
    "linalg.inv", "nn.functional.batch_norm", "special.ndtri",
    # finite
    "sigmoid", "tanh", "nn.functional.relu", "nn.functional.softplus",
)
DTYPES = ["float32", "float16"]


@pytest.fixture(scope="module")
def results():
    ops = census.load_ops(SUBSET)
    return {r.id: r for r in census.census(ops, DTYPES, samples=3)}


@pytest.mark.slow  # the census of the subset: 15 s of probes
def test_subset_probes_every_op(results):
    assert set(SUBSET) <= set(results), set(SUBSET) - set(results)
    for r in results.values():
        assert sum(r.probed.values()) > 0, f"{r.id} was not probed: {r.skipped or r.first_error}"


@pytest.mark.slow  # the census of the subset: 15 s of probes
def test_no_new_unguarded_op(results):
    new = {
        r.id: census._best_example(r, DTYPES)
        for r in results.values()
        if r.status == "UNGUARDED" and r.id not in KNOWN_UNGUARDED
    }
    assert not new, (
        f"ops that turn finite operands into NaN/Inf and are neither guarded nor accepted: {new}; "
        "guard them (nanpass/_rules.py), give a reason in ACCEPTED (benchmarks/census.py) or add "
        "them to KNOWN_UNGUARDED, then regenerate docs/census.md"
    )


@pytest.mark.slow  # the census of the subset: 15 s of probes
def test_subset_statuses(results):
    """The subset keeps covering each status the census gives today."""
    statuses = {r.status for r in results.values()}
    assert {"guarded", "accepted", "finite"} <= statuses, statuses


@pytest.mark.slow  # the census of the subset: 15 s of probes
def test_an_op_without_a_rule_is_reported_unguarded(results, monkeypatch):
    """The teeth of test_no_new_unguarded_op: take the rules away and the same probes
    classify as UNGUARDED (nothing in the census is unguarded today)."""
    monkeypatch.setattr(census, "rules_for", lambda op: ([], []))
    for name in ("remainder", "hypot", "linalg.inv"):
        r = copy.deepcopy(results[name])  # the fixture's results stay as they were
        census.classify(census.load_ops([name])[0], r)
        assert r.status == "UNGUARDED", (name, r.status)


@pytest.mark.slow  # the census of the subset: 15 s of probes
def test_guards_hold_on_the_census_probes(results):
    """Re-run through nanpass.harden, a guarded op is finite on ordinary and large operands
    (what stays non-finite only from huge operands falls under the overflow policy)."""
    broken = {
        r.id: f"{r.verified}: {r.verify_example}"
        for r in results.values()
        if r.status == "guarded" and (r.verified.startswith("verification")  # raised / crashed
                                      or (r.verify_tier is not None and r.verify_tier < 2))
    }
    assert not broken, f"guarded ops still non-finite under nanpass.harden: {broken}"


def test_known_unguarded_are_still_unguarded():
    ops = {census.op_id(op): op for op in census.load_ops()}
    for ident in sorted(KNOWN_UNGUARDED):
        assert ident in ops, f"KNOWN_UNGUARDED names {ident!r}, which is not an OpInfo op"
        op = ops[ident]
        guarded, _ = census.rules_for(op)
        assert not guarded, (
            f"{ident} is now guarded by {guarded}: remove it from KNOWN_UNGUARDED and regenerate "
            "docs/census.md"
        )
        assert census.accepted_reason(op) is None, (
            f"{ident} is now in ACCEPTED: remove it from KNOWN_UNGUARDED and regenerate docs/census.md"
        )


def test_accepted_names_real_ops():
    ops = census.load_ops()
    names = {op.name for op in ops} | {census.op_id(op) for op in ops}
    assert not set(census.ACCEPTED) - names, set(census.ACCEPTED) - names
    assert all(reason.strip() for reason in census.ACCEPTED.values())


def _census_rows(section: str | None = None) -> dict[str, str]:
    """op id -> status cell of docs/census.md's tables: the census's own, or those of the
    ``section`` that starts with that heading (up to the next)."""
    rows = {}
    text = CENSUS_MD.read_text()
    start = text.find(census.EMPTY_SECTION)
    if section is None:
        text = text if start < 0 else text[:start]
    else:
        text = text[text.index(section):]
        end = text.find("\n## ", len(section))
        text = text if end < 0 else text[:end]
    for line in text.splitlines():
        if line.startswith("| `"):
            ident = line.split("`")[1]
            rows[ident] = line.rstrip().removesuffix("|").rsplit(" | ", 1)[1].strip()
    return rows


def _removed_from_torch(ident: str) -> bool:
    """The running torch no longer has the op (``torch.cholesky`` is a stub that raises from
    2.14, and OpInfo dropped it in 2.15): docs/census.md, generated on the oldest supported
    torch, may still list it."""
    return _resolve(f"torch.{ident}") is None


def _census_torch() -> tuple[int, int]:
    """The torch docs/census.md was generated on (its header says)."""
    m = re.search(r"with torch (\d+)\.(\d+)", CENSUS_MD.read_text())
    assert m, "docs/census.md does not say which torch generated it"
    return int(m.group(1)), int(m.group(2))


def _older_opinfo() -> bool:
    """The running torch is older than the census's and its OpInfo lacks the op (OpInfo of
    2.11 and 2.12 has no ``native_group_norm`` entry, 2.13's has)."""
    return torch_release() < _census_torch()


def test_census_md_agrees_with_the_lists():
    assert CENSUS_MD.exists(), "run: python benchmarks/census.py --out docs/census.md"
    rows = _census_rows()
    assert rows, "docs/census.md has no op table"
    unguarded = {ident for ident, status in rows.items() if status.startswith("UNGUARDED")}
    assert unguarded == set(KNOWN_UNGUARDED), (
        f"docs/census.md lists as UNGUARDED but KNOWN_UNGUARDED lacks: "
        f"{sorted(unguarded - KNOWN_UNGUARDED)}; KNOWN_UNGUARDED has but docs/census.md does not "
        f"list as UNGUARDED: {sorted(KNOWN_UNGUARDED - unguarded)}"
    )
    ops = {census.op_id(op): op for op in census.load_ops()}
    for ident, status in rows.items():
        op = ops.get(ident)
        if op is None and (_removed_from_torch(ident) or _older_opinfo()):
            continue  # the census's torch had it; this one removed it (cholesky from 2.14)
        assert op is not None, f"docs/census.md lists {ident!r}, which is not an OpInfo op"
        if status.startswith("accepted: ") and status != census.POLICY_STATUS:
            reason = census.accepted_reason(op)
            assert reason is not None and status == census._md(f"accepted: {reason}"), (
                f"docs/census.md accepts {ident} with a reason ACCEPTED no longer gives: regenerate it"
            )
        if status.startswith("guarded: "):
            assert census.rules_for(op)[0], (
                f"docs/census.md calls {ident} guarded, the rule table does not: regenerate it"
            )


# -- zero-size operands (issue 39, item 1) -----------------------------------------------------

# ops whose samples cut to no element torch computes as NaN (a mean over none), guarded ones,
# one accepted under the backend, and a finite one
EMPTY_SUBSET = ("mean", "nanmean", "var", "logsumexp", "nn.functional.mse_loss", "nn.functional.huber_loss",
                "nn.functional.cross_entropy", "nn.functional.gaussian_nll_loss",
                "nn.functional.cosine_embedding_loss", "nn.functional.margin_ranking_loss", "sigmoid")


@pytest.fixture(scope="module")
def empty_results():
    return {r.id: r for r in census.empty_census(census.load_ops(EMPTY_SUBSET), ["float32", "float16"])}


@pytest.mark.slow  # a compile per guarded case: about a minute
def test_zero_size_operands_are_finite_under_harden_and_the_backend(empty_results):
    """Every sample of the subset cut to no element (a masked loss with no valid pixel):
    finite values and gradients under harden and the backend, or accepted with a reason."""
    assert set(EMPTY_SUBSET) <= set(empty_results), set(EMPTY_SUBSET) - set(empty_results)
    broken = {r.id: r.detail for r in empty_results.values() if r.status == "UNGUARDED"}
    assert not broken, f"non-finite on zero-size operands under nanpass: {broken}"
    nan_in_torch = {r.id for r in empty_results.values() if "torch" in r.found}
    assert {"mean", "nanmean", "nn.functional.mse_loss", "nn.functional.huber_loss"} <= nan_in_torch
    statuses = {r.id: r.status for r in empty_results.values()}
    assert statuses["sigmoid"] == "finite" and statuses["nn.functional.gaussian_nll_loss"] == "guarded"


@pytest.mark.slow
def test_a_zero_size_finding_without_a_rule_is_unguarded(empty_results, monkeypatch):
    """The teeth: with the finding left non-finite under harden, the classification says so."""
    r = copy.deepcopy(empty_results["nn.functional.mse_loss"])
    r.found["harden"] = r.found["torch"]
    census.classify_empty(census.load_ops(["nn.functional.mse_loss"])[0], r)
    assert r.status == "UNGUARDED", r.status


def test_census_md_zero_size_section_agrees_with_the_lists():
    assert census.EMPTY_SECTION in CENSUS_MD.read_text(), f"run: {census.EMPTY_CMD}"
    rows = _census_rows(census.EMPTY_SECTION)
    assert rows, "docs/census.md's zero-size section has no op table"
    assert not [i for i, st in rows.items() if st.startswith("UNGUARDED")], rows
    for name in ("mean", "nanmean", "nn.functional.mse_loss", "nn.functional.l1_loss",
                 "nn.functional.smooth_l1_loss", "nn.functional.huber_loss",
                 "nn.functional.margin_ranking_loss", "nn.functional.hinge_embedding_loss",
                 "nn.functional.cosine_embedding_loss", "nn.functional.gaussian_nll_loss"):
        assert name in rows, f"docs/census.md's zero-size section does not list {name}: regenerate it"
    ops = {census.op_id(op): op for op in census.load_ops()}
    for ident, status in rows.items():
        op = ops.get(ident)
        if op is None and (_removed_from_torch(ident) or _older_opinfo()):
            continue
        assert op is not None, f"docs/census.md lists {ident!r}, which is not an OpInfo op"
        if status.startswith("accepted: "):
            reason = census.empty_accepted_reason(op)
            assert reason is not None and status == census._md(f"accepted: {reason}"), (
                f"docs/census.md accepts {ident} on zero-size operands with a reason EMPTY_ACCEPTED "
                f"no longer gives: {census.EMPTY_CMD}")
        else:
            assert status.startswith("guarded: ") and census.rules_for(op)[0], (
                f"docs/census.md calls {ident} guarded on zero-size operands, the rule table does not")


# -- empty groups (issue 48, item 2) -----------------------------------------------------------

# segment_reduce (lengths and offsets: guarded since issue 48 item 1), an embedding bag, a masked
# reduction and a scatter reduction, each with one empty group
GROUPS_SUBSET = ("_segment_reduce.lengths", "_segment_reduce.offsets", "nn.functional.embedding_bag",
                 "masked.mean", "scatter_reduce.mean")


def _group_census(backend: bool):
    ops = census.load_ops(GROUPS_SUBSET)
    kinds = {census.op_id(op): census.group_kind(op) for op in ops}
    results, _ = census.groups_census(ops, ["float32"], samples=1, backend=backend, kinds=kinds)
    return {r.id: r for r in results}


@pytest.fixture(scope="module")
def group_results():
    return _group_census(backend=True)


@pytest.fixture(scope="module")
def group_results_harden():
    return _group_census(backend=False)


def test_empty_groups_are_finite_under_harden(group_results_harden):
    """The fast tier of the next test: harden only (no compile)."""
    _assert_groups_finite(group_results_harden)


@pytest.mark.slow  # a compile per case torch breaks on: about 8 s
def test_empty_groups_are_finite_under_harden_and_the_backend(group_results):
    """One empty group in otherwise ordinary operands (a segment of length 0, an empty bag, a
    masked-out row, an index slot never hit with include_self=False): finite values and
    gradients under harden and the backend, or accepted with a reason. Fails without the
    segment_reduce rule (an empty segment's mean is NaN, its max -inf)."""
    _assert_groups_finite(group_results)


def _assert_groups_finite(group_results):
    assert set(GROUPS_SUBSET) <= set(group_results), set(GROUPS_SUBSET) - set(group_results)
    for r in group_results.values():
        assert r.probed > 0 and not r.crashed and not r.died, (r.id, r.probed, r.crashed, r.died)
    broken = {r.id: r.detail for r in group_results.values() if r.status == "UNGUARDED"}
    assert not broken, f"non-finite on an empty group under nanpass: {broken}"
    for ident in ("_segment_reduce.lengths", "_segment_reduce.offsets"):
        r = group_results[ident]
        assert "torch" in r.found and r.status == "guarded", (ident, r.status, r.found)
    assert group_results["masked.mean"].status in ("guarded", "accepted")


def test_an_empty_group_finding_without_a_guard_is_unguarded(group_results_harden):
    """The teeth: left non-finite under harden, an empty segment classifies as UNGUARDED."""
    r = copy.deepcopy(group_results_harden["_segment_reduce.lengths"])
    r.found["harden"] = r.found["torch"]
    census.classify_groups(census.load_ops(["_segment_reduce.lengths"])[0], r)
    assert r.status == "UNGUARDED", r.status


@pytest.mark.slow  # the samples of every OpInfo op: about 10 s
def test_group_ops_are_found_from_op_db():
    """Every op whose parameters name a group, or whose name is a segment / scatter / index / bag
    reduction, is probed or has a reason in NOT_GROUPS."""
    probed, left = census.group_ops(census.load_ops())
    kinds = {census.op_id(op): kind for op, kind in probed}
    for ident, kind in (("_segment_reduce.lengths", "segment"), ("_segment_reduce.offsets", "segment"),
                        ("nn.functional.embedding_bag", "bag"), ("scatter_reduce.mean", "index"),
                        ("index_reduce.amax", "index"), ("masked.softmax", "mask"),
                        ("masked.normalize", "mask"), ("nn.functional.nll_loss", "ignore")):
        assert kinds.get(ident) == kind, (ident, kinds.get(ident))
    assert not [census.op_id(op) for op, why in left if why.startswith("no transform")], left


def test_census_md_groups_section_agrees_with_the_lists():
    assert census.GROUPS_SECTION in CENSUS_MD.read_text(), f"run: {census.GROUPS_CMD}"
    rows = _census_rows(census.GROUPS_SECTION)
    assert "_segment_reduce.lengths" in rows and "_segment_reduce.offsets" in rows, rows
    assert not [i for i, st in rows.items() if st.startswith("UNGUARDED")], rows
    ops = {census.op_id(op): op for op in census.load_ops()}
    for ident, status in rows.items():
        op = ops.get(ident)
        if op is None and (_removed_from_torch(ident) or _older_opinfo()):
            continue
        assert op is not None, f"docs/census.md lists {ident!r}, which is not an OpInfo op"
        if status.startswith("accepted: "):
            reason = census.groups_accepted_reason(op)
            assert reason is not None and status == census._md(f"accepted: {reason}"), (
                f"docs/census.md accepts {ident} on an empty group with a reason GROUPS_ACCEPTED "
                f"no longer gives: {census.GROUPS_CMD}")


# -- a case that crashes the process runs alone: the op's other cases still run -------------------

def _crashing_op(name, crash, **params):
    """An OpInfo op ``x.sum()`` (``lengths=``: torch.segment_reduce) whose call kills the process
    with SIGSEGV where ``crash(x)``, on two samples: a 2x3 and a 3x4 input."""
    import os
    import signal

    import torch
    from torch.testing._internal.opinfo.core import OpInfo, SampleInput

    def f(x, **kw):
        if crash(x):
            os.kill(os.getpid(), signal.SIGSEGV)
        if "lengths" in kw:
            return torch.segment_reduce(x.reshape(-1), "sum", lengths=kw["lengths"])
        return x.sum()

    def samples(op, device, dtype, requires_grad, **kw):
        for shape in ((2, 3), (3, 4)):
            x = torch.ones(shape, dtype=dtype, requires_grad=requires_grad)
            yield SampleInput(x, **({"lengths": torch.tensor([x.numel()])} if params else {}))

    return OpInfo(name, op=f, dtypes=(torch.float32,), sample_inputs_func=samples,
                  supports_out=False)


def test_a_crashing_zero_size_case_leaves_the_others_probed():
    op = _crashing_op("fake_crash", lambda x: x.shape[0] == 0)
    (r,) = census.empty_census([op], ["float32"], backend=False)
    # per sample: a leading dim of size 0 and every dim of size 0 crash, a last dim of size 0 runs
    assert r.probed == 2 and not r.died, (r.probed, r.died)
    assert len(r.crashed) == 4 and all(c.endswith(": SIGSEGV") for c in r.crashed), r.crashed
    assert {c.split(",")[1].strip() for c in r.crashed} == {"sample 0", "sample 1"}, r.crashed
    assert "- `fake_crash` (2 cases probed): " in census.render_empty([r], ["float32"], 0.0)


def test_a_crashing_group_case_leaves_the_others_probed():
    op = _crashing_op("fake_segments", lambda x: x.shape == (2, 3), lengths=True)
    results, _ = census.groups_census([op], ["float32"], backend=False)
    (r,) = results
    assert r.kind == "segment" and r.probed == 1, (r.kind, r.probed)
    assert r.crashed == ["float32, sample 0, a segment of length 0 in front: SIGSEGV"], r.crashed
