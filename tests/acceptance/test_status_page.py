"""The status page in headless Chromium, against a real `drain run` and `drain status --json`.

Chromium (Debian's ``chromium``, installed by deploy/ensure-services.sh) is
driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages ending in a NUL byte on file descriptors 3 and 4), so nothing but
the browser itself is needed. The page's own JavaScript fetches
/status.json and refreshes itself; the test reads what it shows, compares it
with ``drain status --json`` run as a subprocess against the same database,
and keeps a screenshot in test-artifacts/.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import struct
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import drain
from drain.postgres import pauses
from drain.settings import config
from tests import support

ARTIFACTS = support.ROOT / "test-artifacts"
WIDTH, HEIGHT = 1200, 900

#: What the test reads off the page: each element's raw number (data-value) and text.
READ_PAGE = """(() => {
  const v = (id) => { const e = document.getElementById(id); return e ? e.dataset.value : null; };
  const t = (id) => { const e = document.getElementById(id); return e ? e.textContent : null; };
  const dead = {};
  for (const row of document.querySelectorAll('#dead tr[data-reason]'))
    dead[row.dataset.reason] = Number(row.dataset.value);
  const groups = [...document.querySelectorAll('#groups tr')].map((r) => [
    r.dataset.queue, r.dataset.tag, r.dataset.task, Number(r.dataset.value)]);
  const pauses = [...document.querySelectorAll('#pauses tr.paused')].map((r) => [
    r.dataset.kind, r.dataset.name, r.textContent]);
  const xact = document.getElementById('oldest-transaction');
  const lock = document.getElementById('lock');
  return {
    loaded: document.body.dataset.loaded === 'true',
    role: v('role'), state: v('state'), updated: v('updated'),
    backlog: v('backlog'), backlog_text: t('backlog'), delayed: v('delayed'),
    oldest_age: v('oldest-age'), dead: dead, dead_total: v('dead-total'),
    dead_none: !!document.getElementById('dead-none'), dead_tuples: v('dead-tuples'),
    groups: groups, published: v('published'), rate: v('rate'), pauses: pauses,
    xact_pid: xact.dataset.pid, xact_age: xact.dataset.value, xact_text: xact.textContent,
    lock_held: lock.dataset.held, lock_pid: lock.dataset.pid, schema: v('schema'),
    chart_points: Number(document.getElementById('chart').dataset.points),
    rate_path: !!document.getElementById('chart-rate'),
    error: document.getElementById('error').hidden ? null : t('error'),
  };
})()"""


# -- a minimal DevTools protocol client over a pipe ------------------------------------


class Chromium:
    """Headless Chromium with one page, driven over ``--remote-debugging-pipe``."""

    def __init__(self, binary: str, profile: Path, log_path: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
            f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
            "--no-first-run", "--no-default-browser-check", "--disable-dev-shm-usage",
            "--disable-extensions", "--disable-background-networking", "--disable-sync",
            "--disable-component-update", "--disable-default-apps", "--no-pings",
            "--hide-scrollbars", "--mute-audio", "about:blank",
        ]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        # The browser reads commands on fd 3 and writes answers on fd 4.
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}',
             binary, *flags],
            pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    def call(self, method: str, params: dict[str, Any] | None = None, *,
             session: bool = True, timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session is not None:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def _read(self, timeout: float, what: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], timeout)
            if not ready:
                raise AssertionError(f"chromium did not answer {what} within {timeout}s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise AssertionError(f"chromium closed the pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(message))

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.call("Target.attachToTarget",
                             {"targetId": target["targetId"], "flatten": True}, session=False)
        self.session = attached["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> bytes:
        shot = self.call("Page.captureScreenshot", {"format": "png"})
        data = base64.b64decode(shot["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", session=False, timeout=5)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._log.close()


def _chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    why = ("no chromium on PATH: deploy/ensure-services.sh installs Debian's chromium "
           "(needs root and apt-get)")
    if os.environ.get("CI") == "true" and os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(why + "; under CI as root it should have been installed")
    pytest.skip(why)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    chromium = Chromium(_chromium_binary(), tmp_path / "profile", tmp_path / "chromium.log")
    try:
        yield chromium
    finally:
        chromium.close()


# -- helpers ----------------------------------------------------------------------------


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _status_json(db_url: str) -> dict[str, Any]:
    result = support.run_cli(db_url, "status", "--json")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def _check_png(data: bytes) -> None:
    """A PNG of the window's size, with more than a blank page's bytes in it."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert struct.unpack(">II", data[16:24]) == (WIDTH, HEIGHT)
    assert len(data) > 20_000, f"the screenshot looks blank ({len(data)} bytes)"


def _stage(db_url: str, queue: str) -> None:
    """40 ready jobs in ``queue``, 7 delayed by an hour (two groups), 5 dead letters."""
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job("celery_app.record", [i], queue=queue,
                                          tag="page.ready") for i in range(40)])
        drain.stage_many(conn, [drain.Job("mail.send", [i], queue=queue, tag="page.later",
                                          countdown=3600) for i in range(4)]
                         + [drain.Job("report.build", [i], queue=queue, countdown=3600)
                            for i in range(3)])
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "staged_at, reason) SELECT -g, gen_random_uuid(), 'x.y', '[]', '{}', %s, 0, now(), "
            "CASE WHEN g <= 3 THEN 'expired' ELSE 'too_large' END FROM generate_series(1, 5) g",
            (queue,),
        )


