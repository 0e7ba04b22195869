"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) of a live `embedq serve` work without internet: rendered in headless
Chromium whose network is unreachable (every request but the loopback's goes to a closed port), the page lists the
API's operations; the files they load are the gateway's own, public when an API key is set."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest
from conftest import GatewayHandle as Gateway

pytestmark = pytest.mark.integration

#: Operations each page must show (their paths, as the page's text has them).
OPERATIONS = ("/v1/embeddings", "/embed", "/rerank", "/jobs", "/jobs/{job_id}", "/info", "/health")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def gateway(redis_server, tmp_path_factory):
    # no worker: the pages need only the gateway's OpenAPI document; with an API key, so the pages must be public
    g = Gateway(redis_server.url, "embedq.test.docs-pages", tmp_path_factory.mktemp("gw") / "gw.log",
                EMBEDQ_API_KEY="s3cret")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def browser() -> str:
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    pytest.skip(f"no headless browser found ({', '.join(BROWSERS)}); scripts/setup.sh installs Debian's chromium "
                "when it runs as root")


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data) -> None:
        if not self._skip:
            self.parts.append(data)


def rendered_text(browser: str, url: str, profile) -> str:
    """The visible text of ``url`` after Chromium ran its scripts, the network unreachable but for the loopback."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
               "--disable-extensions", f"--user-data-dir={profile}",
               # every request through a closed port (so no DNS either), but those to 127.0.0.1, the gateway's
               "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>;127.0.0.1",
               "--virtual-time-budget=15000", "--dump-dom", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    parser = _Text()
    parser.feed(done.stdout.replace("<wbr>", ""))  # Swagger UI lets a long path wrap at each "/"
    return " ".join(parser.parts).replace("\u200b", "")  # (older ones: a zero-width space)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_api_pages_render_without_internet(browser, gateway, page, tmp_path):
    text = rendered_text(browser, gateway.url + page, tmp_path / "profile")
    words = set(text.split())
    missing = [op for op in OPERATIONS if op not in words]
    assert not missing, f"{page} rendered without {missing}; its text:\n{text[:3000]}"
    assert "embedq gateway" in text


def test_the_pages_load_only_the_gateway_s_own_files(gateway):
    """No page names another host; every file it loads is served, to anyone, also when an API key is set."""
    for page in ("/docs", "/redoc"):
        html = httpx.get(gateway.url + page)
        assert html.status_code == 200, page
        assert "http://" not in html.text and "https://" not in html.text, html.text
        sources = [part.split('"', 1)[0] for part in html.text.split('src="')[1:]]
        sources += [part.split('"', 1)[0] for part in html.text.split('href="')[1:]]
        assert sources, html.text
        for source in sources:
            got = httpx.get(gateway.url + source)
            assert got.status_code == 200 and len(got.content) > 1000, (page, source, got.status_code)
    assert httpx.get(gateway.url + "/info").status_code == 401  # the key still guards the API
