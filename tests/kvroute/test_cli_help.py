"""Every ``kvroute`` subcommand explains itself the same way."""

from __future__ import annotations

import argparse

import pytest

from kvroute.cli import LOG_LEVELS, build_parser, leaf_parsers, main


def _options(leaf: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in leaf._actions if not isinstance(a, argparse._HelpAction)]


def test_every_subcommand_and_option_has_a_help_line() -> None:
    parser = build_parser()
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if not choice.help:
                    missing.append(f"kvroute {choice.dest}")
    leaves = list(leaf_parsers(parser))
    assert len(leaves) >= 11
    for leaf in leaves:
        assert leaf.description, leaf.prog
        for action in _options(leaf):
            if not (action.help or "").strip():
                missing.append(f"{leaf.prog} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_help_shows_defaults() -> None:
    help_text = {leaf.prog: " ".join(leaf.format_help().split())
                 for leaf in leaf_parsers(build_parser())}
    assert "(default: 16)" in help_text["kvroute sim"]  # --block-size
    assert "(default: 4)" in help_text["kvroute demo"]  # --replicas
    assert "(default: round_robin,least_loaded,session,kv)" in help_text[
        "kvroute bench compare"]


def test_same_named_options_mean_the_same_thing() -> None:
    by_name: dict[str, set[tuple[object, ...]]] = {}
    for leaf in leaf_parsers(build_parser()):
        for action in _options(leaf):
            for name in ("--json", "--log-level"):
                if name in action.option_strings:
                    kind = (type(action).__name__, tuple(action.choices or ()))
                    by_name.setdefault(name, set()).add(kind)
    assert by_name["--json"] == {("_StoreTrueAction", ())}, by_name["--json"]
    assert by_name["--log-level"] == {("_StoreAction", LOG_LEVELS)}, by_name["--log-level"]


def test_log_level_is_case_insensitive() -> None:
    args = build_parser().parse_args(["sim", "--model", "m", "--tokenizer", "t",
                                      "--log-level", "DEBUG"])
    assert args.log_level == "debug"


def test_a_mistyped_option_gets_the_subcommand_usage_and_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--replicas", "http://127.0.0.1:8001"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvroute serve ")
    assert "unrecognized arguments: --replicas" in err and "did you mean --replica?" in err
