"""Every numeric setting, as a flag or as its DRAIN_* variable: one line, exit 2.

These run ``drain.cli.main.main`` in-process: a value is refused while the
arguments are read, before anything connects.
"""

from __future__ import annotations

import pytest

from drain.cli import main as cli
from drain.settings import config, options

#: (command, flag, its variable or None, values it must refuse)
NUMERIC = [
    ("run", "--batch-size", "DRAIN_BATCH_SIZE", ["0", "-5", "lots", "", "1.5", "nan"]),
    ("run", "--pipeline", "DRAIN_PIPELINE", ["0", "17", "two"]),
    ("run", "--poll-interval", "DRAIN_POLL_INTERVAL", ["0", "-1", "nan", "inf", "soon", ""]),
    ("run", "--confirm-timeout", "DRAIN_CONFIRM_TIMEOUT", ["0", "-30", "NaN", "1e999"]),
    ("run", "--broker-heartbeat", "DRAIN_BROKER_HEARTBEAT", ["0", "61", "2.5", "off"]),
    ("run", "--queue-max-priority", "DRAIN_QUEUE_MAX_PRIORITY", ["-1", "256", "high"]),
    ("run", "--max-message-size", "DRAIN_MAX_MESSAGE_SIZE", ["0", "16MB"]),
    ("run", "--rescan-interval", "DRAIN_RESCAN_INTERVAL", ["-1", "nan", "-inf", "never"]),
    ("run", "--lanes", "DRAIN_LANES", ["0", "65", "x"]),
    ("run", "--lane", "DRAIN_LANE", ["-1", "first"]),
    ("run", "--metrics-port", "DRAIN_METRICS_PORT", ["-1", "65536", "http"]),
    ("run", "--metrics-interval", "DRAIN_METRICS_INTERVAL", ["0", "-15", "nan", "x"]),
    ("run", "--lock-key", "DRAIN_LOCK_KEY", [str(2**63), "1.5", "key"]),
    ("status", "--lock-key", "DRAIN_LOCK_KEY", [str(-(2**63) - 1)]),
    ("status", "--watch", None, ["0", "-2", "nan", "fast"]),
    ("stage t.x", "--priority", None, ["40000", "-32769", "top"]),
    ("stage t.x", "--countdown", None, ["-1", "nan", "later"]),
    ("stage t.x", "--expires", None, ["-5", "inf"]),
    ("dead list", "--limit", None, ["0", "all"]),
]
CASES = [(cmd, flag, env, value) for cmd, flag, env, values in NUMERIC for value in values]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    code = exit_info.value.code
    return code if isinstance(code, int) else 1, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}={c[3]!r}" for c in CASES])
def test_a_bad_flag_is_one_line_and_exit_2(
    case: tuple[str, str, str | None, str], capsys: pytest.CaptureFixture[str],
) -> None:
    command, flag, _, value = case
    code, lines = _run([*command.split(), f"{flag}={value}"], capsys)
    assert code == 2
    assert lines[-1].startswith(f"drain {command.split(maxsplit=1)[0]}")
    assert f": error: argument {flag}: " in lines[-1]
    assert lines[-1].endswith(repr(value.strip())), lines[-1]
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), lines


ENV_CASES = [case for case in CASES if case[2] and case[3].strip()]


@pytest.mark.parametrize("case", ENV_CASES, ids=[f"{c[2]}={c[3]!r}" for c in ENV_CASES])
def test_a_bad_variable_is_one_line_naming_it_and_exit_2(
    case: tuple[str, str, str, str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    command, _, env, value = case
    monkeypatch.setenv(env, value)
    code, lines = _run(command.split(), capsys)
    assert code == 2
    assert f": error: environment variable {env}: " in lines[-1]
    assert lines[-1].endswith(repr(value)), lines[-1]


def test_a_flag_wins_over_its_variable_even_a_bad_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAIN_BATCH_SIZE", "lots")
    parser = cli.build_parser()
    args = parser.parse_args(["run", "--batch-size", "10"])
    options.apply_env(args)
    assert args.batch_size == 10


@pytest.mark.parametrize("blank", ["", "  "])
def test_an_empty_variable_means_the_default(
    blank: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("DRAIN_BATCH_SIZE", "DRAIN_PIPELINE", "DRAIN_POLL_INTERVAL", "DRAIN_LOCK_KEY",
                 "DRAIN_METRICS_PORT", "DRAIN_RESCAN_INTERVAL"):
        monkeypatch.setenv(name, blank)
    args = cli.build_parser().parse_args(["run"])
    options.apply_env(args)
    assert (args.batch_size, args.pipeline, args.poll_interval, args.lock_key,
            args.metrics_port, args.rescan_interval) == (
        config.DEFAULT_BATCH_SIZE, config.DEFAULT_PIPELINE, 1.0, config.DEFAULT_LOCK_KEY,
        cli.DEFAULT_METRICS_PORT, 300.0)


def test_good_values_from_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAIN_BATCH_SIZE", " 250 ")
    monkeypatch.setenv("DRAIN_POLL_INTERVAL", "0.25")
    monkeypatch.setenv("DRAIN_RESCAN_INTERVAL", "0")
    monkeypatch.setenv("DRAIN_LOCK_KEY", str(-(2**63)))
    args = cli.build_parser().parse_args(["run"])
    options.apply_env(args)
    assert (args.batch_size, args.poll_interval, args.rescan_interval, args.lock_key) == (
        250, 0.25, 0.0, -(2**63))


def test_help_says_what_an_empty_variable_means(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "A variable set to the empty string counts as unset: the default applies." in (
        " ".join(capsys.readouterr().out.split()))