def _wait_page(browser: Chromium, ok: Callable[[dict[str, Any]], bool], what: str
               ) -> dict[str, Any]:
    """Read the page until ``ok`` holds; on timeout, say what it showed last."""
    last: dict[str, Any] = {}

    def read() -> dict[str, Any] | None:
        last.update(browser.evaluate(READ_PAGE))
        return dict(last) if ok(last) else None

    try:
        return dict(support.wait_for(read, 30, what, interval=0.2))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the page showed {last}") from None


def _page_matches(page: dict[str, Any], status: dict[str, Any]) -> bool:
    """The numbers the page shows are those of ``drain status --json``."""
    return bool(
        page["loaded"]
        and page["backlog"] == str(status["backlog"])
        and page["delayed"] == str(status["delayed"])
        and page["dead"] == status["dead_by_reason"]
        and page["dead_total"] == str(sum(status["dead_by_reason"].values()))
        and sorted(tuple(g) for g in page["groups"])
        == sorted((g["queue"], g["tag"] or "", g["task"], g["count"])
                  for g in status["by_group"])
        and [p[:2] for p in page["pauses"]] == [[p["kind"], p["name"]]
                                                for p in status["pauses"]]
    )


# -- the test ---------------------------------------------------------------------------


def test_status_page_shows_what_drain_status_shows(
    db_url: str, queue: str, spawn: Any, browser: Chromium
) -> None:
    # Phase 1, standby: this test holds the drain lock and an old transaction, so the
    # drain publishes nothing and every number is stable.
    holder = psycopg.connect(db_url, autocommit=True, application_name="page-test lock")
    idle = psycopg.connect(db_url, application_name="page-test idle")
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", (config.DEFAULT_LOCK_KEY,))
        idle.execute("SELECT 1")  # BEGIN ... now idle in transaction
        idle_pid = idle.info.backend_pid
        _stage(db_url, queue)
        with psycopg.connect(db_url, autocommit=True) as conn:  # delayed jobs: phase 2 holds
            pauses.pause(conn, "task", "mail.send", reason="mail relay down", actor="page-test")
        port = support.free_port()
        runner = spawn(support.drain_argv("run", "--metrics-port", str(port),
                                          "--metrics-interval", "1", "--poll-interval", "0.5"),
                       support.drain_env(db_url), "drain")
        base = f"http://127.0.0.1:{port}"
        support.wait_for(lambda: _get(base + "/readyz")[0] == 200 or runner.proc.poll(), 30,
                         "the drain's /readyz")
        assert runner.proc.poll() is None, runner.output()[-3000:]
        status, page_html = _get(base + "/")
        assert status == 200 and b'id="backlog"' in page_html

        browser.open(base + "/")
        expected = _status_json(db_url)
        assert expected["backlog"] == 47 and expected["delayed"] == 7
        assert expected["oldest_transaction"]["pid"] == idle_pid
        page = _wait_page(browser, lambda p: _page_matches(p, expected),
                          "the page to show the numbers of drain status --json")
        assert page["role"] == "standby" and page["error"] is None
        assert page["schema"] == str(expected["schema"]["version"])
        assert page["dead"] == {"expired": 3, "too_large": 2}
        [shown] = page["pauses"]
        assert shown[:2] == ["task", "mail.send"] and "page-test: mail relay down" in shown[2]
        assert page["lock_held"] == "true" and page["lock_pid"] == str(expected["lock"]["pid"])
        assert page["xact_pid"] == str(idle_pid) and "page-test idle" in page["xact_text"]
        # Ages grow: the page's sample was taken before this `drain status`, by at most
        # the sampling interval (1 s) plus the page's refresh (3 s), with some slack.
        later = _status_json(db_url)
        assert 0 <= later["oldest_age_seconds"] - float(page["oldest_age"]) < 30
        assert 0 <= later["oldest_transaction"]["age_seconds"] - float(page["xact_age"]) < 30
        ARTIFACTS.mkdir(exist_ok=True)
        _check_png(browser.screenshot(ARTIFACTS / "status-page-standby.png"))

        # Phase 2, leader: let go of the lock; the drain takes it and publishes the 40
        # ready jobs; the 7 delayed ones stay. The page follows by itself.
        holder.execute("SELECT pg_advisory_unlock(%s)", (config.DEFAULT_LOCK_KEY,))
        runner.wait_for_output("active: took the drain lock", timeout=30)
        support.wait_for(lambda: support.staged_count(db_url) == 7, 30, "the drain to publish")
        expected = _status_json(db_url)
        assert expected["backlog"] == 7 and expected["lock"]["held"]
        page = _wait_page(
            browser, lambda p: _page_matches(p, expected) and p["role"] == "leader"
            and p["published"] == "40" and p["rate_path"],
            "the page to show the drain as leader with 40 published")
        assert page["lock_pid"] == str(runner.pid) and page["state"] == "active"
        assert page["chart_points"] >= 2 and page["backlog_text"] == "7"

        _check_png(browser.screenshot(ARTIFACTS / "status-page.png"))
    finally:
        idle.close()
        holder.close()
