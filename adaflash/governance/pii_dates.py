"""Dates of birth, one rule for every language (part of the second PII pass): a date written in
any common shape (numeric with `/ . -`, ISO, `1990年3月14日` / `1990년 3월 14일`, "14 March 1990",
"14th of March, 1990", "14. März 1990", "14 de marzo de 1990", "March 14th, 1990") is a date of
birth when a birth word in one of about twenty languages stands within 48 characters before it
or 16 after it. A date without such a word is left alone: changelogs, invoices and word problems
are full of dates that identify nobody.

Every pattern is bounded (issue 32: a scan must stay linear on one long word).
"""

from __future__ import annotations

import re

from adaflash.governance.pii_spans import Hit

_BIRTH_WORDS = re.compile(
    r"(?i)\bborn\b|\bdob\b|d\.o\.b|birth|\bb-?day\b|geboren|\bgeb\.|geburts|n[ée]e?\s+le|naissance|"
    r"nacimiento|\bnac[ií]|nascita|\bnat[oa]\s+il|nascimento|nascid[oa]|geboorte|рождени|родил|"
    r"生まれ|生年月日|誕生日|出生|생년월일|태어|urodzon|data\s+urodzenia|f[øo]dt|född|syntynyt|doğum"
)
# Month names and abbreviations in English, French, Spanish, Portuguese, Italian, German and
# Dutch, by their first letters (any inflected tail up to 8 letters: "févr.", "Oktober", "marzo").
_MONTH = (
    r"(?:jan|ene|feb|f[ée]v|m[äa]r|maa|apr|avr|abr|ma[iy]|mag|mei|jun|juin|jul|juil|aug|ao[uû]|ago|"
    r"sep|set|o[ck]t|out|nov|d[ée][czs]|dic|gen|giu|lug)[a-zäéûç]{0,8}\.?"
)
_YEAR = r"(?:19|20)\d{2}"
_DATE = re.compile(
    r"(?<!\d)(?:"
    r"\d{1,2}[./\-]\s?\d{1,2}[./\-]\s?(?:19|20)?\d{2}"  # 14/03/1990, 14.03.90, 3-14-1990
    rf"|{_YEAR}[./\-]\d{{1,2}}[./\-]\d{{1,2}}"  # 1990-03-14
    rf"|{_YEAR}\s?[年년]\s?\d{{1,2}}\s?[月월]\s?\d{{1,2}}\s?[日일]?"  # 1990年3月14日, 1990년 3월 14일
    rf"|\d{{1,2}}(?:st|nd|rd|th|\.)?\s+(?:of\s+|de\s+)?{_MONTH},?\s+(?:de\s+)?{_YEAR}"  # 14th of March, 1990
    rf"|{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+{_YEAR}"  # March 14th, 1990
    rf"|\d{{1,2}}[\-/]{_MONTH}[\-/](?:{_YEAR}|\d{{2}})"  # 14-Mar-1987, 14/mar/87
    rf"|{_MONTH}[\-/]\d{{1,2}}[\-/]{_YEAR}"  # Mar-14-1987
    r")(?!\d)",
    re.IGNORECASE,
)


def dates_of_birth(text: str, hits: list[Hit]) -> None:
    """Append a DATE_OF_BIRTH hit for every date with a birth word near it."""
    for m in _DATE.finditer(text):
        lo, hi = max(0, m.start() - 48), min(len(text), m.end() + 16)
        if _BIRTH_WORDS.search(text, lo, m.start()) or _BIRTH_WORDS.search(text, m.end(), hi):
            hits.append(Hit(m.start(), m.end(), "DATE_OF_BIRTH"))
