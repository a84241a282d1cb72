"""The MLflow UI driven the way a person uses it, for tests: Debian's chromium + chromedriver, headless,
through Selenium. No browser is downloaded: the test skips (with the install line) when either
binary is missing, and Selenium Manager is never asked for one (both paths are given).

Selectors: MLflow's own `data-testid`s first (checked against MLflow 3.17), then what a person
reads on the page (a row's text, a button's label), so a UI that renames a test id still
works. Every step that fails raises an AssertionError naming the step and the URL, with a
screenshot of the page saved beside the test's files.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

INSTALL = "apt-get install -y chromium chromium-driver (`make test-browser` does it as root)"


def browser_binaries() -> tuple[str, str]:
    """(chromium, chromedriver), or skip the test with how to get them."""
    chromium = (
        os.environ.get("ADAFLASH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    driver = os.environ.get("ADAFLASH_CHROMEDRIVER") or shutil.which("chromedriver")
    if not chromium or not driver:
        missing = " and ".join(n for n, p in (("chromium", chromium), ("chromedriver", driver)) if not p)
        if os.environ.get("ADAFLASH_REQUIRE_BROWSER"):  # `make test-browser`: it must run
            pytest.fail(f"no {missing} on PATH: {INSTALL}")
        pytest.skip(f"no {missing} on PATH: {INSTALL}")
    pytest.importorskip("selenium", reason="selenium is not installed: pip install -e '.[browser]'")
    return chromium, driver


def testid(name: str, fallback: tuple[str, str]) -> list[tuple[str, str]]:
    """Locators for one control: MLflow's data-testid, then what a person sees on the page."""
    return [("css selector", f'[data-testid="{name}"]'), fallback]


