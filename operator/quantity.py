"""Kubernetes resource quantities in the form the API server stores them.

Why: the API server parses every quantity (`resources.requests`, `emptyDir.sizeLimit`,
...) and writes it back canonical (`0.5` -> `500m`, `1.5Gi` -> `1536Mi`, `2048Mi` ->
`2Gi`). The operator compares what it applied with what it reads back; a quantity
rendered as the user typed it would never match, and every comparison would see
drift. This is the algorithm of k8s.io/apimachinery `resource.Quantity`
(ParseQuantity + CanonicalizeBytes), in exact arithmetic.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_NUMBER = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(.*)$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}      # powers of 1024
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {e: s for s, e in _DECIMAL.items()}
_BINARY_SUFFIX = {0: "", **{e: s for s, e in _BINARY.items()}}
_NANO = Fraction(1, 10**9)


class QuantityError(ValueError):
    """Not a quantity the API server would accept."""


def parse(text: str) -> tuple[Fraction, str]:
    """A quantity -> (exact value, format): 'binary' (Ki..Ei), 'decimal' (n..E or
    none) or 'exponent' (1e3). Non-zero values are rounded up (away from zero) to
    whole nanos, as the API server does."""
    m = _NUMBER.match(text.strip())
    if not m:
        raise QuantityError(f"not a quantity: {text!r}")
    sign, digits, suffix = m.groups()
    value = Fraction(digits)
    if suffix in _BINARY:
        value, fmt = value * 1024 ** _BINARY[suffix], "binary"
    elif suffix in _DECIMAL:
        value, fmt = value * Fraction(10) ** _DECIMAL[suffix], "decimal"
    elif re.fullmatch(r"[eE][+-]?[0-9]+", suffix):
        value, fmt = value * Fraction(10) ** int(suffix[1:]), "exponent"
    else:
        raise QuantityError(f"not a quantity: {text!r}")
    if value:
        value = math.ceil(value / _NANO) * _NANO
    return (-value if sign == "-" else value), fmt


def _decimal_parts(value: Fraction) -> tuple[int, int]:
    """value (a whole number of nanos) = mantissa * 10**exponent, with the exponent a
    multiple of 3 and as large as an integer mantissa allows."""
    mantissa, exponent = int(value / _NANO), -9
    while mantissa and mantissa % 10 == 0:
        mantissa, exponent = mantissa // 10, exponent + 1
    while exponent % 3:
        mantissa, exponent = mantissa * 10, exponent - 1
    return mantissa, exponent


def canonical(text: str | int) -> str:
    """The string the API server stores for the quantity `text`."""
    value, fmt = parse(str(text))
    if value == 0:
        return "0"
    if fmt == "binary" and (abs(value) < 1024 or value.denominator != 1):
        fmt = "decimal"      # below 1Ki, or a fraction of a byte: shown in decimal
    if fmt == "binary":
        mantissa, exponent = int(value), 0
        while mantissa % 1024 == 0 and exponent < max(_BINARY_SUFFIX):
            mantissa, exponent = mantissa // 1024, exponent + 1
        return f"{mantissa}{_BINARY_SUFFIX[exponent]}"
    mantissa, exponent = _decimal_parts(value)
    if fmt == "exponent":
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    if exponent not in _DECIMAL_SUFFIX:  # beyond E: the API server's own fallback
        return f"{mantissa}e{exponent}"
    return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"
