"""pytest plugin for torchfix, registered through the ``pytest11`` entry point.

    pytest --torchfix=fix      guards on for the whole session; fixes are listed at the end
    pytest --torchfix=warn     the same, each fix also a TorchfixWarning (once per site)
    pytest --torchfix=strict   every would-be fix raises, failing the test that hit it, naming the site
    pytest --torchfix=off      guards off for the whole session, also where a test imports torchfix (or
                               torchfix.testing, whose import would switch them on): plain torch, plain errors

A top-level module (not ``torchfix.pytest_plugin``) so that pytest loading it
does not import torchfix, which would switch the guards on by ``TORCHFIX_MODE``
in sessions that did not ask for it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

_MODES = ("fix", "warn", "strict", "off")
_ENV = "TORCHFIX_MODE"
_saved: list[str | None] = []  # TORCHFIX_MODE before an --torchfix=off session set it


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchfix")
    group.addoption(
        "--torchfix",
        choices=_MODES,
        default=None,
        help="run the session with torchfix's guards on: fix, warn, or strict (every would-be fix fails its test); "
        "off: guards off for the session even where a test imports torchfix",
    )


def _option(config: pytest.Config) -> str | None:
    return config.getoption("torchfix", default=None)


def _mode(config: pytest.Config) -> str | None:
    """The guarded mode of the session (``None``: the plugin reports nothing: no option, or ``off``)."""
    mode = _option(config)
    return None if mode == "off" else mode


def pytest_configure(config: pytest.Config) -> None:
    if _option(config) == "off":  # an import of torchfix later in the session enables nothing
        _saved.append(os.environ.get(_ENV))
        os.environ[_ENV] = "off"
        if "torchfix" in sys.modules:
            sys.modules["torchfix"].disable()
        return
    mode = _mode(config)
    if mode is None:
        return
    import torchfix

    torchfix.disable()
    torchfix.enable(mode)
    torchfix.report().clear()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _option(config) == "off" and _saved:
        previous = _saved.pop()
        if previous is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = previous
        return
    if _mode(config) is None:
        return
    import torchfix

    torchfix.disable()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    if _mode(item.config) is None:
        yield
        return
    import torchfix

    before = len(torchfix.report().events)
    yield
    events = torchfix.report().events[before:]
    if events:
        lines = [f"{e.op} [{e.guard}/{e.action}] at {e.site}{' in ' + e.module if e.module else ''}: {e.detail}" for e in events]
        item.add_report_section("call", "torchfix", "\n".join(lines))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    mode = _mode(config)
    if mode is None:
        return
    import torchfix

    terminalreporter.section(f"torchfix ({mode})")
    terminalreporter.write_line(torchfix.report().summary())
