"""Every command's --help shows every option's default."""


import pytest

from gradspec.cli import COMMANDS, _Parser


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_every_default(name):
    parser = _Parser(prog="gradspec")
    sub = parser.add_subparsers(dest="command")
    COMMANDS[name].add_parser(sub)
    command = sub.choices[name]
    command.format_help()
    formatter = command._get_formatter()
    for action in command._actions:
        switch = action.nargs == 0  # on or off by being given: its default is not being given
        if action.option_strings and not switch and action.default is not None and action.default is not False:
            shown = formatter._expand_help(action)
            assert "default" in shown and str(action.default) in shown, (action.option_strings, shown)
