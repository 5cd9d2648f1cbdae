"""The cache inspector page (GET /inspect) in headless Chromium: the token map, its slider and tooltip,
the bytes per layer, the comparison with the uncompressed answer and the live panel.

The first tests read the page from disk and give it synthetic records (no server); the last drives it
against the live server. CONFKV_SAVE_INSPECT_FIGURES=1 saves a screenshot of a real run to
benchmarks/inspect_render/results/inspect.png (the render time is recorded by benchmarks/inspect_render/run.py).
"""

from __future__ import annotations

import base64
import math
import os
import re

import httpx
import numpy as np
import pytest
from playwright.sync_api import sync_playwright

from benchmarks.inspect_render.run import (
    launch_chromium,
    open_page_from_disk,
    synthetic_record,
)
from benchmarks.report import BENCHMARKS
from confkv.compress.history import tier_counts, tiers_by_position

SAVE_FIGURES = os.environ.get("CONFKV_SAVE_INSPECT_FIGURES") == "1"
TIER_NAMES = {2: "FULL", 1: "KEY_ONLY", 0: "dropped"}
METRICS = (
    'kv_cache_bytes{pool="running"} 1048576\nkv_cache_bytes{pool="prefix"} 524288\n'
    'kv_cache_bytes{pool="audit"} 0\nkv_cache_capacity_bytes 4194304\nrequests_running 2\n'
)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


@pytest.fixture
def page_errors():
    """Uncaught errors of the pages a test opens; the test fails if any."""
    errors: list[str] = []
    yield errors
    assert not errors, errors


def watch(page, errors: list[str]):
    page.on("pageerror", lambda error: errors.append(str(error)))
    return page


def tiers_of(compression: dict, layer: int) -> np.ndarray:
    return tiers_by_position(compression["layers"][layer]["tiers"])


def values_of(compression: dict, layer: int, field: str) -> np.ndarray | None:
    encoded = compression["layers"][layer][field]
    return None if encoded is None else np.frombuffer(base64.b64decode(encoded), dtype="<f2").astype(np.float32)


def tier_changes(record: dict, layer: int, pos: int) -> list[str]:
    """The tooltip's account of one entry: written FULL, then each compression that changed its tier."""
    changes, before = [], 2
    for comp in record["compressions"]:
        if pos < comp["num_tokens"] and (tier := int(tiers_of(comp, layer)[pos])) != before:
            changes.append(f"step {comp['step']}: {TIER_NAMES[before]} \u2192 {TIER_NAMES[tier]}")
            before = tier
    return changes


def latest_value(record: dict, index: int, layer: int, pos: int, field: str) -> float | None:
    for comp in reversed(record["compressions"][: index + 1]):
        values = values_of(comp, layer, field)
        if values is not None and pos < len(values) and not math.isnan(values[pos]):
            return float(values[pos])
    return None


def layer_bytes(record: dict, comp: dict) -> list[dict[str, int]]:
    per_entry = record["entry_bytes"]
    return [
        {
            "full": int((tiers_of(comp, layer) == 2).sum()) * per_entry["full"],
            "key_only": int((tiers_of(comp, layer) == 1).sum()) * per_entry["key_only"],
        }
        for layer in range(record["num_layers"])
    ]


def hover(page, layer: int, pos: int) -> str:
    """Move the mouse onto a cell of the token map; the tooltip's text."""
    centre = page.evaluate("([layer, pos]) => inspector.cellCenter(layer, pos)", [layer, pos])
    box = page.locator("#map").bounding_box()
    page.mouse.move(box["x"] + centre["x"], box["y"] + centre["y"])
    page.locator("#tooltip").wait_for(state="visible")
    return page.inner_text("#tooltip")


def lcs_f(a: list[str], b: list[str]) -> float:
    """ROUGE-L F-measure over word lists (the page's definition, computed independently)."""
    if not a or not b:
        return float(len(a) == len(b))
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    lcs = table[-1][-1]
    return 0.0 if not lcs else 2 * lcs / (len(a) + len(b))


