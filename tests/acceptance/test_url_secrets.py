"""Passwords in URLs never reach the output: a table of URLs, run through the real CLI.

Each case is a database URL, a libpq ``key=value`` string or a broker URL whose
password holds reserved characters (``@ # / ? : [ ' \\`` and spaces), or is one
or two characters long, written as a new user would: escaped or not. For every
case the CLI runs as a subprocess (``drain status`` against a port where nothing
listens; ``drain -v run`` against the real Postgres and RabbitMQ, where a
valid URL fails fast: an unknown role or a refused broker login at the first
connection is exit 3, and a drain that connects exits 0 with ``--exit-when-empty``)
and in-process (``Settings`` repr and describe, the mask functions, scrub).
Nowhere may the password appear, as written or decoded, nor any four
characters of it; the user name and host stay readable; a malformed URL is
exit 2 with a message naming what is wrong.

All subprocesses of the module run once, a few at a time, in a module fixture;
the parametrized tests then check their outputs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import subprocess
from collections.abc import Iterator

import psycopg
import pytest

from drain.errors import ConfigError
from drain.settings import config, url_parts, urls
from tests import support

#: Subprocesses at once (the runner has few cores).
PARALLEL = max(2, min(4, os.cpu_count() or 2))
#: Every command here fails or finishes fast; this only bounds a hang.
TIMEOUT = 30.0
DB_PORT = support.PG_PORT
BROKER_PORT = support.BROKER_PORT


@dataclasses.dataclass(frozen=True)
class Case:
    """One URL: ``{port}`` and ``{db}`` are filled in per command."""

    name: str
    kind: str  # "database" or "broker"
    url: str
    #: The passwords as meant (decoded); the URL's spelling of them is checked too.
    secrets: tuple[str, ...]
    #: None: the URL is valid. Otherwise a fragment of the error naming what is wrong.
    malformed: str | None = None
    #: Text that must stay readable wherever the (masked) URL is shown.
    readable: tuple[str, ...] = ()
    #: How the URL spells the passwords, where that differs (escaped, quoted).
    spelled: tuple[str, ...] = ()

    @property
    def connects(self) -> bool:
        """A valid database URL of the role ``postgres`` (trust auth): the drain runs."""
        return self.malformed is None and self.kind == "database" and (
            "//postgres:" in self.url or "user = postgres" in self.url)

    def fill(self, port: int, db: str) -> str:
        return self.url.replace("{port}", str(port)).replace("{db}", db)


def _db(name: str, url: str, *secrets: str, malformed: str | None = None,
        readable: tuple[str, ...] = (), spelled: tuple[str, ...] = ()) -> Case:
    return Case(name, "database", url, secrets, malformed, readable, spelled)


def _broker(name: str, url: str, *secrets: str, malformed: str | None = None,
            readable: tuple[str, ...] = (), spelled: tuple[str, ...] = ()) -> Case:
    return Case(name, "broker", url, secrets, malformed, readable, spelled)


H = "127.0.0.1"
KV = f"host={H} port={{port}} dbname={{db}}"
CASES = [
    # -- database URLs libpq reads as meant ------------------------------------------------
    _db("url-plain", f"postgresql://app:Zq8Kx3Wv@{H}:{{port}}/{{db}}", "Zq8Kx3Wv",
        readable=(f"postgresql://app:***@{H}:",)),
    _db("url-one-letter", f"postgresql://app:a@{H}:{{port}}/{{db}}", "a",
        readable=(f"postgresql://app:***@{H}:",)),
    _db("url-one-digit-also-in-host", f"postgresql://postgres:1@{H}:{{port}}/{{db}}", "1",
        readable=(f"postgresql://postgres:***@{H}:",)),
    _db("url-two-letters-in-user", "postgresql://app:pp@localhost:{port}/{db}", "pp",
        readable=("postgresql://app:***@localhost:",)),
    _db("url-all-escaped", f"postgresql://postgres:Zq%40x%23Y%2Fw%3Fk@{H}:{{port}}/{{db}}",
        "Zq@x#Y/w?k", readable=(f"postgresql://postgres:***@{H}:",),
        spelled=("Zq%40x%23Y%2Fw%3Fk",)),
    _db("url-colons", f"postgresql://app:Vq:Rx:Tz@{H}:{{port}}/{{db}}", "Vq:Rx:Tz",
        readable=(f"postgresql://app:***@{H}:",)),
    _db("url-hash-unescaped", f"postgresql://postgres:Hk#Qm#Wz@{H}:{{port}}/{{db}}", "Hk#Qm#Wz",
        readable=(f"postgresql://postgres:***@{H}:",)),
    _db("url-question-unescaped", f"postgresql://app:Wq?Jz=Xk@{H}:{{port}}/{{db}}", "Wq?Jz=Xk",
        readable=(f"postgresql://app:***@{H}:",)),
    _db("url-brackets", f"postgresql://app:Kq[Zx]Wv@{H}:{{port}}/{{db}}", "Kq[Zx]Wv",
        readable=(f"postgresql://app:***@{H}:",)),
    _db("url-query-password-and-at-in-a-value",
        f"postgresql://app@{H}:{{port}}/{{db}}?password=Qz%26Wx%3DKv&application_name=me@work",
        "Qz&Wx=Kv", readable=(f"postgresql://app@{H}:", "password=***"),
        spelled=("Qz%26Wx%3DKv",)),
    _db("url-sslpassword-too",
        f"postgresql://app:Jx7Qw2Zk@{H}:{{port}}/{{db}}?sslpassword=Yv3Kq9Wx",
        "Jx7Qw2Zk", "Yv3Kq9Wx", readable=(f"postgresql://app:***@{H}:", "sslpassword=***")),
    _db("url-two-hosts", f"postgresql://app:Mz%2CQx9W@{H}:{{port}},localhost:{{port}}/{{db}}",
        "Mz,Qx9W", readable=(f"postgresql://app:***@{H}:", ",localhost:"),
        spelled=("Mz%2CQx9W",)),
    _db("url-escaped-at-in-user", f"postgresql://me%40corp:Wk9Zq4Xv@{H}:{{port}}/{{db}}",
        "Wk9Zq4Xv", readable=(f"postgresql://me%40corp:***@{H}:",)),
    _db("url-postgres-scheme", f"postgres://app:Tz4Kq8Wm@{H}:{{port}}/{{db}}", "Tz4Kq8Wm",
        readable=(f"postgres://app:***@{H}:",)),
    _db("url-escaped-percent", f"postgresql://app:Qx%25Zk%25W@{H}:{{port}}/{{db}}", "Qx%Zk%W",
        readable=(f"postgresql://app:***@{H}:",), spelled=("Qx%25Zk%25W",)),
    # -- database URLs libpq would misread or refuse ---------------------------------------
    _db("url-unescaped-at-hash-slash", f"postgresql://app:Zq@x#Y/wk@{H}:{{port}}/{{db}}",
        "Zq@x#Y/wk", malformed="'@' and '/' in the password must be percent-escaped as %40 "
        "and %2F"),
    _db("url-unescaped-at", f"postgresql://app:Kx@Wq@{H}:{{port}}/{{db}}", "Kx@Wq",
        malformed="'@' in the password must be percent-escaped as %40"),
    _db("url-unescaped-slash", f"postgresql://app:Wz/Qk@{H}:{{port}}/{{db}}", "Wz/Qk",
        malformed="'/' in the password must be percent-escaped as %2F"),
    _db("url-slash-then-question", f"postgresql://app:/Zx?Qk@{H}:{{port}}/{{db}}", "/Zx?Qk",
        malformed="'/' in the password"),
    _db("url-one-letter-and-at", f"postgresql://app:a@@{H}:{{port}}/{{db}}", "a@",
        malformed="'@' in the password"),
    _db("url-bad-percent", f"postgresql://app:Zq%Wk9@{H}:{{port}}/{{db}}", "Zq%Wk9",
        malformed="the password has a '%' that does not start a %XX escape"),
    _db("url-space", f"postgresql://app:Zq Wk9@{H}:{{port}}/{{db}}", "Zq Wk9",
        malformed="the password contains a space"),
    _db("url-port-not-a-number", f"postgresql://app:Xq7Wz2Kv@{H}:notaport/{{db}}", "Xq7Wz2Kv",
        malformed="the port is not a number"),
    _db("url-ipv6-unclosed", "postgresql://app:Xk4Qz8Wv@[::1/{db}", "Xk4Qz8Wv",
        malformed="the IPv6 address has no closing ']'"),
    _db("url-sqlalchemy-scheme", f"postgresql+psycopg://app:Vk2Qx7Wz@{H}:{{port}}/{{db}}",
        "Vk2Qx7Wz", malformed="the scheme must be postgresql:// or postgres://"),
    _db("url-at-in-user", f"postgresql://app@srv:Qk5Wz3Xv@{H}:{{port}}/{{db}}", "Qk5Wz3Xv",
        malformed="'@' in the user name must be percent-escaped as %40"),
    _db("url-misspelt-query-key", f"postgresql://app:Zk3Wq7Xv@{H}:{{port}}/{{db}}?passwrd=Qz9Kxw",
        "Zk3Wq7Xv", "Qz9Kxw", malformed="the 1st query parameter is not a libpq connection"),
    # -- libpq key=value strings -----------------------------------------------------------
    _db("kv-plain", f"{KV} user=app password=Wz8Qk3Xv", "Wz8Qk3Xv",
        readable=("user=app", "password=***", f"host={H}")),
    _db("kv-reserved-unquoted", f"{KV} user=app password=Zq@x#Y/w'k", "Zq@x#Y/w'k",
        readable=("user=app", "password=***")),
    _db("kv-quoted-space-quote-backslash", f"{KV} password='Zq x\\'Wk\\\\Y' user=app",
        "Zq x'Wk\\Y", readable=("password=*** user=app",),
        spelled=("'Zq x\\'Wk\\\\Y'",)),
    _db("kv-spaces-around-equals", f"host = {H} port = {{port}} dbname = {{db}} "
        "password = 'Kq Zw' user = postgres", "Kq Zw", readable=("password = *** user",)),
    _db("kv-one-letter", f"{KV} user=app password=a", "a",
        readable=("user=app password=***", f"host={H}")),
    _db("kv-backslash-escapes-unquoted", f"{KV} user=app password=Zk\\ Wq\\'x", "Zk Wq'x",
        readable=("user=app password=***",), spelled=("Zk\\ Wq\\'x",)),
    _db("kv-sslpassword-too", f"{KV} user=app password=Xv5Kq8Wz sslpassword='Qz7 Wk2'",
        "Xv5Kq8Wz", "Qz7 Wk2", readable=("password=*** sslpassword=***",)),
    _db("kv-unterminated-quote", f"{KV} user=app password='Zq Wk9x", "Zq Wk9x",
        malformed="the value of password has no closing quote"),
    _db("kv-unquoted-space", f"{KV} user=app password=Zq Wk9x", "Zq Wk9x",
        malformed="after the value of password has no '='"),
    _db("kv-unquoted-space-and-equals", f"{KV} password=Kq Wz=Xv user=app", "Kq Wz=Xv",
        malformed="is not a libpq connection parameter"),
    _db("kv-port-not-a-number", f"host={H} port=5x4 user=app password=Qz8Wk3Xv", "Qz8Wk3Xv",
        malformed="the port is not a number"),
    _db("kv-capitalised-key", f"{KV} Password=Wz4Kq7Xv user=app", "Wz4Kq7Xv",
        malformed="libpq's are lower case"),
    # -- broker URLs kombu reads as meant (RabbitMQ refuses these logins) ---------------------
    _broker("amqp-plain", f"amqp://guest:Wq8Zk3Xv@{H}:{{port}}//", "Wq8Zk3Xv",
            readable=(f"amqp://guest:***@{H}:",)),
    _broker("amqp-one-letter", f"amqp://guest:g@{H}:{{port}}//", "g",
            readable=(f"amqp://guest:***@{H}:",)),
    _broker("amqp-unescaped-at", f"amqp://guest:Zq@Wk9x@{H}:{{port}}//", "Zq@Wk9x",
            readable=(f"amqp://guest:***@{H}:",)),
    _broker("amqp-colons", f"amqp://guest:Kq:Wz:Xv@{H}:{{port}}//", "Kq:Wz:Xv",
            readable=(f"amqp://guest:***@{H}:",)),
    _broker("amqp-all-escaped", f"amqp://guest:Zq%2Fx%23Y%3Fw%40k@{H}:{{port}}/%2F",
            "Zq/x#Y?w@k", readable=(f"amqp://guest:***@{H}:",),
            spelled=("Zq%2Fx%23Y%3Fw%40k",)),
    _broker("amqp-localhost-vhost", "amqp://guest:Vx7Qk2Wz@localhost:{port}/drain", "Vx7Qk2Wz",
            readable=("amqp://guest:***@localhost:",)),
    # -- broker URLs kombu and pika would misread ------------------------------------------
    _broker("amqp-slash-hash", f"amqp://guest:a@b/c#d@{H}:{{port}}//", "a@b/c#d",
            malformed="'/' and '#' in the password must be percent-escaped as %2F and %23"),
    _broker("amqp-hash", f"amqp://guest:Zq#Wk9x@{H}:{{port}}//", "Zq#Wk9x",
            malformed="'#' in the password must be percent-escaped as %23"),
    _broker("amqp-question", f"amqp://guest:Zq?Wk9x@{H}:{{port}}//", "Zq?Wk9x",
            malformed="'?' in the password must be percent-escaped as %3F"),
    _broker("amqp-slash", f"amqp://guest:Zq/Wk9x@{H}:{{port}}//", "Zq/Wk9x",
            malformed="'/' in the password must be percent-escaped as %2F"),
    _broker("amqp-bracket", f"amqp://guest:Zq[Wk9x@{H}:{{port}}//", "Zq[Wk9x",
            malformed="'[' in the password must be percent-escaped as %5B"),
    _broker("amqp-port-not-a-number", f"amqp://guest:Wz4Qk8Xv@{H}:nope//", "Wz4Qk8Xv",
            malformed="the port is not a number"),
    _broker("amqp-no-scheme", f"guest:Qz6Wk1Xv@{H}:{{port}}", "Qz6Wk1Xv",
            malformed="it must start with amqp:// or amqps://"),
    _broker("redis-scheme", f"redis://guest:Kz5Wq2Xv@{H}:6379/0", "Kz5Wq2Xv",
            malformed="must start with amqp:// or amqps://",
            readable=(f"redis://guest:***@{H}:6379/0",)),
    _broker("amqp-query", f"amqp://guest:Qk3Wz8Xv@{H}:{{port}}//?password=Vz2Kq7Xw",
            "Qk3Wz8Xv", "Vz2Kq7Xw", malformed="query parameters are not supported",
            readable=(f"amqp://guest:***@{H}:",)),
]
IDS = [case.name for case in CASES]


def assert_hidden(case: Case, text: str, where: str) -> None:
    """No password appears in ``text``, as meant or as spelled, nor four characters of one.

    A password of one to three characters occurs in ordinary text (``a`` in
    "database"): for those, it must not be where the URL had it, and the
    readable parts (:func:`assert_readable`) show that nothing around it was
    masked with it.
    """
    for secret in {*case.secrets, *case.spelled}:
        if len(secret) < 4:
            for shown in (f":{secret}@", f"password={secret}", f"password = {secret}"):
                assert shown not in text, f"{case.name}: {shown!r} in {where}:\n{text}"
            continue
        assert secret not in text, f"{case.name}: password {secret!r} in {where}:\n{text}"
        for i in range(len(secret) - 3):
            fragment = secret[i:i + 4]
            assert fragment not in text, (
                f"{case.name}: {fragment!r} of the password {secret!r} in {where}:\n{text}")


def assert_readable(case: Case, text: str, where: str) -> None:
    for part in case.readable:
        assert part in text, f"{case.name}: {part!r} is not readable in {where}:\n{text}"


# -- the subprocesses ----------------------------------------------------------------------


@contextlib.contextmanager
def _database(template: str) -> Iterator[str]:
    name = support.unique("drain_urls")
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        yield name
    finally:
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclasses.dataclass(frozen=True)
class Ran:
    argv: tuple[str, ...]
    code: int
    output: str  # stdout and stderr


Job = tuple[list[str], dict[str, str]]  # argv, environment


def _invocations(case: Case, index: int, dbname: str) -> dict[str, Job]:
    """The commands a case runs: {label: (argv, env)}."""
    plain_db = support.database_url(dbname)
    lock = ["--lock-key", str(7_000_000 + index)]
    if case.kind == "broker":
        env = support.drain_env(plain_db, DRAIN_BROKER_URL=case.fill(BROKER_PORT, dbname))
        return {"run": (support.drain_argv("-v", "run", "--exit-when-empty", *lock), env)}
    free = support.free_port()
    return {
        "status": (support.drain_argv("status"), support.drain_env(case.fill(free, dbname))),
        "run": (support.drain_argv("-v", "run", "--exit-when-empty", *lock),
                support.drain_env(case.fill(DB_PORT, dbname))),
    }


def _run(argv: list[str], env: dict[str, str]) -> Ran:
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                              cwd=support.ROOT, check=False, stdin=subprocess.DEVNULL)
        return Ran(tuple(argv), done.returncode, done.stdout + done.stderr)
    except subprocess.TimeoutExpired as exc:
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                       for part in (exc.stdout or "", exc.stderr or ""))
        return Ran(tuple(argv), -1, f"[timed out after {TIMEOUT}s]\n{text}")


@pytest.fixture(scope="module")
def shared_db(template_db: str) -> Iterator[str]:
    """One migrated database for every case (each drain under its own lock key)."""
    with _database(template_db) as name:
        yield name


#: Every command that takes a database URL: (argv, runs against a valid URL too).
#: Spark's refuse a malformed URL before Spark starts; with a valid one they would
#: start it, which is for tests/spark.
COMMANDS: list[tuple[tuple[str, ...], bool]] = [
    (("migrate",), True),
    (("stage", "t.x"), True),
    (("status", "--json"), True),
    (("status", "--watch", "0.1"), False),
    (("dead", "list"), True),
    (("dead", "requeue", "--yes"), True),
    (("dead", "purge", "--older-than", "0s", "--yes", "--why", "a test"), True),
    (("processed", "purge", "--older-than", "1d"), True),
    (("pause", "--queue", "q", "--why", "a test"), True),
    (("resume", "--queue", "q"), True),
    (("pauses",), True),
    (("audit",), True),
    (("show", "00000000-0000-0000-0000-000000000001"), True),
    (("staged", "list"), True),
    (("run",), False),
    (("backfill", "--source", "parquet:/nonexistent", "--task", "t.x", "--tag", "x"), False),
    (("reconcile", "--source", "table:a", "--downstream", "table:b"), False),
]
#: A URL libpq would misread, and one it reads as meant, for every command.
EVERY_COMMAND = [CASES[IDS.index("url-unescaped-at-hash-slash")],
                 CASES[IDS.index("url-hash-unescaped")]]


def _label(argv: tuple[str, ...]) -> str:
    return "every command: " + " ".join(argv)


def _command_jobs(dbname: str) -> dict[tuple[str, str], Job]:
    jobs = {}
    for case in EVERY_COMMAND:
        for argv, with_valid in COMMANDS:
            if case.malformed is None and not with_valid:
                continue
            url = case.fill(support.free_port(), dbname)
            env = support.drain_env(url)
            extra: tuple[str, ...] = ()
            if argv[0] == "reconcile":  # its other URLs are checked the same way
                env = support.drain_env(support.database_url(dbname))
                extra = ("--downstream-url", url)
            jobs[(case.name, _label(argv))] = (support.drain_argv(*argv, *extra), env)
    return jobs


@pytest.fixture(scope="module")
def outputs(shared_db: str) -> dict[tuple[str, str], Ran]:
    """Every command of the module, a few at a time: {(case, label): what it printed}."""
    jobs = {(case.name, label): job
            for index, case in enumerate(CASES)
            for label, job in _invocations(case, index, shared_db).items()}
    jobs.update(_command_jobs(shared_db))
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {key: pool.submit(_run, *job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_cli_never_shows_the_password(case: Case, outputs: dict[tuple[str, str], Ran]
                                          ) -> None:
    labels = ["run"] if case.kind == "broker" else ["status", "run"]
    for label in labels:
        ran = outputs[(case.name, label)]
        where = f"`{' '.join(ran.argv[2:])}`"
        assert_hidden(case, ran.output, where)
        last = ran.output.strip().splitlines()[-1] if ran.output.strip() else ""
        if case.malformed is not None:
            assert ran.code == 2, f"{case.name}: {where} exited {ran.code}:\n{ran.output}"
            assert last.startswith("drain: error: "), (case.name, ran.output)
            assert case.malformed in last, (case.name, last)
            assert "Traceback" in ran.output or label == "status", "ran without -v"
        elif label == "run" and case.connects:
            assert ran.code == 0, f"{case.name}: {where} exited {ran.code}:\n{ran.output}"
            assert "drain starting: database=" in ran.output
        else:  # unreachable (status), unknown role or refused broker login (run): exit 3
            assert ran.code == 3, f"{case.name}: {where} exited {ran.code}:\n{ran.output}"
            assert last.startswith("drain: error: "), (case.name, ran.output)
            what = {"status": "unreachable", "run": "refused"}[label]
            assert what in last, (case.name, last)
            # Not "d***t***b***se", as a one-letter password once made it.
            assert last.startswith(f"drain: error: {case.kind} "), (case.name, last)
        if case.malformed is None or case.readable:
            assert_readable(case, ran.output, where)


@pytest.mark.parametrize(("case", "argv"), [
    (case, argv) for case in EVERY_COMMAND for argv, with_valid in COMMANDS
    if with_valid or case.malformed is not None
], ids=lambda value: value.name if isinstance(value, Case) else " ".join(value))
def test_every_command_hides_the_password(
    case: Case, argv: tuple[str, ...], outputs: dict[tuple[str, str], Ran]
) -> None:
    ran = outputs[(case.name, _label(argv))]
    assert_hidden(case, ran.output, f"`drain {' '.join(argv)}`")
    lines = ran.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drain: error: "), ran.output
    if case.malformed is not None:
        assert ran.code == 2, ran
        assert case.malformed in lines[0], lines[0]
    else:
        assert ran.code == 3, ran
        assert "unreachable" in lines[0], lines[0]
        assert_readable(case, lines[0], f"`drain {' '.join(argv)}`")


# -- in-process ----------------------------------------------------------------------------


def _settings(case: Case, url: str) -> config.Settings:
    if case.kind == "database":
        return config.Settings(database_url=url)
    return config.Settings(broker_url=url)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_settings_masks_and_scrub_never_show_the_password(case: Case) -> None:
    url = case.fill(DB_PORT if case.kind == "database" else BROKER_PORT, "x")
    database, broker = (url, "") if case.kind == "database" else ("", url)
    secrets = urls.secrets_of(database, broker)
    mask = urls.mask_database_url if case.kind == "database" else urls.mask_url
    masked = mask(url)
    assert_hidden(case, masked, "the masked URL")
    if case.malformed is None:
        settings = _settings(case, url)
        for what, text in (("repr", repr(settings)), ("str", str(settings)),
                           ("describe", settings.describe())):
            assert_hidden(case, text, what)
            assert_readable(case, text, what)
        assert_readable(case, masked, "the masked URL")
    else:
        with pytest.raises(ConfigError) as caught:
            _settings(case, url)
        assert case.malformed in str(caught.value)
        assert_hidden(case, str(caught.value), "the error")
        if case.readable:  # well-formed, only refused: shown masked
            assert_readable(case, masked, "the masked URL")
        else:
            assert "not shown" in masked
    if case.malformed is not None:
        return
    # A driver's message quoting the URL, or the password alone, is scrubbed too.
    assert_hidden(case, urls.scrub(f'could not use "{url}" (x)', secrets), "scrub")
    for secret in case.secrets:
        if len(secret) >= url_parts.SCRUB_MIN_LENGTH:
            assert urls.scrub(f"failed near {secret}.", secrets) == "failed near ***."
