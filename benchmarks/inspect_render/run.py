"""The cache inspector page: how long headless Chromium takes to draw a long request's token map.

A synthetic record (4096 tokens x 30 layers, ~123k cells, 4 compressions, every entry scored) is
given to the page through `window.inspector.show`; the page reports the time of its token-map render
(`renderMs`) and of the whole show (`loadMs`: checks, layout, map and bars). Then the slider is
moved over every compression and each of those renders is timed too. The page is read from
confkv/server/web/inspect straight from disk (no server, no model).

    python benchmarks/inspect_render/run.py                 # 4096 tokens x 30 layers, 5 repeats
    python benchmarks/inspect_render/run.py --tokens 8192   # a longer one
Results: benchmarks/inspect_render/results/inspect_render.{json,md}. Needs Chromium (`make tools`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import Provenance, save_report  # noqa: E402
from confkv.compress.history import DROPPED, FULL, KEY_ONLY, LayerRecord, tier_runs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

ROOT = Path(__file__).resolve().parents[2]
PAGE_DIR = ROOT / "confkv" / "server" / "web" / "inspect"
ORIGIN = "http://inspector.invalid"  # never resolved: every request to it is answered from PAGE_DIR
CHROMIUM = "/usr/bin/chromium"
MEASURES = ("confkv/server/web/inspect",)
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def synthetic_record(
    num_tokens: int = 4096, num_layers: int = 30, num_prompt: int = 4000, interval: int = 32, seed: int = 0
) -> dict:
    """A record shaped like GET /inspect/requests/{id}: entries only lose tiers from one compression to
    the next, sink tokens and a recent window stay FULL, scores are NaN for entries dropped before."""
    rng = np.random.default_rng(seed)
    retention = rng.random((num_layers, num_tokens))
    steps = [*range(0, num_tokens - num_prompt - 1, interval), num_tokens - num_prompt - 1]
    tiers_before = np.full((num_layers, num_tokens), FULL, dtype=np.int8)
    compressions = []
    for index, step in enumerate(steps):
        n = num_prompt + step
        squeeze = 0.1 * index  # later compressions keep less
        tiers = np.where(retention >= 0.5 + squeeze, FULL, np.where(retention >= 0.25 + squeeze, KEY_ONLY, DROPPED))
        tiers[:, :4] = FULL
        tiers[:, max(4, n - 64) : n] = FULL
        tiers = np.minimum(tiers, tiers_before).astype(np.int8)
        tiers_before = tiers
        layers = []
        for layer in range(num_layers):
            scored = tiers[layer, :n] != DROPPED
            scores = np.where(scored, retention[layer, :n] * 3.0, np.nan).astype(np.float16)
            confidence = np.where(scored, retention[layer, :n], np.nan).astype(np.float16)
            layers.append(LayerRecord(tier_runs(tiers[layer, :n]), scores, confidence).to_json())
        compressions.append({"step": step, "num_tokens": n, "final": index == len(steps) - 1, "layers": layers})
    words = ["The", " cache", " keeps", " what", " matters", ",", " and", " drops", " the", " rest", ".", "\n"]
    return {
        "id": "gen-synthetic",
        "prompt": None,
        "text": "",
        "tokens": [words[i % len(words)] for i in range(num_tokens)],
        "num_prompt_tokens": num_prompt,
        "num_layers": num_layers,
        "entry_bytes": {"full": 1024, "key_only": 640},
        "compressions": compressions,
        "compression_metrics": None,
        "params": {"policy": "dynamic", "compression_rate": 0.75, "kv_cache_dtype": "int8"},
    }


def launch_chromium(playwright):
    """Debian's Chromium under Playwright (Playwright's own browser download is not used)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])


def open_page_from_disk(browser, metrics_text: str = ""):
    """The inspector page with its files read from PAGE_DIR and /metrics answered with `metrics_text`;
    any other request (the API) is answered 404."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})

    def answer(route):
        path = route.request.url.removeprefix(ORIGIN).split("?", 1)[0]
        if path == "/inspect":
            file = PAGE_DIR / "index.html"
        elif path.startswith("/inspect/assets/"):
            file = PAGE_DIR / path.removeprefix("/inspect/assets/")
        elif path == "/metrics":
            return route.fulfill(status=200, content_type="text/plain", body=metrics_text)
        else:
            file = None
        if file is None or file.parent != PAGE_DIR or not file.is_file():
            return route.fulfill(status=404, content_type="application/json", body='{"error": {"type": "not_found"}}')
        return route.fulfill(status=200, content_type=_TYPES.get(file.suffix, "text/plain"), body=file.read_bytes())

    page.route(f"{ORIGIN}/**", answer)
    page.goto(f"{ORIGIN}/inspect")
    page.wait_for_function("window.inspector !== undefined")
    return page


def measure(page, record: dict) -> dict:
    """Show the record, then replay every compression with the slider: the page's timings, in ms."""
    shown = page.evaluate("record => window.inspector.show(record)", record)
    replay = page.evaluate(
        """() => {
            const times = [];
            for (let i = 0; i < inspector.numCompressions(); i++) {
                inspector.setStep(i);
                times.push(inspector.renderMs);
            }
            return times;
        }"""
    )
    return {"render_ms": shown["renderMs"], "load_ms": shown["loadMs"], "replay_ms": replay}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "inspect_render")
    args = parser.parse_args()
    provenance = Provenance.capture(MEASURES)

    from playwright.sync_api import sync_playwright

    record = synthetic_record(args.tokens, args.layers, num_prompt=args.tokens - 96)
    runs = []
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        version = browser.version
        for _ in range(args.repeats):
            page = open_page_from_disk(browser)
            runs.append(measure(page, record))
            page.close()
        browser.close()
    cells = args.tokens * args.layers
    show = [r["load_ms"] for r in runs]
    render = [r["render_ms"] for r in runs]
    replay = [ms for r in runs for ms in r["replay_ms"]]
    table = "\n".join(
        [
            f"{args.tokens} tokens x {args.layers} layers ({cells} cells), {len(record['compressions'])} compressions, "
            f"headless Chromium {version}, {args.repeats} page loads; median (max), ms.",
            "",
            "| what | median ms | max ms |",
            "| --- | ---: | ---: |",
            f"| show a record (checks, layout, map, bars) | {statistics.median(show):.1f} | {max(show):.1f} |",
            f"| token-map render, first | {statistics.median(render):.1f} | {max(render):.1f} |",
            f"| token-map render, slider move | {statistics.median(replay):.1f} | {max(replay):.1f} |",
        ]
    )
    data = {"tokens": args.tokens, "layers": args.layers, "chromium": version, "runs": runs}
    save_report(args.out, "Cache inspector: token-map render time", table, data, args, provenance)


if __name__ == "__main__":
    main()
