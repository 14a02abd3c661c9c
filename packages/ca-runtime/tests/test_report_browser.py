"""The report in a real browser: headless Chromium through Selenium loads it without a JavaScript error.

Needs ``selenium`` (pip) and Debian's ``chromium`` and ``chromium-driver``
(``nox -s browser`` installs them, best effort); skipped without them.

    python packages/ca-runtime/tests/test_report_browser.py --screenshot docs/report.png

runs the same small training run and saves a screenshot of its report (the
README's).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ca_runtime
import pytest
import torch
from ca_runtime._report.html import SECTION_IDS

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore::ca_runtime.GraphBreakWarning")]


def train_with_break_fallback_and_dynamic_sizes() -> None:
    """A small MLP: a retain_grad graph break, a batch size that changes, and a compiler_fn that fails.

    Timings are collected (turn them off after).
    """
    ca_runtime.reset()
    ca_runtime.collect_timings()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ca_runtime.enable("aot_eager", capture_after=1):
        for batch in (4, 4, 8, 16, 8):
            hidden = model[1](model[0](torch.randn(batch, 8)))
            hidden.retain_grad()
            torch.nn.functional.cross_entropy(model[2](hidden), torch.randint(0, 4, (batch,))).backward()
            opt.step()
            opt.zero_grad()

    def broken_compiler(gm: torch.fx.GraphModule) -> Any:
        raise RuntimeError("this compiler is broken today")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ca_runtime.EagerFallbackWarning)
        with ca_runtime.enable(broken_compiler, capture_after=1):
            model(torch.randn(2, 8)).sum().backward()


def _chrome(width: int = 1300, height: int = 1800) -> Any:
    """A headless Chromium driver from Debian's packages; skips without them."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install selenium)"
    )
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if browser is None or driver_path is None:
        pytest.skip("chromium / chromedriver not installed (apt-get install -y chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager would otherwise try to download one.
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)


@pytest.fixture
def chrome() -> Iterator[Any]:
    driver = _chrome()
    try:
        yield driver
    finally:
        driver.quit()


def save_screenshot(driver: Any, path: Path, max_height: int = 2600) -> None:
    """The top of the page (overview, cache tree, the first graphs), as a PNG."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1300, min(height, max_height))
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(path))


def test_report_loads_without_errors_in_chromium(chrome: Any, tmp_path: Path) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    try:
        train_with_break_fallback_and_dynamic_sizes()
    finally:
        ca_runtime.collect_timings(False)
    stats = ca_runtime.stats()
    assert stats["graph_breaks"] > 0 and stats["eager_fallbacks"] == 1, stats
    path = ca_runtime.report(tmp_path / "report.html")

    chrome.get(path.as_uri())
    for section in SECTION_IDS:
        assert chrome.find_element(By.ID, section).is_displayed(), section
    # A break's link opens its capture and highlights the node in the drawing.
    link = chrome.find_element(By.CSS_SELECTOR, "#breaks a[href^='#c1-n']")
    target = link.get_attribute("href").split("#", 1)[1]
    chrome.find_element(By.ID, "collapse-all").click()
    link.click()
    assert chrome.find_element(By.ID, "capture-1").get_attribute("open") is not None
    assert "target" in chrome.find_element(By.ID, target).get_attribute("class")
    with pytest.raises(NoAlertPresentException):
        chrome.switch_to.alert.text  # noqa: B018 - nothing in the page ran an alert
    errors = [entry for entry in chrome.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == [], errors
    assert "were not timed" not in chrome.find_element(By.ID, "overview").text
    save_screenshot(chrome, tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description="Screenshot of the report of a small training run.")
    parser.add_argument("--screenshot", type=Path, required=True, help="where to save the PNG")
    parser.add_argument("--html", type=Path, help="also keep the report here")
    args = parser.parse_args()
    train_with_break_fallback_and_dynamic_sizes()
    html_path = ca_runtime.report(args.html or args.screenshot.with_suffix(".html"))
    driver = _chrome()
    try:
        driver.get(html_path.as_uri())
        save_screenshot(driver, args.screenshot)
    finally:
        driver.quit()
    if args.html is None:
        html_path.unlink()
        html_path.with_suffix(".json").unlink()
    print(args.screenshot)


if __name__ == "__main__":
    sys.exit(main())
