"""The error for bad input: it names the file and the line, row or field."""


class InputError(ValueError):
    """Bad input, with the file and line or row it came from."""


def check_at_least(values: dict[str, float | None], low: float = 1) -> None:
    """Each option (flag -> value; None: not given) is at least low, or an error names it."""
    for flag, value in values.items():
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")


def check_share(values: dict[str, float | None]) -> None:
    """Each option (flag -> value) is a share in [0, 1], or an error names it."""
    for flag, value in values.items():
        if value is not None and not 0 <= value <= 1:
            raise ValueError(f"{flag} must be between 0 and 1, got {value}")
