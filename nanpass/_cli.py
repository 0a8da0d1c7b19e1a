"""The ``nanpass`` command line: ``report`` and ``scan`` a model defined in a Python file.

Both commands import (and so execute) the file you name, like ``python file.py`` would.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback

import torch

from ._check import NonFiniteError
from ._enable import RUN_MODES, enable
from ._source import _rel

FORMATS = ("text", "md", "json", "html")

EPILOG = """\
The target is PATH:NAME, where NAME is an nn.Module class or a function returning a module;
it is called with no arguments. nanpass imports PATH, which runs the code in it.

exit status: 0 success; 1 unsafe ops found (scan --strict), or an op not proven safe
and not guarded (scan --certify); 2 bad usage or a model that
could not be built, run or captured.

examples:
  nanpass report examples/quickstart.py:TinyAttentionClassifier --inputs batch.pt
  nanpass report model.py:build --input-shape 2,16 --format html -o report.html
  nanpass scan model.py:Net --input-shape 8,3,32,32 --strict
  nanpass scan model.py:Net --input-shape 8,16 --certify --ranges=-1,1
"""


RUN_HELP = """\
Run a training script under nanpass with no change to it: every model and the loss code
around it, in this process's main thread. `torchrun --nproc-per-node 2 -m nanpass run train.py`
runs it on every rank. torch.compile inside the script compiles with nanpass's backend around
the backend it names.

  nanpass run train.py --lr 3e-4              # check: stop at the first NaN/Inf, with its line
  nanpass run --mode guard train.py           # train finite
  nanpass run --mode count train.py           # at exit: which guards fired, by source line
