"""What ``%mnb --help``, ``%mnb?`` and ``%mnb COMMAND?`` print, generated from the parsers.

Kept apart from :mod:`mnb.notebook.parsers` (the flags) and :mod:`mnb.notebook.magics` (the dispatch):
the overview, the full help that becomes the magic's docstring, when a line asks for help,
and the input transformer that turns ``%mnb start?`` into ``%mnb start --help``.
"""

from __future__ import annotations

import re

from mnb.notebook.parsers import MNB_COMMANDS, SUBCOMMAND_PARSERS


def before_script(words: list[str]) -> list[str]:
    """The words of ``%mnb run`` that are its own: ``-h`` after SCRIPT is the script's."""
    own, valued = [], {"--ranks", "--timeout", "--grace"}
    words = iter(words)
    for word in words:
        if not word.startswith("-"):
            break
        own.append(word)
        if word in valued:
            own.append(next(words, ""))
    return own


def mnb_overview() -> str:
    """What ``%mnb --help`` prints: one usage line and purpose per command."""
    lines = ["usage: %mnb COMMAND [options]     (%mnb COMMAND --help, -h or %mnb COMMAND? for one command)", ""]
    for name in MNB_COMMANDS:
        parser = SUBCOMMAND_PARSERS[name]()
        lines.append("  " + parser.format_usage().strip().removeprefix("usage: "))
        lines.append("      " + (parser.description or "").split(". ")[0].rstrip(".") + ".")
    lines += ["", "Cell magic: %%megatron [--tp N] [--pp N] ... (%%megatron? or %%megatron --help)"]
    return "\n".join(lines)


def mnb_help() -> str:
    """What ``%mnb?`` shows: the overview, then every command's flags, defaults and examples."""
    return "\n\n".join([mnb_overview()] + [SUBCOMMAND_PARSERS[name]().format_help() for name in MNB_COMMANDS])


def wants_help(argv: list[str]) -> bool:
    """``-h``/``--help`` anywhere, or a trailing ``?`` (``%mnb start -n 2?``, ``%%megatron --tp 2 ?``)."""
    return any(word in ("-h", "--help") for word in argv) or bool(argv and argv[-1].endswith("?"))


_HELP_END = re.compile(r"^(?P<magic>\s*%mnb\s+[^?\s].*?)\s*\?{1,2}\s*$")


def help_end_transformer(lines: list[str]) -> list[str]:
    """Input transformer: ``%mnb start?`` -> ``%mnb start --help``.

    IPython reads a trailing ``?`` as "inspect the last word" (``%mnb start?``
    would look up an object named ``start``); this runs before that, so the
    command's help is printed instead.  ``%mnb?`` is left to IPython (it shows
    this magic's docstring, :func:`mnb_help`).
    """
    if not lines or lines[0].lstrip().startswith("%%"):
        return lines
    out = []
    for line in lines:
        end = "\n" if line.endswith("\n") else ""
        match = _HELP_END.match(line.rstrip("\n"))
        out.append(f"{match['magic']} --help{end}" if match else line)
    return out