def test_a_4096_token_30_layer_record_renders_with_the_counts_of_its_runs(browser, page_errors):
    page = watch(open_page_from_disk(browser, METRICS), page_errors)
    record = synthetic_record(num_tokens=4096, num_layers=30)
    shown = page.evaluate("record => window.inspector.show(record)", record)
    print(f"\ntoken map, 4096 tokens x 30 layers: render {shown['renderMs']:.1f} ms, show {shown['loadMs']:.1f} ms")
    assert shown["renderMs"] > 0 and page.evaluate("inspector.step()") == len(record["compressions"]) - 1

    final = record["compressions"][-1]
    assert page.evaluate("inspector.cellCounts()") == tier_counts(final)
    assert page.evaluate("inspector.layerBytes()") == layer_bytes(record, final)
    assert "(final)" in page.inner_text("#step-label")
    for index, comp in enumerate(record["compressions"]):
        page.evaluate("i => inspector.setStep(i)", index)
        assert page.evaluate("inspector.cellCounts()") == tier_counts(comp)
        assert f"step {comp['step']} " in page.inner_text("#step-label")

    # Several tokens share a pixel column here: the tooltip names one of the column's tokens.
    text = hover(page, 5, 2000)
    pos = int(re.search(r"position (\d+) \(prompt\) \u00b7 layer 5", text)[1])
    tokens_per_column = 4096 / page.evaluate("document.getElementById('map').width")
    assert abs(pos - 2000) <= tokens_per_column + 1
    assert text.startswith(record["tokens"][pos].replace("\n", "\u21b5"))

    page.wait_for_function("window.inspector.live !== null")
    live = page.evaluate("inspector.live")
    assert live == {"running": 1048576, "prefix": 524288, "audit": 0, "capacity": 4194304, "requests": 2}
    assert "requests running" in page.inner_text("#live-figures")
    page.close()


def test_the_slider_replays_compressions_and_the_tooltip_tells_an_entrys_story(browser, page_errors):
    page = watch(open_page_from_disk(browser), page_errors)
    record = synthetic_record(num_tokens=300, num_layers=6, num_prompt=240, interval=16, seed=1)
    comps = record["compressions"]
    page.evaluate("record => window.inspector.show(record)", record)

    page.focus("#step")
    page.keyboard.press("Home")  # the slider to the end of prefill, as a person would
    assert page.evaluate("inspector.step()") == 0
    assert page.inner_text("#step-label").startswith(f"step {comps[0]['step']} (end of prefill)")
    assert page.evaluate("inspector.cellCounts()") == tier_counts(comps[0])
    page.keyboard.press("ArrowRight")
    assert page.evaluate("inspector.step()") == 1
    assert page.evaluate("inspector.cellCounts()") == tier_counts(comps[1])

    # One token per column: the tooltip names exactly the cell under the mouse.
    layer = 2
    pos = next(p for p in range(100, 240) if len(tier_changes(record, layer, p)) == 2)  # FULL, KEY_ONLY, dropped
    changes = tier_changes(record, layer, pos)
    text = hover(page, layer, pos)
    assert text.startswith(record["tokens"][pos])
    assert f"position {pos} (prompt) \u00b7 layer {layer}" in text
    assert f"tier: {TIER_NAMES[int(tiers_of(comps[1], layer)[pos])]}" in text
    for field, label in (("scores", "score"), ("retention", "retention")):
        value = latest_value(record, 1, layer, pos, field)
        assert f"{label}: {value:.4f}" in text if value is not None else f"{label}: not scored" in text
    assert all(change in text for change in changes)

    # A generated position not yet in the cache at the end of prefill.
    page.keyboard.press("Home")
    text = hover(page, 0, comps[0]["num_tokens"] + 5)
    assert "(generated)" in text and "not in the cache" in text
    page.close()


def test_rouge_l_and_the_first_divergent_word(browser, page_errors):
    page = watch(open_page_from_disk(browser), page_errors)
    cases = [
        ("the cat sat on the mat", "the cat sat on the mat"),
        ("the cat sat on the mat", "the cat lay on a mat today"),
        ("Paris is the capital", "Paris is the capital of France"),
        ("", "something"),
        ("one  two\nthree", "one two three"),
    ]
    for a, b in cases:
        rouge = page.evaluate("([a, b]) => inspector.rougeL(a, b)", [a, b])
        assert rouge == pytest.approx(lcs_f(a.split(), b.split()))
        divergence = page.evaluate("([a, b]) => inspector.firstDivergence(a, b)", [a, b])
        words_a, words_b = a.split(), b.split()
        if words_a == words_b:
            assert divergence == -1
        else:
            assert words_a[:divergence] == words_b[:divergence]
            assert divergence == min(len(words_a), len(words_b)) or words_a[divergence] != words_b[divergence]
    page.close()


PROMPT = (
    "Read the delivery log, then answer the question.\n\n"
    + "\n".join(
        f"Entry {i}: the courier from {city} left at {8 + i % 9}:{15 * (i % 4):02d} with {3 + 7 * i % 40} parcels "
        f"for the {colour} warehouse, and reported {weather} roads."
        for i, (city, colour, weather) in enumerate(
            zip(
                ["Lyon", "Turin", "Ghent", "Porto", "Brno", "Graz", "Malmo", "Cork", "Bergen", "Lille"] * 2,
                ["red", "blue", "green", "grey", "yellow"] * 4,
                ["dry", "wet", "icy", "busy"] * 5,
                strict=True,
            )
        )
    )
    + "\n\nQuestion: when did the courier from Ghent leave, and how many parcels did it carry?\nAnswer:"
)


