"""The playground page at / in a real headless Chromium, against a real `pagoda serve` of the default model.

Needs playwright (the test extra) and a Chromium binary: Debian's `chromium` package (`apt-get install chromium`),
or any Chromium or Chrome named by $PAGODA_CHROMIUM. Playwright's own browser download is not used.
"""

from __future__ import annotations

import os
import shutil

import openai
import pytest

from tests.test_server import MODEL

sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright: pip install -e '.[test]'")

CHROMIUM = os.environ.get("PAGODA_CHROMIUM") or next(
    filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs a Chromium binary: apt-get install chromium, or set PAGODA_CHROMIUM"
)

PROMPT = "Write two sentences about the sea."
MAX_TOKENS = 40

# Installed in the page before sending: records the reply's length at every DOM change while the send button
# is disabled (the reply is still streaming), and every throughput value the stats poll shows.
RECORDER = """() => {
  window.seen = { lengths: [], tps: [] };
  const busy = () => document.getElementById("send").disabled;
  new MutationObserver(() => {
    const reply = [...document.querySelectorAll(".assistant")].pop();
    if (reply && busy()) window.seen.lengths.push(reply.textContent.length);
  }).observe(document.getElementById("messages"), { childList: true, subtree: true, characterData: true });
  new MutationObserver(() => window.seen.tps.push(Number(document.getElementById("stat-tps").textContent)))
    .observe(document.getElementById("stat-tps"), { childList: true });
}"""


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def test_playground_streams_a_chat_and_shows_live_stats(server, tmp_path):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": 1100, "height": 720})
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        page.goto(f"{server.url}/")
        sync_api.expect(page.locator("#model")).to_have_text(MODEL)
        sync_api.expect(page.locator("#stat-kv")).to_contain_text("%")  # the first /metrics poll is in
        tokens_before = int(page.locator("#stat-tokens").text_content())
        page.evaluate(RECORDER)

        page.fill("#temperature", "0")
        page.fill("#max_tokens", str(MAX_TOKENS))
        page.fill("#prompt", PROMPT)
        page.keyboard.press("Enter")
        sync_api.expect(page.locator(".note")).to_contain_text("tokens in", timeout=120_000)  # the stream ended
        reply = page.locator(".assistant").text_content()

        # Deltas reached the page before the stream ended: the reply grew through several lengths.
        lengths = page.evaluate("window.seen.lengths")
        assert len({n for n in lengths if 0 < n < len(reply)}) >= 2, lengths

        # The stats moved: the token counter went up by at least the reply's tokens, and a poll saw a positive rate.
        reply_tokens = int(page.locator(".note").text_content().split()[0])
        page.wait_for_function(
            f"Number(document.getElementById('stat-tokens').textContent) >= {tokens_before + reply_tokens}"
        )
        page.wait_for_function("window.seen.tps.some((v) => v > 0)")
        page.screenshot(path=tmp_path / "playground.png")

        # What the page shows is what the API answers for the same greedy request.
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": PROMPT}]
        want = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
        assert reply == want.choices[0].message.content
        browser.close()
    assert not errors, errors
