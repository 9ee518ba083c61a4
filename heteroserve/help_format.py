"""The help formatter every `heteroserve` command uses: each option's default, said once.

argparse's ArgumentDefaultsHelpFormatter appends "(default: X)" to every option, also where the help already
says its default in words and where the default is None or False (nothing to say); options without help show
nothing at all. Here an option's help gets its default appended only when the help does not mention one and the
default is a value, and an option without help still shows that default.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default in (None, False, argparse.SUPPRESS) or default == []:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
