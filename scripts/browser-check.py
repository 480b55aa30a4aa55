#!/usr/bin/env python3
"""Check a `ksearch report` page in a real headless Chromium (driven by Playwright).

    browser-check.py REPORT.html [--nodes N] [--evaluations N] [--screenshot out.png [--height PX | --full-page]]

Loads the page from file:// with the network blocked and fails (exit 1, one line per problem)
when the console logs an error or the page throws, when the number of tree nodes shown differs
from the number given (else the one the page embeds), or when a plot does not have one point per
evaluation: the two progress plots one per evaluation, the roofline one per evaluation that
passed with a throughput. Exit 3 when Playwright or Chromium is missing (the caller decides
whether that is a skip). Chromium is /usr/bin/chromium unless KSEARCH_CHROMIUM names another.
"""
import argparse
import os
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--nodes", type=int, help="nodes the run has (default: the count the page embeds)")
    ap.add_argument("--evaluations", type=int, help="evaluations plotted (default: the page's)")
    ap.add_argument("--screenshot", help="write a PNG of the page here")
    ap.add_argument("--full-page", action="store_true", help="the whole page in the screenshot, not the top")
    ap.add_argument("--height", type=int, default=900, help="height of the window in pixels (width 1280)")
    a = ap.parse_args()

    chromium = os.environ.get("KSEARCH_CHROMIUM", "/usr/bin/chromium")
    if not os.path.exists(chromium):
        print(f"browser-check: no Chromium at {chromium} (Debian: apt-get install chromium)")
        return 3
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print(f"browser-check: Playwright is not installed for {sys.executable} (pip install playwright)")
        return 3
    if not os.path.isfile(a.report):
        print(f"browser-check: {a.report}: no such file")
        return 2

    problems = []
    url = "file://" + os.path.abspath(a.report)
    with tempfile.TemporaryDirectory(prefix="ksearch-chromium-") as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile,
            executable_path=chromium,
            headless=True,
            viewport={"width": 1280, "height": a.height},
            args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
            ],
        )
        # The page is self-contained: any request beyond the file itself is a fault.
        def route(r):
            if r.request.url != url:
                problems.append(f"the page requested {r.request.url}")
                return r.abort()
            return r.continue_()
        ctx.route("**/*", route)
        page = ctx.new_page()
        page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.goto(url, wait_until="load")
        page.wait_for_function("window.ksearchCharts !== undefined && window.ksearchData !== undefined", timeout=15000)

        data = page.evaluate("window.ksearchData")
        shown = page.evaluate("document.querySelectorAll('details.node').length")
        want = a.nodes if a.nodes is not None else data["node_count"]
        if shown != want:
            problems.append(f"{shown} tree nodes shown, expected {want}")
        ids = page.evaluate("Array.from(document.querySelectorAll('details.node')).map(e => +e.dataset.node)")
        if len(set(ids)) != len(ids):
            problems.append("a tree node is shown twice")

        evals = data["evaluations"]
        n_evals = a.evaluations if a.evaluations is not None else len(evals)
        if len(evals) != n_evals:
            problems.append(f"the page embeds {len(evals)} evaluations, expected {n_evals}")
        timed = sum(1 for e in evals if e["intensity"] is not None and e["gflops"] is not None)
        counts = page.evaluate(
            """() => Object.fromEntries(Object.entries(window.ksearchCharts).map(
                   ([k, c]) => [k, c.data.datasets[0].data.length]))"""
        )
        for chart, want_points in (("chart-evals", n_evals), ("chart-time", n_evals), ("chart-roofline", timed)):
            got = counts.get(chart)
            if got is None:
                problems.append(f"plot {chart} missing")
            elif got != want_points:
                problems.append(f"plot {chart} has {got} points, expected {want_points}")
        # Every plot was drawn (a canvas of non-zero size).
        sizes = page.evaluate(
            "Object.entries(window.ksearchCharts).map(([k, c]) => [k, c.canvas.width, c.canvas.height])"
        )
        for k, w, h in sizes:
            if w == 0 or h == 0:
                problems.append(f"plot {k} was not drawn")
        if a.screenshot:
            page.screenshot(path=a.screenshot, full_page=a.full_page)
        ctx.close()

    for pr in problems:
        print(f"browser-check: {a.report}: {pr}")
    if problems:
        return 1
    print(
        f"browser-check: {a.report}: ok ({shown} nodes, {n_evals} evaluations, {timed} on the roofline)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