"""


class CliError(Exception):
    """One line for the user; the traceback only with --debug."""


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="nanpass", description="Show what nanpass rewrites in a PyTorch model.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"nanpass {__version__}",
                   help="print the nanpass version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,report,scan}")
    r = sub.add_parser("run", help="run a training script under nanpass, unmodified",
                       description=RUN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--mode", choices=RUN_MODES, default="check",
                   help="check (default): stop at the first NaN/Inf born, naming your line; "
                   "warn: warn instead; guard: guard the unsafe ops and skip non-finite optimizer "
                   "steps; count: guard, and print which guards fired how often")
    r.add_argument("--report", metavar="FILE.html", help="write the report of every unsafe op seen")
    r.add_argument("--every-op", action="store_true",
                   help="check (and warn): watch every call of every step, as a debugger does, "
                   "instead of screening each module call's outputs and gradients and running "
                   "it again at each op only when they are not finite (the default)")
    r.add_argument("script", help="the Python script to run")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    for name, text in (("report", "harden the model and print the report of every change"),
                       ("scan", "list the unsafe ops nanpass finds, without changing anything")):
        c = sub.add_parser(name, help=text, description=text + ".", epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        c.add_argument("target", metavar="PATH:NAME", help="file and class or factory, e.g. model.py:Net")
        src = c.add_mutually_exclusive_group()
        src.add_argument("--input-shape", action="append", metavar="D,D,...",
                         help="a random float input of this shape (repeat for several inputs)")
        src.add_argument("--inputs", metavar="FILE",
                         help="inputs saved with torch.save: a tensor, a tuple/list (positional) or "
                         "a dict (keyword arguments); loaded with weights_only=True")
        c.add_argument("--format", choices=FORMATS, default="text", help="output format (default text)")
        c.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
        c.add_argument("--debug", action="store_true", help="show full tracebacks")
        if name == "scan":
            c.add_argument("--strict", action="store_true", help="exit 1 when any unsafe op is found")
            c.add_argument("--certify", action="store_true",
                           help="prove each unsafe op safe for inputs within --ranges (interval analysis), "
                           "or name it; exit 1 when an op is unsafe and unguarded")
            c.add_argument("--ranges", action="append", metavar="LO,HI",
                           help="with --certify: the range of the floating inputs, written --ranges=LO,HI when LO < 0 (once for all, or once "
                           "per positional input; 'finite' for the dtype's finite range, 'none' to hold "
                           "an input at its value)")
            c.add_argument("--hardened", action="store_true",
                           help="with --certify: certify nanpass.harden(model) (guarded ops count as safe)")
    return p


def _load_target(target: str) -> torch.nn.Module:
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise CliError(f"nanpass: target must be PATH:NAME (e.g. model.py:Net), got {target!r}")
    if not os.path.isfile(path):
        raise CliError(f"nanpass: no such file: {path}")
    spec = importlib.util.spec_from_file_location(f"nanpass_target_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        raise CliError(f"nanpass: importing {path} called {_exit(e)}: the model was not loaded "
                       f"(put the script's own run under `if __name__ == \"__main__\":`)") from e
    except Exception as e:
        raise CliError(f"nanpass: importing {path} raised {type(e).__name__}: {e}") from e
    finally:
        sys.path.pop(0)
    if not hasattr(module, name):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise CliError(f"nanpass: {path} has no attribute {name!r}; callables in it: {', '.join(names) or '(none)'}")
    try:
        model = getattr(module, name)()
    except SystemExit as e:
        raise CliError(f"nanpass: {name}() called {_exit(e)}: the model was not built") from e
    except Exception as e:
        raise CliError(f"nanpass: {name}() raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise CliError(f"nanpass: {name}() returned {type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def _exit(e: SystemExit) -> str:
    """sys.exit(0) is the same SystemExit as exit(0) and raise SystemExit."""
    return f"sys.exit({e.code!r})" if e.code is not None else "sys.exit()"


def _inputs(args) -> tuple[tuple, dict]:
    if args.inputs:
        if not os.path.isfile(args.inputs):
            raise CliError(f"nanpass: no such inputs file: {args.inputs}")
        try:
            data = torch.load(args.inputs, weights_only=True)
        except Exception as e:
            raise CliError(f"nanpass: cannot load {args.inputs}: {type(e).__name__}: {e}") from e
        if isinstance(data, dict):
            return (), data
        if isinstance(data, (tuple, list)):
            return tuple(data), {}
        return (data,), {}
    shapes = []
    for text in args.input_shape or ():
        try:
            shapes.append(tuple(int(d) for d in text.split(",")))
        except ValueError:
            raise CliError(f"nanpass: --input-shape takes comma-separated integers, got {text!r}") from None
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=gen) for s in shapes), {}


def _parse_ranges(texts: list[str] | None):
    if not texts:
        raise CliError("nanpass: --certify needs --ranges LO,HI (e.g. --ranges=-1,1), or --ranges finite")
    specs = []
    for text in texts:
        if text in ("finite", "none"):
            specs.append("finite" if text == "finite" else None)
            continue
        try:
            lo, hi = (float(v) for v in text.split(","))
        except ValueError:
            raise CliError(f"nanpass: --ranges takes LO,HI (two numbers), 'finite' or 'none', got {text!r}") from None
        specs.append((lo, hi))
    if len(specs) == 1:
        return specs[0] if specs[0] is not None else [None]
    return specs


def _certify(args, model, call_args) -> int:
    import nanpass

    ranges = _parse_ranges(args.ranges)
    target = nanpass.harden(model) if args.hardened else model
    try:
        cert = nanpass.certify(target, *call_args, ranges=ranges)
    except nanpass.NanpassError:
        raise
    except SystemExit as e:
        raise CliError(f"nanpass: running the model called {_exit(e)}: it did not finish") from e
    except Exception as e:
        raise CliError(f"nanpass: running the model raised {type(e).__name__}: {e}") from e
    text = cert.to_json() + "\n" if args.format == "json" else str(cert).replace(os.getcwd() + os.sep, "") + "\n"
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0 if cert.proven else 1


def _run(args) -> int:
    import nanpass

    model = _load_target(args.target)
    call_args, call_kwargs = _inputs(args)
    if getattr(args, "certify", False):
        if call_kwargs or not call_args:
            raise CliError("nanpass: --certify needs positional inputs: --input-shape D,D,... or --inputs FILE.pt "
                           "holding a tensor or a tuple")
        return _certify(args, model, call_args)
    if getattr(args, "ranges", None):
        raise CliError("nanpass: --ranges is used with --certify")
    safe = nanpass.harden(model)
    if not (call_args or call_kwargs):
        raise CliError("nanpass: give the model's inputs with --input-shape (e.g. --input-shape 4,8) "
                       "or --inputs FILE.pt: the report lists the unsafe calls the model makes as it runs")
    try:
        with torch.no_grad():
            safe(*call_args, **call_kwargs)
    except nanpass.NanpassError:
        raise
    except SystemExit as e:
        raise CliError(f"nanpass: running the model called {_exit(e)}: it did not finish") from e
    except Exception as e:
        raise CliError(f"nanpass: running the model raised {type(e).__name__}: {e}") from e
    report = nanpass.report(safe)
    if args.command == "scan":
        found = [c for c in report.changes if c.action != "left" and not c.after_stable]
        if args.format == "text":
            text = f"{len(found)} unsafe op{'s' if len(found) != 1 else ''} found in {report.model}\n" + "".join(
                f"  {c.op:20} {c.spelling:28} {c.module or '<root>'}  {_rel(c.source) or ''}\n"
                for c in found
            )
        else:
            text = _format(report, args.format, color=False)
        status = 1 if (args.strict and found) else 0
    else:
        text, status = None, 0
    if text is None:
        text = _format(report, args.format, color=args.output is None and sys.stdout.isatty())
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return status


def _format(report, fmt: str, color: bool) -> str:
    if fmt == "json":
        return report.to_json()
    if fmt == "md":
        return report.to_markdown()
    if fmt == "html":
        return report.to_html()
    return report.to_text(color=color)


def run_script(mode: str, report: str | None, script: str, script_args: list[str],
               every_op: bool = False) -> int:
    """``python script.py args`` with nanpass.enable(mode) on: the script sees what python
    gives it (an absolute ``__file__``, its own directory first on ``sys.path``, ``sys.argv``
    as typed), and its own exit status and message. Every finding is named whatever ends the
    run: the script returning, ``sys.exit``, ``os._exit``, or an exception from the script
    (the finding first, then the script's own traceback); status 1 when there is one."""
    if not os.path.isfile(script):
        print(f"nanpass: no such script: {script}", file=sys.stderr)
        return 2
    if report is not None:  # checked now, and written where it was asked from (a script may chdir)
        report = os.path.abspath(report)
        where = os.path.dirname(report)
        if not os.path.isdir(where) or not os.access(where, os.W_OK) or os.path.isdir(report):
            why = "is a directory" if os.path.isdir(report) else (
                f"its directory {where} does not exist" if not os.path.isdir(where) else
                f"its directory {where} is not writable")
            print(f"nanpass: cannot write the report to {report}: {why}", file=sys.stderr)
            return 2
    path = os.path.abspath(script)
    # python script.py puts the script's directory first on sys.path, and nothing else of its
    # own: here sys.path[0] is what python put there for nanpass (the caller's working
    # directory for `python -m nanpass`, the `nanpass` command's directory), which the script
    # takes instead (with python -P or PYTHONSAFEPATH neither is put there)
    launcher = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else ""
    if not getattr(sys.flags, "safe_path", False):
        if sys.path and sys.path[0] in ("", os.getcwd(), launcher):
            sys.path[0] = os.path.dirname(path)
        else:
            sys.path.insert(0, os.path.dirname(path))
    sys.argv = [script, *script_args]
    stopped = (f"nanpass run: stopped {script} at the first NaN/Inf it made (above: the op, your "
               f"line, its operands); `--mode guard` trains through it")
    on = enable(mode, report=report, **({"every_op": True} if every_op else {}))
    on.stopped = stopped  # (printed after a finding read at os._exit)
    finding: NonFiniteError | None = None
    failure: BaseException | None = None
    code: int = 0
    try:
        _run_main(path)
    except SystemExit as e:
        code = _exit_status(e.code)
    except NonFiniteError as e:  # a finding, read at a backward or an optimizer step
        finding = e
    except BaseException as e:  # noqa: BLE001 - the script's own error: reported after the finding
        failure = e
    try:
        on.disable(failing=failure is not None)  # the verdicts still on the device
    except NonFiniteError as e:
        finding = finding or e
    on.settle()  # (a gloo worker may still hold the mode: the process must not end under it)
    if finding is not None:
        after = (f"\nnanpass run: then {script} raised {type(failure).__name__} (its traceback "
                 f"below)") if failure is not None else ""
        print(f"{finding}\n{stopped}{after}", file=sys.stderr)
    if failure is not None:
        _print_script_traceback(failure, path)
        return 1
    return 1 if finding is not None else code


def _run_main(path: str) -> None:
    """Run the file at ``path`` as ``__main__``, as ``python path`` does (runpy would set
    ``sys.argv[0]`` to the path it is given, and ``__file__`` relative with it)."""
    import importlib.machinery
    import io
    import types

    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__cached__ = None
    old = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)  # noqa: S102 - the user's script, as python runs it
    finally:
        if old is not None:
            sys.modules["__main__"] = old


