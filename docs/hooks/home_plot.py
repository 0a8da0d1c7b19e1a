"""The home page's plot, made by the docs build (mkdocs.yml: ``hooks``) from a real run of
``examples/empty_sequence.py``: the plain model's training loss, which turns NaN at the batch
with an empty sequence, and its hardened twin's. The picture is drawn at every build and never
stored; ``tests/test_docs.py`` checks it is the run's and that the page shows it in the first
screen at 1280 px.

    python docs/hooks/home_plot.py out.svg      # the same picture, without mkdocs
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "empty_sequence.py"
IMAGE = "img/nan_loss.svg"  # where docs/index.md finds it in the built site
STEPS, BAD = 100, 60
PLAIN, HARDENED = "#d32f2f", "#3f51b5"  # red; the site's indigo


def loss_curves(steps: int = STEPS, bad: int = BAD) -> tuple[list[float], list[float]]:
    """The example's two runs: the plain model's loss at every step, and the hardened twin's."""
    sys.path.insert(0, str(EXAMPLE.parent))  # the example imports its neighbour _common
    try:
        spec = importlib.util.spec_from_file_location("empty_sequence", EXAMPLE)
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        plain, hardened, _ = example.runs(steps, bad)
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return plain, hardened


def loss_svg(plain: list[float], hardened: list[float]) -> str:
    """Both curves on one chart; where the plain loss is not finite, a band says so."""
    w, h, left, right, top, bottom = 680, 210, 44, 12, 24, 26
    n = max(len(plain), len(hardened))
    peak = max(v for v in plain + hardened if math.isfinite(v))  # a loss: the axis starts at 0
    scale = 10.0 ** math.floor(math.log10(peak))
    tick = next(t * scale for t in (0.25, 0.5, 1, 2, 2.5) if peak / (t * scale) <= 5)
    ymax = tick * math.ceil(peak / tick)
    dead = next((i for i, v in enumerate(plain) if not math.isfinite(v)), None)

    def x(i: float) -> float:
        return left + (w - left - right) * i / max(n - 1, 1)

    def y(v: float) -> float:
        return top + (h - top - bottom) * (1 - v / ymax)

    def line(values: list[float], color: str, width: float, opacity: float = 1) -> str:
        pts = " ".join(f"{x(i):.2f},{y(v):.2f}" for i, v in enumerate(values) if math.isfinite(v))
        return (f'<polyline fill="none" stroke="{color}" stroke-width="{width}" '
                f'stroke-opacity="{opacity}" stroke-linejoin="round" points="{pts}"/>')

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12" fill="#444">',
           "<title>Training loss of examples/empty_sequence.py, plain and hardened</title>",
           f'<rect width="{w}" height="{h}" fill="white"/>']
    if dead is not None:
        out.append(f'<rect x="{x(dead):.2f}" y="{top}" width="{x(n - 1) - x(dead):.2f}" '
                   f'height="{y(0) - top:.2f}" fill="{PLAIN}" fill-opacity="0.08"/>')
        out.append(f'<line x1="{x(dead):.2f}" y1="{top}" x2="{x(dead):.2f}" y2="{y(0):.2f}" '
                   f'stroke="{PLAIN}" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x(dead) + 8:.2f}" y="{top + 16}" fill="{PLAIN}">plain: loss NaN '
                   f'from step {dead} on</text>')
        out.append(f'<text x="{x(dead) + 8:.2f}" y="{top + 31}" fill="{PLAIN}">'
                   "(an empty sequence)</text>")
    for k in range(round(ymax / tick) + 1):
        v = tick * k
        out.append(f'<line x1="{left}" y1="{y(v):.2f}" x2="{w - right}" y2="{y(v):.2f}" '
                   'stroke="#e0e0e0"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.2f}" text-anchor="end">{v:g}</text>')
    for k in range(0, n, 20):
        out.append(f'<text x="{x(k):.2f}" y="{h - bottom + 16}" text-anchor="middle">{k}</text>')
    out.append(f'<text x="{w - right}" y="{h - bottom + 16}" text-anchor="end">step</text>')
    out.append(f'<text x="{left - 6}" y="{top - 10}" text-anchor="end">loss</text>')
    # plain underneath, wide and pale: where the two agree (every step before the NaN) the
    # hardened line runs inside it
    out.append(line(plain, PLAIN, 6, 0.35))
    out.append(line(hardened, HARDENED, 1.6))
    lx, ly = left + 150, top + 16
    for i, (label, color, width, opacity) in enumerate((("plain model", PLAIN, 6, 0.35),
                                                         ("nanpass.harden(model)", HARDENED, 1.6, 1))):
        out.append(f'<line x1="{lx}" y1="{ly + 16 * i - 4}" x2="{lx + 22}" y2="{ly + 16 * i - 4}" '
                   f'stroke="{color}" stroke-width="{width}" stroke-opacity="{opacity}"/>')
        out.append(f'<text x="{lx + 28}" y="{ly + 16 * i}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def on_files(files, config):
    """mkdocs: add the picture to the site, drawn from a fresh run."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, IMAGE, content=loss_svg(*loss_curves())))
    return files


if __name__ == "__main__":
    pathlib.Path(sys.argv[1]).write_text(loss_svg(*loss_curves()))
