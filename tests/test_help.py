"""Help where users look: %mnb?, %mnb start?, --help/-h on every command, %%megatron?.

Every help text is generated from the parser the magic parses with, so these
tests check it lists every option string of that parser, with its default.
No pool is started: help never touches the ranks.
"""

from __future__ import annotations

import argparse

import pytest
from IPython.core.interactiveshell import InteractiveShell

from mnb.controller import current_pool
from mnb.notebook.magics import MNB_COMMANDS, SUBCOMMAND_PARSERS, help_end_transformer, megatron_parser

PARSERS = {**{f"%mnb {name}": make for name, make in SUBCOMMAND_PARSERS.items()}, "%%megatron": megatron_parser}


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every listed option (a hidden one, such as --dp, which only answers with an error, aside)."""
    return [s for action in parser._actions if action.help != argparse.SUPPRESS for s in action.option_strings]


def positional_choices(parser: argparse.ArgumentParser) -> list[str]:
    return [str(c) for action in parser._actions if not action.option_strings for c in (action.choices or [])]


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mnb")
    return ip


def shown(shell, capsys, code: str) -> str:
    """What a notebook cell shows (stdout and stderr); the cell must succeed."""
    capsys.readouterr()
    result = shell.run_cell(code)
    captured = capsys.readouterr()
    assert result.success, (code, captured.out, captured.err)
    return captured.out + captured.err


def assert_full_help(text: str, parser: argparse.ArgumentParser) -> None:
    missing = [s for s in option_strings(parser) + positional_choices(parser) if s not in text]
    assert not missing, f"{parser.prog}: help lacks {missing}\n{text}"
    assert "examples:" in text and parser.prog in text


def test_every_command_has_parser_and_help():
    assert set(SUBCOMMAND_PARSERS) == set(MNB_COMMANDS) == {"start", "status", "stop", "restart", "stacks", "debug", "plot",
                                                          "plan", "run", "export", "profile"}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_lists_every_option_with_its_default_and_an_example(name):
    parser = PARSERS[name]()
    text = parser.format_help()
    assert_full_help(text, parser)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:  # --dp: only an error
            continue
        described = formatter._get_help_string(action)
        assert "default" in described or "required" in described, (name, action.option_strings, described)


def test_megatron_help_states_the_layout_semantics():
    text = " ".join(megatron_parser().format_help().split())
    assert "names any layout flag" in text and "runs under exactly that layout" in text
    assert "the dimensions it does not name are 1, sequence parallelism and FSDP are off" in text
    assert "A cell that names none keeps the pool's current layout" in text


@pytest.mark.parametrize("command", MNB_COMMANDS)
@pytest.mark.parametrize("spelling", ["{c} --help", "{c} -h", "{c}?", "{c} ?", "help {c}"])
def test_mnb_command_help_in_a_shell(shell, capsys, command, spelling):
    text = shown(shell, capsys, "%mnb " + spelling.format(c=command))
    assert_full_help(text, SUBCOMMAND_PARSERS[command]())
    assert "Object `" not in text and current_pool(required=False) is None


def test_help_flag_wins_over_other_arguments(shell, capsys):
    # Required flags missing (plan) or a line that would start ranks: help only.
    assert_full_help(shown(shell, capsys, "%mnb plan --help"), SUBCOMMAND_PARSERS["plan"]())
    assert_full_help(shown(shell, capsys, "%mnb start -n 2 --device cpu?"), SUBCOMMAND_PARSERS["start"]())
    assert current_pool(required=False) is None


def test_mnb_question_mark_shows_every_command(shell, capsys):
    text = shown(shell, capsys, "%mnb?")
    for make in SUBCOMMAND_PARSERS.values():
        assert_full_help(text, make())
    overview = shown(shell, capsys, "%mnb --help")
    assert all(f"%mnb {name}" in overview for name in MNB_COMMANDS) and "%%megatron" in overview
    assert shown(shell, capsys, "%mnb") == overview  # a bare %mnb says what there is


@pytest.mark.parametrize("code", ["%%megatron?", "%%megatron --help\nx = 1", "%%megatron -h\nx = 1",
                                  "%%megatron --tp 2?\nx = 1", "%%megatron --tp 2 --help\nx = 1"])
def test_megatron_help_in_a_shell(shell, capsys, code):
    text = shown(shell, capsys, code)
    assert_full_help(text, megatron_parser())
    assert current_pool(required=False) is None  # no "no pool is running" error either


def test_question_mark_transformer_leaves_other_lines_alone():
    assert help_end_transformer(["%mnb start?\n"]) == ["%mnb start --help\n"]
    assert help_end_transformer(["x = 1\n", "%mnb plot timeline??"]) == ["x = 1\n", "%mnb plot timeline --help"]
    for lines in (["%mnb?\n"], ["len?\n"], ["%mnb start\n"], ["%%megatron\n", "%mnb start?\n"]):
        assert help_end_transformer(lines) == lines


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_the_magics_reference_lists_every_flag():
    text = (ROOT / "docs" / "magics.md").read_text()
    for name, make in PARSERS.items():
        parser = make()
        missing = [s for s in option_strings(parser) + positional_choices(parser) if f"{s}" not in text]
        assert not missing, f"docs/magics.md lacks {name} {missing}"
        assert name.split()[-1] in text


def test_readme_is_short_and_links_the_docs():
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= 950 and "Linux only" in readme and "## The two commands" in readme
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", readme)
    for page in ("magics", "api", "playbook", "security", "cpu-mode", "several-machines", "architecture"):
        assert f"docs/{page}.md" in links
    assert all((ROOT / link).is_file() for link in links), links
