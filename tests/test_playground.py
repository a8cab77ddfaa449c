"""The playground page in headless Chromium: a question gets a streamed answer and a hop panel."""

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
sync_api = pytest.importorskip("playwright.sync_api")

from rig_decode.server import create_app  # noqa: E402

from .server_helpers import ANSWER, QUERY, serve, tiny_config, tiny_engine  # noqa: E402


def _chromium() -> str:
    path = os.environ.get("RIG_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no Chromium (apt install chromium, or set RIG_CHROMIUM to its path)")
    return path


def test_playground_streams_an_answer_and_shows_hops(model, tok, tmp_path):
    chromium = _chromium()
    app = create_app(tiny_config(), engine=tiny_engine(model, tok))
    with serve(app) as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        chunks = []
        page.on("response", lambda r: chunks.append(r.url) if "/v1/chat/completions" in r.url else None)
        page.goto(base + "/")
        assert page.title() == "rig_decode playground"
        page.fill("#question", "Which release fixed error E1234?")
        page.click("#ask")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('finish')", timeout=30_000)
        assert page.inner_text("#answer") == ANSWER
        hops = page.locator("#hops .hop")
        assert hops.count() >= 1 and QUERY in hops.first.inner_text()
        assert page.locator("#timeline div").count() == 5
        assert chunks, "the page did not call the API"
        shot = tmp_path / "playground.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("RIG_SCREENSHOT_DIR"):
        shutil.copy(shot, Path(os.environ["RIG_SCREENSHOT_DIR"]) / "playground-test.png")
