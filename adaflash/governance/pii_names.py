"""Person names in free text: the name lexicon (first and last names of ~80 locales from
faker's data, an English word list), a score for a capitalised run, and the rules that find names
— capitalised runs, names after cues (titles, `Author:`, `Signed-off-by:`), JSON name keys and CSV
name columns. Part of the second PII pass (`pii_rules.second_pass`)."""

from __future__ import annotations

import re
from functools import lru_cache

from adaflash.governance.pii_spans import Hit
from adaflash.governance.pii_words import (
    AMBIGUOUS_NAMES,
    EXAMPLE_FULL,
    EXAMPLE_NAMES,
    NEVER_NAMES,
    english_words,
    is_function_word,
    is_word,
)


@lru_cache(maxsize=1)
def name_lexicon() -> tuple[frozenset[str], frozenset[str]]:
    """First and last names (Latin and other scripts) from faker's person data for every locale."""
    import importlib
    import pkgutil

    import faker.providers.person as person

    first: set[str] = set()
    last: set[str] = set()
    for mod_info in pkgutil.iter_modules(person.__path__):
        prov = importlib.import_module(f"faker.providers.person.{mod_info.name}").Provider
        for attr in dir(prov):
            if attr.endswith("formats") or not attr.startswith(
                ("first_name", "last_name", "first_romanized", "last_romanized")
            ):
                continue
            v = getattr(prov, attr)
            if not isinstance(v, tuple | list | dict):
                continue
            target = first if attr.startswith("first") else last
            for n in v.keys() if isinstance(v, dict) else v:
                if isinstance(n, str):
                    target.update(p for p in re.split(r"[\s\-]+", n) if len(p) >= 2 and p.isalpha())
    return frozenset(first - NEVER_NAMES), frozenset(last - NEVER_NAMES)


_PARTICLES = {
    "de", "da", "do", "dos", "das", "del", "della", "di", "du", "van", "von", "der", "den", "ter",
    "ten", "bin", "binti", "ibn", "al", "el", "la", "le", "y", "e", "zu", "st",
}  # fmt: skip
_TITLES = (
    r"Mr|Mrs|Ms|Mx|Miss|Dr|Prof|Professor|Sir|Dame|Herr|Frau|Mme|Mlle|Mm|Sr|Sra|Srta|Sig|Sig\.ra|Dott|"
    r"Shri|Smt|Pan|Pani|Sheikh|Rev|Hon|Capt|Col|Gen|Lt|Sgt|Judge|Justice|Senator|Rep|Ustadh|Ustadha|Imam"
)
# Bounded (a name part is at most ~40 letters, a hyphenated name a few parts): unbounded, a scan
# is quadratic on one long word such as "A'A'A'..." (issue 32).
_NAME_TOKEN = r"[A-ZÀ-ÖØ-ÞĀ-ſƀ-ɏḀ-ỿ][^\W\d_]{0,40}(?:['’\-][^\W\d_]{1,40}){0,4}"
_NAME_RUN = re.compile(
    r"(?<![\w@.])"
    + _NAME_TOKEN
    + r"(?:[ \t](?:(?:"
    + "|".join(sorted(_PARTICLES))
    + r")[ \t])?"
    + _NAME_TOKEN
    + r"){1,4}(?![\w@])"
)
_CUE_NAME = re.compile(
    r"(?:\b(?:" + _TITLES + r")\.?[ \t]+|"
    r"(?i:\b(?:author|written\s+by|maintained\s+by|created\s+by|authored\s+by|owner|contact|"
    r"signed-off-by|co-authored-by|reviewed-by|acked-by|tested-by|reported-by|suggested-by|cc|from|to|"
    r"copyright(?:\s+(?:\(c\)|©))?(?:\s+\d{4}(?:-\d{4})?)?|todo|fixme|per|ask|thanks|"
    r"first\s+name|last\s+name|surname|given\s+names?|family\s+name|full\s+name|name|customer|"
    r"patient|employee|applicant|@author)\b\s*[:(]?\s*))"
    r"("
    + _NAME_TOKEN
    + r"(?:[ \t\-]+(?:(?:"
    + "|".join(sorted(_PARTICLES))
    + r")[ \t]+)?"
    + _NAME_TOKEN
    + r"){0,4})"
)
# A self-introduction in a Latin-script language: what follows is the speaker's name, even a lone
# first name ("My name is Natalia").
_INTRO = re.compile(
    r"(?i:\bmy\s+name\s+is|\bmy\s+name['’]s|\bcall\s+me|\bi['’]m\s+called|\bje\s+m['’]appelle|\bme\s+llamo|"
    r"\bmi\s+nombre\s+es|\bich\s+hei(?:ß|ss)e|\bmein\s+name\s+ist|\bmi\s+chiamo|\bil\s+mio\s+nome\s+è|"
    r"\bmeu\s+nome\s+é|\bme\s+chamo|\bmijn\s+naam\s+is|\bik\s+heet|\bnazywam\s+si[ęe]|\bjmenuji\s+se)"
    r"[ \t]*[:,]?[ \t]*(" + _NAME_TOKEN + r"(?:[ \t]" + _NAME_TOKEN + r"){0,2})"
)
# A signature: a sign-off at a line's end, the name alone on the next line ("Best,\nIngrid").
_SIGNATURE = re.compile(
    r"(?i:\b(?:regards|sincerely|cheers|best(?:\s+wishes)?|yours(?:\s+truly)?|thanks|thank\s+you|love))\W{0,2}\n"
    r"[ \t]*(" + _NAME_TOKEN + r"(?:[ \t]" + _NAME_TOKEN + r"){0,2})[ \t]*(?:\n|$)"
)
_STRONG_CUE = re.compile(
    r"(?i:author|written|maintained|created|authored|signed-off-by|co-authored-by|reviewed-by|acked-by|"
    r"tested-by|reported-by|suggested-by|copyright|todo|fixme|name|surname|given|family|customer|patient|"
    r"employee|applicant|owner|contact)|^(?:" + _TITLES + r")\b"
)
_NAME_KEYS = re.compile(
    r"[\"']?(?i:first_?name|last_?name|given(?:_?name)?|family(?:_?name)?|surname|full_?name|name|"
    r"customer|contact|author|owner|user_?name|display_?name|patient|recipient|sender)[\"']?\s*[:=]\s*[\"']"
    r"([^\"'\n]{2,60})[\"']"
)