def _exit_status(code) -> int:
    """What python does with ``sys.exit(code)``: None is 0, an int is itself, anything else
    is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_script_traceback(exc: BaseException, path: str) -> None:
    """The script's traceback as python prints it: from the script's own frame, without
    runpy's or nanpass's (a call nanpass watched raises through its handler)."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        frames = list(t.stack)
        first = next((i for i, f in enumerate(frames) if f.filename == path), 0)
        t.stack = traceback.StackSummary.from_list(
            [f for f in frames[first:] if not f.filename.startswith(here)])
        todo.extend(x for x in (t.__cause__, t.__context__) if x is not None)
    sys.stderr.flush()
    print("".join(te.format()), end="", file=sys.stderr)


def _split_run(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """``run``'s own options, and the script and its arguments exactly as typed (argparse
    drops a ``--`` from a REMAINDER): None when there is no script (``--help``, an error)."""
    takes_value = {"--mode", "--report"}
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in takes_value:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        break
    if i >= len(argv):
        return None
    return argv[:i], argv[i:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = _split_run(argv) if argv[:1] == ["run"] else None
    if split is not None:  # the script's arguments pass untouched, a `--` among them
        own, rest = split
        args = _parser().parse_args([*[a for a in own if a != "--"], rest[0]])
        return run_script(args.mode, args.report, rest[0], rest[1:], args.every_op)
    args = _parser().parse_args(argv)
    if args.command == "run":
        return run_script(args.mode, args.report, args.script, args.args, args.every_op)
    try:
        return _run(args)
    except SystemExit as e:  # the target's own exit, anywhere else (certify traces it too)
        print(f"nanpass: the target called {_exit(e)}: it did not finish", file=sys.stderr)
        return 2
    except (CliError, Exception) as e:
        if args.debug:
            traceback.print_exc()
        message = str(e) if str(e).startswith("nanpass:") else f"nanpass: {type(e).__name__}: {e}"
        print(message.splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
