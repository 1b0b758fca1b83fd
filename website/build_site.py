"""Build the documentation site: the README, docs/, the benchmarks with their plots, the
notebooks with their outputs and the API reference, with MkDocs (Material) into one folder.

    python website/build_site.py [SITE_DIR]     # default: website/public; needs mha[docs]

The pages are staged in a temporary folder beside a copy of website/mkdocs.yml: the README as
the home page and benchmarks/README.md as the benchmarks page, their links to docs/ rewritten
for the site; docs/*.md as they are; the notebooks as committed; an API page per module,
which mkdocstrings fills from the docstrings; the plots of benchmarks/results.json
(website/plots.py). `mkdocs build --strict` then makes any warning, a broken link or a
docstring it cannot read, an error.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "website"))

import plots  # noqa: E402  (website/plots.py, beside this script)

# The API pages: (file, title, module)
API = (
    ("mha", "mha: the backend selection, weights and files", "mha"),
    ("porting", "mha.porting: importing other models' attention", "mha.porting"),
    ("harness", "mha.harness: the agreement of the backends", "mha.harness"),
    ("conversion", "mha.conversion: files of every framework", "mha.conversion"),
    ("encoding", "mha.encoding: rotary embeddings, ALiBi, sinusoids", "mha.encoding"),
    ("numpy", "mha.backends.numpy: the reference layers", "mha.backends.numpy"),
)

# Links of the README and benchmarks/README.md as the site places their targets
_LINKS = (
    (r"\]\((?:\.\./)?docs/", "]("),
    (r"\]\((?:\.\./)?benchmarks/README\.md", "](benchmarks.md"),
)


def site_links(text: str) -> str:
    """Markdown of the repository with its links to docs/ and benchmarks/ as on the site."""
    for pattern, replacement in _LINKS:
        text = re.sub(pattern, replacement, text)
    return text


def stage(folder: pathlib.Path) -> None:
    """Write the site's pages and mkdocs.yml into `folder`."""
    docs = folder / "docs"
    shutil.copytree(ROOT / "docs", docs)
    for page in docs.glob("*.md"):
        page.write_text(site_links(page.read_text()))
    (docs / "index.md").write_text(site_links((ROOT / "README.md").read_text()))
    benchmarks = site_links((ROOT / "benchmarks" / "README.md").read_text())
    images = plots.write_plots(ROOT / "benchmarks" / "results.json", docs / "img")
    (docs / "benchmarks.md").write_text(plots.with_plots(benchmarks, images))
    shutil.copytree(ROOT / "notebooks", docs / "notebooks", ignore=_not_notebooks)
    (docs / "api").mkdir()
    for name, title, module in API:
        (docs / "api" / f"{name}.md").write_text(f"# {title}\n\n::: {module}\n")
    shutil.copy(ROOT / "website" / "mkdocs.yml", folder / "mkdocs.yml")


def _not_notebooks(folder: str, names: list[str]) -> list[str]:
    return [name for name in names if not name.endswith(".ipynb")]


def build(site: pathlib.Path) -> None:
    """Stage the pages and build the site into `site` (replaced); a warning is an error."""
    with tempfile.TemporaryDirectory(prefix="mha-site-") as scratch:
        folder = pathlib.Path(scratch)
        stage(folder)
        command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
        command += ["--config-file", str(folder / "mkdocs.yml"), "--site-dir", str(site)]
        # MHA_ROOT: where mkdocstrings finds mha; MkDocs 2's notice is not the site's
        environment = {**os.environ, "MHA_ROOT": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
        # In the staging folder: mkdocs-jupyter keeps a cache (.cache/) where it runs
        completed = subprocess.run(command, env=environment, cwd=folder, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"mkdocs build --strict failed (exit {completed.returncode})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    site = pathlib.Path(argv[0]) if argv else ROOT / "website" / "public"
    build(site.resolve())
    print(f"The site is in {site}: open {site / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
