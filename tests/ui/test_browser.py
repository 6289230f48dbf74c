"""The web UI in a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by Selenium,
on the default model. Saves a screenshot of each tab to results/ui/ and the time each case took."""

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("gradio")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from airquant import Provider  # noqa: E402
from airquant.serve import BackgroundServer, create_app  # noqa: E402
from airquant.serve.config import ServeConfig  # noqa: E402
from airquant.ui.mount import UiMount  # noqa: E402
from airquant.ui.plan_view import PlanQuery, plan_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "results" / "ui"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 300  # generous: CI CPUs are shared; the test waits for text, it does not time the model
TIMINGS: dict[str, float] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui_url(default_store, tmp_path_factory):
    port = _free_port()  # the UI calls its own server, so the port is fixed before the app is built
    config = ServeConfig(port=port)
    mount = UiMount(stores=(str(default_store),), results=ROOT / "results", jobs=tmp_path_factory.mktemp("jobs"))
    with Provider(default_store, device="cpu", max_batch=4, batch_window_ms=50) as provider:
        app = create_app(provider, config=config, own_auth_prefixes=(mount.prefix,))
        mount(app, provider, config)
        with BackgroundServer(app, port=port) as url:
            yield f"{url}{mount.prefix}/"
    SHOTS.mkdir(parents=True, exist_ok=True)
    (SHOTS / "browser_test_timings.json").write_text(json.dumps(TIMINGS, indent=1) + "\n")


@pytest.fixture(scope="module")
def browser(ui_url):
    if not Path(DRIVER).exists():
        message = "needs chromium and chromium-driver: apt-get install -y chromium chromium-driver (.ci/run does)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.get(ui_url)
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def timed(request):
    start = time.perf_counter()
    yield
    TIMINGS[request.node.name] = round(time.perf_counter() - start, 1)


def _wait_text(driver, css: str, text: str) -> str:
    def seen(d):
        found = d.find_elements(By.CSS_SELECTOR, css)
        return found[0].text if found and text in found[0].text else False

    # Gradio re-renders components while a job runs: an element found one moment may be replaced the next.
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,)
                         ).until(seen, f"{text!r} never appeared in {css}")


def _open_tab(driver, name: str) -> None:
    tab = WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: next(
        (b for b in d.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text.strip() == name), False))
    tab.click()


def _shot(driver, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / f"{name}.png"))


def test_chat_streams_the_answer(browser):
    box = WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: d.find_element(By.CSS_SELECTOR, "#chat-input textarea"))
    box.send_keys("What is the capital of France?", Keys.ENTER)
    _wait_text(browser, "#chat-log", "Paris")
    _wait_text(browser, "#chat-stats", "(done)")  # the stream finished and reported tokens/s
    assert "Serving" in browser.find_element(By.ID, "chat-plan").text
    _shot(browser, "chat")


def test_plan_shows_the_chosen_mode(browser, default_store):
    _open_tab(browser, "Plan")
    browser.find_element(By.ID, "plan-button").click()
    headline, _ = plan_report([default_store], PlanQuery())
    mode = headline.split("**")[1]  # "Choice: resident" (or streamed), as the router says
    _wait_text(browser, "#plan-choice", mode.removeprefix("Choice: "))
    assert "tried, best quality first" in _wait_text(browser, "#plan-detail", "choice")
    _shot(browser, "plan")


def test_batch_job_runs_to_the_end_across_a_reload(browser, tmp_path):
    prompts = ["What is 2 + 2?", "Name a color.", "What is the capital of Italy?", "Say hello."]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    _open_tab(browser, "Batch job")
    browser.find_element(By.CSS_SELECTOR, "#job-input input[type=file]").send_keys(str(source))
    # Gradio shows the uploaded name as stem and extension in separate elements.
    WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: "prompts" in d.find_element(By.ID, "job-input").text.split("\n"),
                                         "the upload never showed up")
    tokens = browser.find_element(By.CSS_SELECTOR, "#job-max-new input")
    tokens.clear()
    tokens.send_keys("12")
    browser.find_element(By.ID, "job-start").click()
    _wait_text(browser, "#job-status-text", "job ")
    browser.refresh()  # the job lives in the server, not in the page
    _open_tab(browser, "Batch job")
    status = _wait_text(browser, "#job-status-text", "done, 4/4")
    assert "tok/s" in status
    _shot(browser, "batch")


def test_results_tab_renders_the_results(browser):
    _open_tab(browser, "Results")
    _wait_text(browser, "#results-md", "AirQuant results")
    images = browser.find_elements(By.CSS_SELECTOR, "#results-md img")
    assert images and any(browser.execute_script("return arguments[0].naturalWidth", im) > 0 for im in images)
    _shot(browser, "results")
