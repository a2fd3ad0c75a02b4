"""The error for bad input: it names the file and the line, row or field."""


class InputError(ValueError):
    """Bad input, with the file and line or row it came from."""