def name_score(tokens: list[str]) -> float:
    """Sum of per-token 'nameness'; 0 when some token can't be part of a name."""
    first, last = name_lexicon()
    words = english_words()
    total = 0.0
    for t in tokens:
        if t.lower() in _PARTICLES:
            continue
        if t in AMBIGUOUS_NAMES and len(tokens) > 1:
            total += 0.6
            continue
        if t in NEVER_NAMES or t.isupper() and len(t) > 1:
            return 0.0
        known = t in first or t in last
        if not known and is_function_word(t):  # "If Darryl", "When Nathan"
            return 0.0
        word = is_word(t, words)
        score = (0.6 if word else 1.0) if known else (0.0 if word else 0.5)
        if not t.isascii() and not word:
            score = max(score, 0.8)  # "Wiśniewski", "Østergaard": foreign spelling, not an English word
        if score == 0.0:
            return 0.0
        total += score
    return total


def name_like(tok: str) -> bool:
    """Could this capitalised word be part of a name next to a caught one?"""
    if not tok or not tok[0].isupper() or tok in NEVER_NAMES or (tok.isupper() and len(tok) > 1):
        return False
    first, last = name_lexicon()
    if tok in first or tok in last:
        return True
    return not is_function_word(tok) and not is_word(tok, english_words())


