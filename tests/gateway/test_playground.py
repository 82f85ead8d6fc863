"""The playground page in a real headless Chromium (Debian's package, driven by Selenium) against the real
gateway and the stand-in pipeline: type, pick and upload voices, click, hear it start, read the times shown.

Needs `chromium`, `chromedriver` and the `selenium` package (scripts/install_browser.sh); skips with that
reason otherwise. Set PLAYGROUND_SCREENSHOT=<path> to keep the screenshot (docs/images/playground.png is one).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.gateway.voice_clips import make_clip

pytestmark = pytest.mark.triton

RATE = 24_000
#: Untagged (the screenshot shows it); unique among the stand-in's requests, which is how the test finds it.
SPOKEN = "Hello from a real browser, streaming while it is produced."


@pytest.fixture(scope="module")
def browser():
    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("the selenium package")
    if missing:
        pytest.skip(f"headless browser test needs {', '.join(missing)}: run scripts/install_browser.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,1150",
                 "--autoplay-policy=no-user-gesture-required", "--mute-audio"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()


def wait_text(driver, element_id: str, predicate, timeout: float = 30.0) -> str:
    """The element's text once `predicate(text)` holds (fails with the last text seen)."""
    from selenium.webdriver.support.ui import WebDriverWait

    seen = {"text": ""}

    def check(d) -> bool:
        seen["text"] = d.find_element("id", element_id).text
        return bool(predicate(seen["text"]))

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.02).until(check)
    except Exception as exc:  # selenium's TimeoutException: say what was on the page
        raise AssertionError(f"#{element_id} never matched; last text {seen['text']!r}") from exc
    return seen["text"]


def record_texts(driver, element_id: str) -> None:
    """Keep every text the element shows from now on (`shown_texts`): a state that lasts less than a poll of a
    loaded machine (the "playing" of a sub-second clip) is still seen."""
    driver.execute_script(
        "const element = document.getElementById(arguments[0]); window.__shown = [element.textContent];"
        "new MutationObserver(() => window.__shown.push(element.textContent))"
        ".observe(element, {childList: true, characterData: true, subtree: true});",
        element_id,
    )


def shown_texts(driver) -> list[str]:
    return driver.execute_script("return window.__shown;")


def wait_shown(driver, text: str, timeout: float = 30.0) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.02).until(lambda d: text in shown_texts(d))
    except Exception as exc:  # selenium's TimeoutException: say what was shown
        raise AssertionError(f"{text!r} never shown; shown {shown_texts(driver)!r}") from exc


def test_playground_uploads_a_voice_speaks_live_and_shows_the_first_chunk_time(gateway, standin_backend, browser,
                                                                              tmp_path):
    from selenium.webdriver.support.ui import Select

    browser.get(f"{gateway.base_url}/playground")
    wait_text(browser, "voice", lambda text: {"amy", "ben", "clara", "dave"} <= set(text.split()))

    # upload a voice without transcript: it is added to the menu and selected
    clip = tmp_path / "mine.wav"
    clip.write_bytes(make_clip("wav", 2.0))
    browser.find_element("id", "upload-name").send_keys("Browser voice")
    browser.find_element("id", "upload-file").send_keys(str(clip))
    browser.find_element("id", "upload").click()
    wait_text(browser, "upload-status", lambda text: text == "added Browser voice")
    voice_menu = Select(browser.find_element("id", "voice"))
    assert voice_menu.first_selected_option.text == "Browser voice"

    # speak with a shipped voice, live pcm, faster, with instructions
    text = browser.find_element("id", "text")
    text.clear()
    text.send_keys(SPOKEN)
    voice_menu.select_by_visible_text("clara")
    Select(browser.find_element("id", "format")).select_by_value("pcm")
    browser.execute_script(
        "const s = document.getElementById('speed'); s.value = '1.5'; s.dispatchEvent(new Event('input'));"
    )
    browser.find_element("id", "instructions").send_keys("Cheerful.")
    record_texts(browser, "status")
    clicked = time.monotonic()
    browser.find_element("id", "speak").click()
    wait_shown(browser, "playing")
    waited_ms = (time.monotonic() - clicked) * 1000
    first_chunk = wait_text(browser, "first-chunk", lambda shown: re.fullmatch(r"\d+ ms", shown))
    assert 0 < int(first_chunk.split()[0]) <= waited_ms  # measured by the page, inside the wait it caused
    wait_shown(browser, "done")
    shown = shown_texts(browser)
    assert shown.index("requesting…") < shown.index("playing") < shown.index("done"), shown
    screenshot = tmp_path / "playground.png"
    browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000
    if os.environ.get("PLAYGROUND_SCREENSHOT"):
        shutil.copyfile(screenshot, Path(os.environ["PLAYGROUND_SCREENSHOT"]))

    [record] = [r for r in standin_backend.requests() if r["target_text"].strip() == SPOKEN]
    clara = next(v for v in browser.execute_script(
        "return [...document.getElementById('voice').options].map(o => ({id: o.value, name: o.text}))"
    ) if v["name"] == "clara")
    assert record["voice_id"] == clara["id"] and record["instruction_text"] == "Cheerful."
    assert record["model"] == "cosyvoice2_stream"  # relayed as produced, not one complete file
    shown_seconds = float(browser.find_element("id", "audio-length").text.split()[0])
    assert shown_seconds == pytest.approx(record["samples"] / RATE / 1.5, abs=0.02)  # pitch-preserving speed


def test_playground_plays_a_complete_mp3(gateway, standin_backend, browser):
    from selenium.webdriver.support.ui import Select

    browser.get(f"{gateway.base_url}/playground")
    wait_text(browser, "voice", lambda text: "amy" in text.split())
    text = browser.find_element("id", "text")
    text.clear()
    text.send_keys("zqplaymp Short and sweet.")
    Select(browser.find_element("id", "format")).select_by_value("mp3")
    browser.find_element("id", "speak").click()
    wait_text(browser, "status", lambda status: status in ("playing", "done") or status.startswith("error"))
    assert browser.find_element("id", "status").text in ("playing", "done")
    assert re.fullmatch(r"\d+ ms", browser.find_element("id", "first-chunk").text)
    assert len(standin_backend.requests_tagged("zqplaymp")) == 1


def test_playground_is_served_without_a_key(standin_backend, gateway_factory):
    keyed = gateway_factory(standin_backend.server.grpc_url, api_keys=["sk-page"])
    with keyed.http() as http:
        page = http.get("/playground")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="speak"' in page.text
        assert http.get("/v1/audio/voices").status_code == 401  # what the page calls still needs the key


def test_the_playground_says_when_the_server_is_the_demo(gateway, standin_backend, gateway_factory, browser):
    demo = gateway_factory(standin_backend.server.grpc_url, demo=True)
    browser.get(f"{demo.base_url}/playground")
    wait_text(browser, "voice", lambda text: "amy" in text.split())
    banner = browser.find_element("id", "demo-banner")
    assert banner.is_displayed() and "random weights" in banner.text
    browser.get(f"{gateway.base_url}/playground")
    wait_text(browser, "voice", lambda text: "amy" in text.split())
    assert not browser.find_element("id", "demo-banner").is_displayed()
