"""The built site, in a real browser: headless Chromium (Debian's, through Selenium).

The site ``mkdocs build --strict`` made (``test_docs.build_site``) is served on
127.0.0.1; Chromium opens the home page, a guide, the API page of
``refcoll.allreduce`` and the CLI page of ``refcoll bench``, and each must render
(its title, its heading, the object or the options it documents, no JavaScript
error); the search box must find "ring"; and no page of the site may link to a
page or an anchor that does not exist. Screenshots of the four pages and of the
search go to ``$REFCOLL_DOCS_SHOTS`` (or the test's own folder).

Without Chromium and its driver (``apt-get install chromium chromium-driver``) or
selenium, the test skips and says which is missing: nothing is downloaded.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import shutil
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from test_docs import _docs_packages, _tail, build_site

#: The pages opened in the browser: path, what the title says, what must be on the page.
PAGES = [
    ("home", "", "refcoll", "h1", "refcoll"),
    ("guide", "guides/bench/", "Benchmarking", "h1", "refcoll bench"),
    ("api-allreduce", "reference/api/collectives/#refcoll.allreduce", "Collectives",
     "[id='refcoll.allreduce']", "allreduce"),
    ("cli-bench", "reference/cli/bench/", "refcoll bench", "h1", "refcoll bench"),
]

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-extensions",
                  "--disable-default-apps", "--window-size=1280,900")


def _browser_paths() -> tuple[str, str]:
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                   if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("no Chromium here (apt-get install chromium chromium-driver): "
                    f"browser {binary or 'missing'}, driver {driver or 'missing'}")
    return binary, driver


@pytest.fixture(scope="module")
def site():
    _docs_packages()
    where, done = build_site()
    assert done.returncode == 0, _tail(done.stdout + done.stderr)
    return where


@pytest.fixture(scope="module")
def server(site):
    """Serve the site on 127.0.0.1 at a free port; yield its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no line per request on stderr
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary, driver_path = _browser_paths()
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is missing: pip install '.[docs]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = Path(os.environ.get("REFCOLL_DOCS_SHOTS") or tmp_path_factory.mktemp("docs-shots"))
    where.mkdir(parents=True, exist_ok=True)
    return where


def _wait(driver, condition, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition)


@pytest.mark.parametrize("name, path, title, selector, text", PAGES, ids=[p[0] for p in PAGES])
def test_a_page_renders(browser, server, shots, name, path, title, selector, text):
    from selenium.webdriver.common.by import By

    browser.get(server + path)
    _wait(browser, lambda d: d.execute_script("return document.readyState") == "complete")
    assert title in browser.title, browser.title
    element = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, selector))
    assert text in element.text or text in browser.find_element(By.TAG_NAME, "article").text
    if name == "cli-bench":
        article = browser.find_element(By.TAG_NAME, "article").text
        for option in ("--against", "--format", "--plot"):
            assert option in article, f"the CLI page of bench lacks {option}"
    if name == "api-allreduce":
        heading = browser.find_element(By.CSS_SELECTOR, "[id='refcoll.allreduce']")
        assert heading.is_displayed()
    styled = browser.execute_script(
        "return getComputedStyle(document.querySelector('.md-header')).position")
    assert styled in ("sticky", "fixed"), "the theme's stylesheet did not load"
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert not errors, errors
    browser.save_screenshot(str(shots / f"{name}.png"))


def test_search_finds_ring(browser, server, shots):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(server)
    _wait(browser, lambda d: d.execute_script("return document.readyState") == "complete")
    box = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "input.md-search__input"))
    _wait(browser, lambda d: box.is_displayed())  # the header's search box, at this width
    box.click()
    box.send_keys("ring")
    results = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR,
                                                       ".md-search-result__item") or None)
    assert results
    found = " ".join(r.text for r in results).lower()
    assert "ring" in found, found[:500]
    browser.save_screenshot(str(shots / "search-ring.png"))
    box.send_keys(Keys.ESCAPE)


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def _page(url: str, cache: dict) -> _Links:
    if url not in cache:
        with urllib.request.urlopen(url, timeout=30) as response:
            parsed = _Links()
            parsed.feed(response.read().decode("utf-8", "replace"))
        cache[url] = parsed
    return cache[url]


def test_no_page_has_a_broken_internal_link(site, server):
    """Every link of every page, to a page or an anchor of the site, leads somewhere."""
    cache: dict = {}
    broken = []
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                   if p.name != "404.html")
    for rel in pages:
        url = urllib.parse.urljoin(server, rel)
        for href in _page(url, cache).links:
            target = urllib.parse.urljoin(url, href)
            if not target.startswith(server):
                continue  # another site: not ours to check here
            base, _, fragment = target.partition("#")
            if base.endswith("/") or base.endswith(".html"):
                try:
                    ids = _page(base, cache).ids
                except OSError as error:
                    broken.append(f"{rel}: {href} ({error})")
                    continue
                if fragment and urllib.parse.unquote(fragment) not in ids:
                    broken.append(f"{rel}: {href} (no anchor #{fragment})")
            else:
                try:
                    urllib.request.urlopen(base, timeout=30).close()
                except OSError as error:
                    broken.append(f"{rel}: {href} ({error})")
    assert not broken, "\n".join(broken[:50])