def find_names(text: str, hits: list[Hit]) -> None:
    for m in _NAME_RUN.finditer(text):
        toks = m.group(0).split()
        start = m.start()
        while len(toks) > 2 and not name_like(toks[0]) and is_function_word(toks[0]):
            start = text.index(toks[1], start + len(toks[0]))  # "When Marta Kowalczyk called"
            toks = toks[1:]
        if m.group(0) in EXAMPLE_FULL:
            continue
        if name_score(toks) >= 1.2:
            hits.append(Hit(start, m.end(), "PERSON", cue=False))
    for m in _CUE_NAME.finditer(text):
        cue = text[m.start() : m.start(1)].strip()
        toks = m.group(1).split()
        s, e = m.start(1), m.end(1)
        # Trim trailing words that are not name-like ("Reviewed-by: Thandiwe Nkosi Please").
        while toks and not name_like(toks[-1].split("-")[-1]) and len(toks) > 1:
            e -= len(toks[-1]) + 1
            toks = toks[:-1]
        if not toks or toks[0] in NEVER_NAMES:
            continue
        if len(toks) == 1 and toks[0] in EXAMPLE_NAMES:
            continue
        strong = bool(_STRONG_CUE.search(cue))
        if strong and (len(toks) > 1 or name_like(toks[0])) or name_score(toks) >= 1.0:
            hits.append(Hit(s, s + len(" ".join(toks)) if e - s >= len(" ".join(toks)) else e, "PERSON"))
    for m in (*_INTRO.finditer(text), *_SIGNATURE.finditer(text)):
        toks = m.group(1).split()
        while toks and not name_like(toks[-1]):  # "My name is Anna Please": the name is Anna
            toks = toks[:-1]
        if toks and toks[0] not in EXAMPLE_NAMES and " ".join(toks) not in EXAMPLE_FULL:
            hits.append(Hit(m.start(1), m.start(1) + len(" ".join(toks)), "PERSON"))
    for m in _NAME_KEYS.finditer(text):
        v = m.group(1).strip()
        toks = v.split()
        split_field = re.search(r"(?i)first|last|given|family|surname", m.group(0)[: m.start(1) - m.start()])
        if len(toks) == 1 and not split_field:  # {"name": "John", "age": 30}: example data, not a person
            continue
        if 1 <= len(toks) <= 5 and all(t[:1].isupper() for t in toks) and not any(c.isdigit() for c in v):
            if (
                v not in EXAMPLE_NAMES
                and v not in EXAMPLE_FULL
                and all(len(t) > 1 for t in toks)
                and (name_score(toks) >= 0.5)
            ):
                hits.append(Hit(m.start(1), m.start(1) + len(m.group(1).rstrip()), "PERSON"))
    _csv_names(text, hits)
    _caseless_names(text, hits)


# A name typed in lower case or capitals after a cue ("my name is john smith", "MY NAME IS JOHN
# SMITH", "Regards,\nmaria gonzalez"): spaCy and the capitalised-run rules never see it. Every word
# taken must be a known name; after a weak cue ("I am", "this is") two of them.
_CASELESS_CUE = re.compile(
    r"(?i)(?:\bmy\s+name\s+is\b|\bmy\s+name['’]s\b|\bname\s*:|\bcall\s+me\b|\bi\s+am\b|\bi['’]m\b|"
    r"\bthis\s+is\b|\bdear\b|\b(?:regards|sincerely|thanks|cheers),?[ \t]*\n|\bsigned\b:?)[ \t]*"
    r"([^\W\d_]{2,40}(?:[ \t]+[^\W\d_]{2,40}){0,2})"
)
_WEAK_CASELESS = re.compile(r"(?i)^(?:i\s+am|i['’]m|this\s+is)")


def _caseless_names(text: str, hits: list[Hit]) -> None:
    first, last = name_lexicon()
    for m in _CASELESS_CUE.finditer(text):
        toks = m.group(1).split()
        if all(t[:1].isupper() and not t.isupper() for t in toks):
            continue  # written as names usually are: the other rules judge it
        names: list[str] = []
        for t in toks:
            w = t.capitalize()
            if is_function_word(w) or w not in first and not (names and w in last):
                break
            names.append(t)
        if not names or _WEAK_CASELESS.match(m.group(0)) and len(names) < 2:
            continue
        hits.append(Hit(m.start(1), m.start(1) + len(" ".join(names)), "PERSON", judged=True))


_CSV_HEADER = re.compile(r"^[a-z][a-z0-9_ ]{0,30}$")


def _csv_names(text: str, hits: list[Hit]) -> None:
    """A CSV-ish block whose header names a `name` column: that column's cells are names."""
    lines = text.split("\n")
    pos = 0
    offsets = []
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    for i, line in enumerate(lines[:-1]):
        cols = [c.strip().lower() for c in line.split(",")]
        if len(cols) < 2 or not any("name" in c for c in cols) or not all(_CSV_HEADER.match(c) for c in cols):
            continue
        idx = [j for j, c in enumerate(cols) if "name" in c]
        for k in range(i + 1, len(lines)):
            cells = lines[k].split(",")
            if len(cells) != len(cols) or any(c in lines[k] for c in "\"':{}[]="):
                break
            start = offsets[k]
            for j, cell in enumerate(cells):
                if j in idx and cell.strip():
                    lead = len(cell) - len(cell.lstrip())
                    hits.append(Hit(start + lead, start + lead + len(cell.strip()), "PERSON"))
                start += len(cell) + 1
