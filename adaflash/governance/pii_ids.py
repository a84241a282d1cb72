"""Checksummed identifiers: which validators a digit run or an id-shaped token passes.

Each entry is (kind, is_valid, strong): `strong` when the formatted shape alone is telling (an
IBAN, a card number, a codice fiscale); a weak one (nine or eleven digits with a check digit) needs
separators or a context word as well (`pii_rules._identifiers`). python-stdnum supplies every
validator but Singapore's NRIC, which it lacks.
"""

from __future__ import annotations

import re
from functools import lru_cache


def digits(s: str) -> str:
    return "".join(c for c in s if c.isdigit())


@lru_cache(maxsize=1)
def _validators():
    """(name, is_valid, strong_shape) for checksummed IDs; strong: its formatted shape alone is telling."""
    from stdnum import iban, luhn
    from stdnum.au import tfn
    from stdnum.be import nn
    from stdnum.br import cpf
    from stdnum.ca import sin
    from stdnum.cn import ric
    from stdnum.de import idnr
    from stdnum.dk import cpr
    from stdnum.es import dni, nie
    from stdnum.fi import hetu
    from stdnum.fr import nir
    from stdnum.gb import nhs
    from stdnum.in_ import aadhaar, pan
    from stdnum.it import codicefiscale
    from stdnum.nl import bsn
    from stdnum.no import fodselsnummer
    from stdnum.pl import pesel
    from stdnum.se import personnummer
    from stdnum.za import idnr as za_idnr

    extra = _more_validators()

    def card(s: str) -> bool:
        d = digits(s)
        return 13 <= len(d) <= 19 and luhn.is_valid(d)

    return [
        ("IBAN_CODE", iban.is_valid, True),
        ("CREDIT_CARD", card, True),
        ("NATIONAL_ID", dni.is_valid, True),
        ("NATIONAL_ID", nie.is_valid, True),
        ("NATIONAL_ID", pan.is_valid, True),
        ("NATIONAL_ID", codicefiscale.is_valid, True),
        ("NATIONAL_ID", ric.is_valid, True),
        ("NATIONAL_ID", hetu.is_valid, True),
        ("NATIONAL_ID", cpf.is_valid, False),
        ("NATIONAL_ID", personnummer.is_valid, False),
        ("NATIONAL_ID", pesel.is_valid, False),
        ("NATIONAL_ID", idnr.is_valid, False),
        ("NATIONAL_ID", aadhaar.is_valid, False),
        ("NATIONAL_ID", nir.is_valid, False),
        ("NATIONAL_ID", za_idnr.is_valid, False),
        ("NATIONAL_ID", fodselsnummer.is_valid, False),
        ("NATIONAL_ID", nn.is_valid, False),
        ("NATIONAL_ID", cpr.is_valid, False),
        ("NATIONAL_ID", bsn.is_valid, False),
        ("NATIONAL_ID", sin.is_valid, False),
        ("NATIONAL_ID", nhs.is_valid, False),
        ("NATIONAL_ID", tfn.is_valid, False),
        *extra,
    ]


def _more_validators() -> list:
    """National ids beyond the first list (independent probes sent them): Mexico's CURP, Swiss AHV,
    Chile's RUT, Turkey's TC kimlik, Romania's CNP, Russia's INN, Japan's My Number, Ireland's PPS,
    Singapore's NRIC, Brazil's CNPJ (a sole trader's CNPJ identifies a person)."""
    from stdnum.br import cnpj
    from stdnum.ch import ssn as ahv
    from stdnum.cl import rut
    from stdnum.ie import pps
    from stdnum.jp import in_ as my_number
    from stdnum.mx import curp
    from stdnum.ro import cnp
    from stdnum.ru import inn
    from stdnum.tr import tckimlik

    return [
        ("NATIONAL_ID", curp.is_valid, True),
        ("NATIONAL_ID", ahv.is_valid, True),
        ("NATIONAL_ID", nric_is_valid, True),
        ("NATIONAL_ID", cnpj.is_valid, False),
        ("NATIONAL_ID", rut.is_valid, False),
        ("NATIONAL_ID", tckimlik.is_valid, False),
        ("NATIONAL_ID", cnp.is_valid, False),
        ("NATIONAL_ID", inn.is_valid, False),
        ("NATIONAL_ID", my_number.is_valid, False),
        ("NATIONAL_ID", pps.is_valid, False),
    ]


_NRIC = re.compile(r"([STFG])(\d{7})([A-Z])")


def nric_is_valid(s: str) -> bool:
    """Singapore NRIC / FIN (S, T, F, G series): weights 2765432 over the digits, +4 for T and G."""
    m = _NRIC.fullmatch(s.strip().upper())
    if m is None:
        return False
    prefix, digits, check = m.groups()
    total = sum(int(c) * w for c, w in zip(digits, (2, 7, 6, 5, 4, 3, 2), strict=True))
    total += 4 if prefix in "TG" else 0
    letters = "JZIHGFEDCBA" if prefix in "ST" else "XWUTRQPNMLK"
    return letters[total % 11] == check


def _passes(ok, s: str) -> bool:
    try:
        return bool(ok(s))
    except Exception:  # noqa: BLE001 - stdnum raises on odd input in places
        return False


def checksum_kind(s: str) -> tuple[str, bool] | None:
    for name, ok, strong in _validators():
        if _passes(ok, s):
            return name, strong
    return None


def valid_kinds(s: str) -> list:
    """The validators `s` passes (a surrogate must pass the same ones)."""
    from stdnum.kr import rrn  # found by its own rule (pii_kinds), validated all the same

    return [ok for ok in [v[1] for v in _validators()] + [rrn.is_valid] if _passes(ok, s)]
