"""Every subcommand's --help: each option explained, no meaningless "(default: None)"."""

import argparse

import pytest

from aiayn.cli import build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


SUBCOMMANDS = _subparsers()


def test_the_main_commands_are_there():
    assert {"train", "translate", "evaluate", "pipeline", "vocab", "average"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_help_names_real_defaults_only(name):
    parser = SUBCOMMANDS[name]
    text = parser.format_help()
    for empty in ("(default: None)", "(default: False)", "(default: [])"):
        assert empty not in text, f"aiayn {name} --help shows {empty}"
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help, f"aiayn {name}: option {action.option_strings or action.dest} has no help"
        if "default" in action.help:  # the text names it; the formatter must not add a second one
            assert formatter._get_help_string(action) == action.help


def test_real_defaults_are_still_shown():
    text = SUBCOMMANDS["prepare"].format_help()
    assert "(default: 256)" in text and "(default: en)" in text
