"""The documentation site (website/build_site.py): it builds with `mkdocs build --strict`, and a
real browser, headless Chromium, loads its pages from a local server and sees the benchmark
plots, the notebooks' figures and the API reference.

It runs in the current lane, which installs the docs extra; Chromium comes from the operating
system's packages (lanes.py installs it where it runs as root).
"""

from __future__ import annotations

import functools
import http.server
import importlib
import importlib.util
import os
import pathlib
import re
import shutil
import sys
import threading

import pytest

from conftest import required_import

pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def chromium() -> str:
    spec = importlib.util.spec_from_file_location("lanes", ROOT / "lanes.py")
    lanes = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = lanes  # its dataclasses look their module up there
    spec.loader.exec_module(lanes)
    found = next(filter(None, map(shutil.which, lanes.BROWSERS)), None)
    if found is None:
        message = "no Chromium here: apt-get install chromium (lanes.py does, as root)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    required_import("mkdocs")
    sys.path.insert(0, str(ROOT / "website"))
    try:
        build = importlib.import_module("build_site")
    finally:
        sys.path.remove(str(ROOT / "website"))
    folder = tmp_path_factory.mktemp("site")
    build.build(folder)
    return folder


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test's output, not a line per request
        pass


@pytest.fixture(scope="module")
def served(site):
    """The site on a local server, for the module's tests: its address."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


# Each page, a text it must show, and the fewest figures it must draw
PAGES = {
    "": ("Quick start", 0),
    "benchmarks/": ("The ratios, plotted", 3),
    "notebooks/compare_frameworks/": ("compare", 2),
    "notebooks/multihead_attention/": ("heads", 3),
    "api/porting/": ("from_state_dict", 0),
    "porting/": ("A query with no key", 0),
}


def test_a_browser_loads_the_pages_and_sees_the_plots(served):
    sync_api = required_import("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page()
        # The site loads nothing from elsewhere: any other address is refused
        page.route("**/*", lambda route: _local_only(route, served))
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        for path, (text, figures) in PAGES.items():
            response = page.goto(served + path, wait_until="load")
            assert response is not None and response.ok, path
            assert text in page.inner_text("article"), path
            drawn = page.eval_on_selector_all(
                "article img",
                "images => images.filter(i => i.complete && i.naturalWidth > 0).length",
            )
            assert drawn >= figures, (path, drawn)
        browser.close()
    assert not errors, errors


def _local_only(route, served: str) -> None:
    if route.request.url.startswith(served) or route.request.url.startswith("data:"):
        route.continue_()
    else:
        route.abort()


def test_the_site_shows_the_readme_with_its_links_made_for_the_site(site):
    # The README's links to docs/ and benchmarks/ lead to the site's own pages
    home = (site / "index.html").read_text()
    assert 'href="cli/"' in home and 'href="benchmarks/"' in home
    assert not [link for link in re.findall(r'href="([^"]*)"', home) if ".md" in link]
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert all(f"bench-{name}.png" in benchmarks for name in ("torch", "tensorflow"))