class MlflowUi:
    """One headless browser on one MLflow server."""

    def __init__(self, tracking_uri: str, artifacts: Path, timeout: float = 30.0) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        chromium, driver = browser_binaries()
        opts = webdriver.ChromeOptions()
        opts.binary_location = chromium
        for arg in (
            "--headless=new",
            "--no-sandbox",  # root in CI containers: chromium refuses its sandbox there
            "--disable-dev-shm-usage",  # small /dev/shm in containers
            "--disable-gpu",
            "--window-size=1400,1000",
        ):
            opts.add_argument(arg)
        self.driver = webdriver.Chrome(options=opts, service=Service(driver))
        self.base = tracking_uri.rstrip("/")
        self.artifacts = artifacts
        self.timeout = timeout

    def close(self) -> None:
        self.driver.quit()

    # -- failure reporting ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Run one user-visible step; on failure say which, where, and keep a screenshot."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any Selenium or assertion error becomes one message
            shot = self.artifacts / f"failed-{'-'.join(what.split())[:60]}.png"
            try:
                self.driver.save_screenshot(str(shot))
                where = f"screenshot: {shot}"
            except Exception as se:  # noqa: BLE001 - a dead browser still gets its message out
                where = f"no screenshot ({se})"
            raise AssertionError(
                f"MLflow UI step '{what}' failed at {self.driver.current_url}: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} ({where})"
            ) from e

    def first(self, locators: list[tuple[str, str]], within=None, timeout: float | None = None):
        """The first displayed element any locator finds, waiting up to `timeout`."""
        scope = within or self.driver
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for how, what in locators:
                for el in scope.find_elements(how, what):
                    with contextlib.suppress(Exception):  # stale while React re-renders: look again
                        if el.is_displayed():
                            return el
            if time.monotonic() > deadline:
                tried = "; ".join(f"{h}={w}" for h, w in locators)
                raise LookupError(f"nothing displayed matches any of: {tried}")
            time.sleep(0.2)

    def wait_for(self, cond, what: str, timeout: float | None = None):
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            with contextlib.suppress(Exception):
                got = cond()
                if got:
                    return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} (waited {timeout or self.timeout:.0f}s)")
            time.sleep(0.2)

    # -- pages -------------------------------------------------------------------------------------
    def version_aliases(self, name: str) -> dict[str, set[str]]:
        """{version: its aliases} as the registered model's versions table shows them (the new
        registry UI's role=row grid or the classic table): MLflow's alias chips, else the
        "@ alias" text a person reads in the row."""
        from selenium.webdriver.common.by import By

        def rows():
            got = {}
            for row in self.driver.find_elements(By.CSS_SELECTOR, "[role=row], tr"):
                links = row.find_elements(By.CSS_SELECTOR, f'a[href*="/models/{name}/versions/"]')
                if not links:
                    continue
                version = links[0].get_attribute("href").rstrip("/").rsplit("/", 1)[1]
                chips = row.find_elements(By.CSS_SELECTOR, '[data-component-id*="aliastag"][title]')
                text = row.text.replace("\xa0", " ")
                got[version] = {c.get_attribute("title") for c in chips} or set(re.findall(r"@ ?(\w+)", text))
            return got

        return self.wait_for(rows, f"no version rows of {name} rendered")

    def open_model(self, name: str) -> dict[str, set[str]]:
        self.driver.get(f"{self.base}/#/models/{name}")
        return self.version_aliases(name)

    def open_version_with_alias(self, name: str, alias: str) -> str:
        """Click the version whose row shows `alias` (as a person finds the pending challenger)."""
        from selenium.webdriver.common.by import By

        rows = self.version_aliases(name)
        matching = [v for v, aliases in rows.items() if alias in aliases]
        assert len(matching) == 1, f"expected one version with alias {alias!r}, the table shows {rows}"
        (version,) = matching
        self.first([(By.CSS_SELECTOR, f'a[href$="/models/{name}/versions/{version}"]')]).click()
        self.wait_for(lambda: self.driver.current_url.endswith(f"/versions/{version}"), "version page")
        self.tag_row("adaflash.status")  # the tags table has rendered
        return version

    def tag_row(self, key: str):
        from selenium.webdriver.common.by import By

        return self.first(
            [
                (By.CSS_SELECTOR, f'[data-testid="tags-section"] tr[data-row-key="{key}"]'),
                (By.XPATH, f'//tr[td[1][normalize-space()="{key}"]]'),
            ]
        )

    def tag_value(self, key: str) -> str:
        from selenium.webdriver.common.by import By

        return self.tag_row(key).find_elements(By.TAG_NAME, "td")[1].text.strip()

    def edit_tag(self, key: str, value: str) -> None:
        """The pencil on the tag's row, type the new value, Save."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        self.first(
            testid("editable-table-button-edit", (By.XPATH, ".//button[1]")), within=self.tag_row(key)
        ).click()
        row = self.tag_row(key)
        box = self.first(testid("editable-table-edited-input", (By.CSS_SELECTOR, "input")), within=row)
        box.send_keys(Keys.CONTROL, "a")  # select the old value: typing replaces it
        box.send_keys(value)
        save = testid("editable-table-button-save", (By.XPATH, './/button[normalize-space()="Save"]'))
        self.first(save, within=row).click()
        self.wait_for(lambda: self.tag_value(key) == value, f"tag {key} does not show {value!r} after Save")

    def add_tag(self, key: str, value: str) -> None:
        """The Name / Value boxes under the tags table, then Add."""
        from selenium.webdriver.common.by import By

        section = self.first(testid("tags-section", (By.XPATH, '//*[.//h2[normalize-space()="Tags"]]')))
        for box, text in (("name", key), ("value", value)):
            where = (By.CSS_SELECTOR, f'input[placeholder="{box.title()}"]')
            self.first(testid(f"tags-form-input-{box}", where), within=section).send_keys(text)
        add = testid("add-tag-button", (By.XPATH, './/button[normalize-space()="Add"]'))
        self.first(add, within=section).click()
        self.wait_for(lambda: self.tag_value(key) == value, f"added tag {key} does not show {value!r}")

    def screenshot_of_versions(self, path: Path) -> Path:
        """The registered model page scrolled to its versions table (aliases column in view), with
        MLflow's assistant side panel closed when it is open."""
        from selenium.webdriver.common.by import By

        for button in self.driver.find_elements(By.CSS_SELECTOR, 'button[aria-label="Close"]'):
            with contextlib.suppress(Exception):
                button.click()
        with contextlib.suppress(Exception):
            heading = self.driver.find_element(By.XPATH, '//*[normalize-space()="Versions"]')
            self.driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", heading)
        time.sleep(0.5)  # let the scroll and the panel's close settle before the capture
        self.driver.save_screenshot(str(path))
        return path
