"""The benchmark plots of the documentation site: from a report of `mha bench --output`
(benchmarks/results.json), one picture per backend of each row's ratio to the framework's own
layer, with its 95% interval, beside 1.0 (a tie) and the project's bar of 1.10.
"""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only, no window

import matplotlib.pyplot as plt

BAR = 1.10  # mha.bench.BAR: no row slower than this against the framework's own layer


def rows_of(report: dict) -> dict[str, list[dict]]:
    """The report's rows against a framework's layer (numpy's roofline aside), by backend."""
    by_backend: dict[str, list[dict]] = {}
    for row in report["results"]:
        if row["backend"] != "numpy":
            by_backend.setdefault(row["backend"], []).append(row)
    return by_backend


def label(row: dict) -> str:
    config = row["config"]
    shape = (config["batch_size"], config["length"], config["num_hiddens"], config["num_heads"])
    lengths = "lengths" if config["valid_lens"] else "no lengths"
    weights = "weights" if config["need_weights"] else "no weights"
    return f"{row['mode']} {shape} {lengths}, {weights}, {row['pass']} vs {row['builtin']}"


def plot_backend(backend: str, rows: list[dict], path: pathlib.Path) -> None:
    """A horizontal bar per row: the ratio, its interval, the lines at 1.0 and BAR."""
    height = 0.28 * len(rows) + 1.2
    figure, axes = plt.subplots(figsize=(9, height))
    positions = range(len(rows))
    ratios = [row["ratio"] for row in rows]
    below = [row["ratio"] - row["interval"][0] for row in rows]
    above = [row["interval"][1] - row["ratio"] for row in rows]
    colors = ["tab:red" if row["interval"][0] > BAR else "tab:blue" for row in rows]
    axes.barh(positions, ratios, xerr=[below, above], color=colors, alpha=0.8)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.axvline(BAR, color="tab:red", linestyle="--", linewidth=1)
    axes.set_yticks(list(positions), [label(row) for row in rows], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("mha's time / the framework's layer's (below 1.0: mha is faster)")
    axes.set_title(f"{backend}: ratio per row with its 95% interval")
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def write_plots(report_path: pathlib.Path, folder: pathlib.Path) -> list[tuple[str, str]]:
    """Write one PNG per backend into `folder`; returns (backend, file name) of each."""
    report = json.loads(report_path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    images = []
    for backend, rows in rows_of(report).items():
        name = f"bench-{backend}.png"
        plot_backend(backend, rows, folder / name)
        images.append((backend, name))
    return images


def with_plots(page: str, images: list[tuple[str, str]]) -> str:
    """The benchmarks page with a section of the plots after its first paragraph's heading."""
    section = ["## The ratios, plotted", ""]
    section += [
        "Each bar is one row of the table below (benchmarks/results.json): mha's time over "
        "the framework's own layer's, its 95% interval, the line at 1.0 (a tie) and the "
        f"dashed line at the project's bar, {BAR:.2f}; a row whose whole interval is above "
        "the bar is red.",
        "",
    ]
    section += [f"![{backend}: ratio per row](img/{name})\n" for backend, name in images]
    title, _, rest = page.partition("\n")
    return f"{title}\n\n" + "\n".join(section) + "\n" + rest
