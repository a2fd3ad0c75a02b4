"""What the seeded fuzz tests of saved states share: a file's bytes garbled, and one place of a nested
state (dicts, lists, tuples) replaced or removed."""

import math
import random

GONE = object()  # replaced(..., GONE): the thing at the place removed

# Values a field may be given instead of its own (those JSON can hold; the fuzz of torch files adds tensors)
ODD = [None, True, False, 0, -1, 1, 1.5, 0.999999, math.nan, math.inf, -math.inf, 2**70, -(2**70), "x", "", [], {},
       [0.9, 0.999], {"a": 1}]


def garbled(rng: random.Random, data: bytes) -> bytes:
    """Random bytes, data cut short, or data with a few bytes changed."""
    kind = rng.randrange(3)
    if kind == 0:
        return rng.randbytes(rng.randrange(200))
    if kind == 1:
        return data[: rng.randrange(len(data))]
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def places(value, path: tuple = ()):
    """Every place in a nested state (dict keys, list and tuple positions): containers and leaves."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from places(v, (*path, k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from places(v, (*path, i))


def at(value, path: tuple):
    for step in path:
        value = value[step]
    return value


def replaced(value, path: tuple, new):
    """value with the thing at path replaced by new (removed where new is GONE); the containers on the
    way copied, the rest shared."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    items = dict(value) if isinstance(value, dict) else list(value)
    if rest or new is not GONE:
        items[head] = replaced(value[head], rest, new)
    else:
        del items[head]
    return type(value)(items) if isinstance(value, tuple) else items
