"""The errors a caller catches for bad input: light to import (the command line and every file
boundary raise them before torch loads)."""

from gradspec.options import OptionError


class InputError(ValueError):
    """Bad input, with the file and line, row or field it came from."""


class OptionInputError(InputError, OptionError):
    """Bad input in a file an option gives, the option named as the caller names it."""