def run_on_page(page, rate: float) -> dict:
    """Fill the form as a person would, press Run, wait for the page to finish; the API's record."""
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")
    page.select_option("#policy", "dynamic")
    page.fill("#rate", str(rate))
    page.click("#run")
    page.wait_for_function("['done', 'error'].includes(window.inspector.status)", timeout=300_000)
    assert page.evaluate("inspector.status") == "done", page.inner_text("#error")
    return page.evaluate("({ id: inspector.requestId, response: inspector.response, plain: inspector.plainResponse })")


def check_comparison(page, compressed: str, plain: str) -> bool:
    """The divergence marker is in both answers exactly when their words differ; ROUGE-L is shown."""
    differ = compressed.split() != plain.split()
    assert page.locator("#text-compressed mark.diverge").count() == int(differ)
    assert page.locator("#text-plain mark.diverge").count() == int(differ)
    assert f"ROUGE-L F {lcs_f(compressed.split(), plain.split()):.3f}" in page.inner_text("#compare-summary")
    return differ


@pytest.mark.slow
def test_a_real_run_is_drawn_as_the_api_records_it(server, browser, page_errors):
    page = watch(browser.new_page(viewport={"width": 1400, "height": 1000}), page_errors)
    page.goto(f"{server.url}/inspect")
    run = run_on_page(page, 0.75)
    record = httpx.get(f"{server.url}/inspect/requests/{run['id']}", timeout=30).raise_for_status().json()
    comps = record["compressions"]
    assert comps[-1]["final"] and len(comps) >= 2 and len(record["tokens"]) > record["num_prompt_tokens"] > 200

    # The final state: the page's cells by tier, the record's runs and the answer's metrics agree.
    counts = page.evaluate("inspector.cellCounts()")
    assert counts == tier_counts(comps[-1]) == run["response"]["compression_metrics"]["entries"]
    assert counts["dropped"] + counts["key_only"] > 0
    assert page.evaluate("inspector.layerBytes()") == layer_bytes(record, comps[-1])

    # The slider back to the end of prefill: its label and counts follow.
    page.focus("#step")
    page.keyboard.press("Home")
    assert page.inner_text("#step-label").startswith(f"step {comps[0]['step']} (end of prefill)")
    assert page.evaluate("inspector.cellCounts()") == tier_counts(comps[0]) != counts
    page.keyboard.press("End")
    assert "(final)" in page.inner_text("#step-label")

    # Hover a word of the prompt in a middle layer.
    layer = record["num_layers"] // 2
    pos = next(
        p
        for p in range(record["num_prompt_tokens"] // 2, record["num_prompt_tokens"])
        if record["tokens"][p].strip().isalpha()
    )
    text = hover(page, layer, pos)
    assert text.startswith(record["tokens"][pos]) and f"position {pos} (prompt) \u00b7 layer {layer}" in text
    assert f"tier: {TIER_NAMES[int(tiers_of(comps[-1], layer)[pos])]}" in text

    # The live panel reads the server's /metrics.
    page.wait_for_function("window.inspector.live !== null")
    assert page.evaluate("inspector.live.capacity") == server.metric("kv_cache_capacity_bytes")

    if not check_comparison(page, run["response"]["text"], run["plain"]["text"]):
        run = run_on_page(page, 0.95)  # equal at 0.75: a harder squeeze for the marker
        check_comparison(page, run["response"]["text"], run["plain"]["text"])
    print(f"\ncompressed: {run['response']['text']!r}\nuncompressed: {run['plain']['text']!r}")
    if SAVE_FIGURES:  # the whole page in the window (a resize would redraw the map and hide the tooltip)
        page.set_viewport_size({"width": 1400, "height": page.evaluate("document.body.scrollHeight") + 40})
        page.wait_for_timeout(500)
        hover(page, layer, pos)  # the same prompt: the same cell
        results = BENCHMARKS / "inspect_render" / "results"
        results.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=results / "inspect.png", full_page=True)

    # The page reopened on the last request's id shows its record.
    record = httpx.get(f"{server.url}/inspect/requests/{run['id']}", timeout=30).raise_for_status().json()
    page.goto(f"{server.url}/inspect?id={run['id']}")
    page.wait_for_function("['done', 'error'].includes(window.inspector.status)", timeout=60_000)
    assert page.evaluate("inspector.cellCounts()") == tier_counts(record["compressions"][-1])
    assert page.input_value("#prompt") == record["prompt"]

    # A request the server refuses: its message is shown.
    page.fill("#high", "0.5")
    page.fill("#medium", "0.9")
    page.click("#run")
    page.wait_for_function("window.inspector.status === 'error'", timeout=60_000)
    assert "medium" in page.inner_text("#error")
    page.close()
