"""Realistic surrogates for detected PII, consistent within a record (issue 13).

A `<PERSON>` placeholder makes training text unlike served text; a drafter trained on it learns
to predict placeholders. Instead every detected span gets a fake value of the same shape:
a faker name with as many parts (the same real name part always maps to the same fake part
within a record, also inside e-mail user names), a Luhn-valid card with the same grouping, an
IBAN of the same country with valid check digits, digits/letters of phone numbers and IDs
replaced keeping separators, a date of birth with plausible day/month/year, a street address
whose street-type words are kept. The generator is seeded per record (from a hash of its texts),
so a redelivered batch produces identical output; no surrogate depends on a value alone, so a
surrogate reveals nothing about the value it replaced.
"""

from __future__ import annotations

import hashlib
import random
import re
import string

from stdnum import luhn

_KEY_PREFIX = re.compile(
    r"^(?:sk-proj-|sk-live-|sk-test-|sk-|(?:sk|rk|pk)_(?:live|test)_|AKIA|ASIA|gh[pousr]_|github_pat_|glpat-|"
    r"xox[abposr]-|AIza|hf_|eyJ|npm_|SG\.)"
)
_KEEP_WORDS = {
    "street", "st", "avenue", "ave", "road", "rd", "boulevard", "blvd", "lane", "ln", "drive", "dr",
    "court", "ct", "way", "place", "pl", "terrace", "circle", "parkway", "square", "sq", "crescent",
    "close", "apt", "apartment", "suite", "unit", "flat", "north", "south", "east", "west", "rue",
    "avenida", "calle", "via", "viale", "piazza", "corso", "rua", "travessa", "ul", "ulica", "al",
    "de", "la", "le", "du", "des", "del", "da", "do", "dos", "di", "della", "van", "von", "der",
    "at", "dot", "AT", "DOT", "com", "org", "net", "co", "uk", "gmail", "yahoo", "outlook", "hotmail",
    "proton", "qq", "163", "icloud", "mail", "posteo", "yandex", "ku", "shi", "www", "https", "http",
}  # fmt: skip
_GERMANIC_SUFFIX = re.compile(
    r"(stra(?:ß|ss)e|str\.|weg|gasse|allee|platz|damm|ring|gracht|laan|straat|vej|gatan|gata|veien|vei|katu|utca)$"
)
_MONTH_NAMES = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
]  # fmt: skip


# Surrogate names come from one of these locales per record (coherent within the record). They
# are deliberately not en_US: traffic is mostly English, so a surrogate drawn from the most common
# US names would often coincide with some other record's real name, which an auditor grepping for
# that name could not tell from a leak.
SURROGATE_LOCALES = (
    "de_DE", "fr_FR", "es_ES", "it_IT", "nl_NL", "pl_PL", "pt_BR", "sv_SE", "da_DK", "fi_FI", "cs_CZ",
    "tr_TR",
)  # fmt: skip


def fakers(seed: int = 0) -> list:
    """One seeded name generator per surrogate locale. Only faker's person provider is loaded: a
    full `Faker(locale)` loads every provider and took ~1 s per locale."""
    from importlib import import_module

    from faker import Generator

    out = []
    for loc in SURROGATE_LOCALES:
        g = Generator()
        g.add_provider(import_module(f"faker.providers.person.{loc}").Provider)
        g.seed_instance(seed)
        out.append(g)
    return out


def _ascii(s: str) -> str:
    import unicodedata

    return unicodedata.normalize("NFKD", s).encode("ascii", "ignore").decode() or "x"


class Surrogates:
    """One record's surrogate generator: `surrogate(entity, value)` is consistent within it."""

    def __init__(self, fake, seed_text: str) -> None:
        seed = int.from_bytes(
            hashlib.blake2b(seed_text.encode("utf-8", "replace"), digest_size=8).digest(), "big"
        )
        if isinstance(fake, list | tuple):  # one locale per record
            fake = fake[seed % len(fake)]
        self.fake = fake
        fake.seed_instance(seed)
        self.rng = random.Random(seed)
        self.values: dict[tuple[str, str], str] = {}
        self.tokens: dict[str, str] = {}  # real name part (lower case) -> fake part

    # -- public ------------------------------------------------------------------------------------
    def surrogate(self, entity: str, value: str) -> str:
        key = (entity, value)
        if key not in self.values:
            fn = {
                "PERSON": self._person,
                "EMAIL_ADDRESS": self._email,
                "USERNAME": self._username,
                "CREDIT_CARD": self._card,
                "IBAN_CODE": self._iban,
                "DATE_OF_BIRTH": self._date,
                "STREET_ADDRESS": self._address,
                "CREDENTIAL": self._credential,
                "IP_ADDRESS": self._ip,
                "PHONE_NUMBER": self._phone,
            }.get(entity, self._shape)
            out = value
            for _ in range(8):  # a surrogate must differ from what it replaces
                out = fn(value)
                if out != value:
                    break
            self.values[key] = out
        return self.values[key]

    # -- names ------------------------------------------------------------------------------------------
    def _part(self, real: str, first: bool, ascii_only: bool = False) -> str:
        k = real.lower()
        if k not in self.tokens:
            for _ in range(8):
                fake = self.fake.first_name() if first else self.fake.last_name()
                if fake.lower() != k and fake.lower() not in self.tokens.values():
                    break
            self.tokens[k] = fake.lower()
        return re.sub(r"[^a-z]", "", _ascii(self.tokens[k])) or "x" if ascii_only else self.tokens[k]

    @staticmethod
    def _case_like(src: str, fake: str) -> str:
        if src.isupper() and len(src) > 1:
            return fake.upper()
        if src.islower():
            return fake.lower()
        return fake[:1].upper() + fake[1:]

    def _person(self, value: str) -> str:
        parts = re.split(r"([\s\-]+)", value)
        out, first = [], True
        for p in parts:
            if (
                not p
                or re.fullmatch(r"[\s\-]+", p)
                or p.lower() in _KEEP_WORDS
                or not any(c.isalpha() for c in p)
            ):
                out.append(p)
                continue
            out.append(self._case_like(p, self._part(p.strip(".'’"), first)))
            first = False
        return "".join(out)

    def _words(self, s: str, ascii_only: bool = True) -> str:
        """Letters runs → fake name parts (consistent with the record's names), digits → random digits."""

        def word(m: re.Match) -> str:
            w = m.group(0)
            if w.lower() in _KEEP_WORDS:
                return w
            if w.isdigit():
                return "".join(self.rng.choice(string.digits) for _ in w)
            if len(w) <= 2:
                return "".join(self.rng.choice(string.ascii_lowercase) for _ in w)
            return self._case_like(w, self._part(w, first=len(self.tokens) % 2 == 0, ascii_only=ascii_only))

        return re.sub(r"[^\W\d_]+|\d+", word, s)

    def _email(self, value: str) -> str:
        m = re.search(r"\s*(?:@|[\[({<]\s*at\s*[\])}>]|\bat\b|\bAT\b|\(@\))\s*", value)
        if not m:
            return self._words(value)
        user, sep, domain = value[: m.start()], m.group(0), value[m.end() :]
        labels = re.split(r"(\s*(?:\.|[\[({<]\s*dot\s*[\])}>]|\bdot\b|\bDOT\b)\s*)", domain)
        # The last label is the TLD; well-known providers stay (they identify nobody).
        out = []
        word_labels = [i for i, x in enumerate(labels) if i % 2 == 0]
        for i, lab in enumerate(labels):
            if i % 2 == 1 or i == word_labels[-1] or lab.lower() in _KEEP_WORDS:
                out.append(lab)
            else:
                word = _ascii(self.fake.last_name().lower().replace(" ", "-"))
                out.append(word if lab.islower() else word.capitalize())
        return self._words(user) + sep + "".join(out)

    def _username(self, value: str) -> str:
        return self._words(value)

    # -- numbers and codes ----------------------------------------------------------------------------
    def _shape(self, value: str, keep: int = 0) -> str:
        out = []
        for i, c in enumerate(value):
            if i < keep:
                out.append(c)
            elif c.isdigit():
                out.append(self.rng.choice(string.digits))
            elif c.isascii() and c.isupper():
                out.append(self.rng.choice(string.ascii_uppercase))
            elif c.isascii() and c.islower():
                out.append(self.rng.choice(string.ascii_lowercase))
            else:
                out.append(c)
        return "".join(out)

    def _phone(self, value: str) -> str:
        # Keep the "+country" or leading trunk "0": the number stays recognisably of its region.
        m = re.match(r"^\s*(?:\+|00)\d{1,2}|^\s*\(?0", value)
        return self._shape(value, keep=m.end() if m else 1)

    def _card(self, value: str) -> str:
        digits = [i for i, c in enumerate(value) if c.isdigit()]
        if len(digits) < 12:
            return self._shape(value)
        new = [value[digits[0]]] + [self.rng.choice(string.digits) for _ in digits[1:-1]]
        new.append(luhn.calc_check_digit("".join(new)))
        chars = list(value)
        for i, d in zip(digits, new, strict=True):
            chars[i] = d
        return "".join(chars)

    def _iban(self, value: str) -> str:
        m = re.search(r"[A-Z]{2}\d{2}(?:\s?[A-Z0-9]){8,}", value)  # the IBAN inside a wider span
        if m and (m.start() or m.end() < len(value)):
            return value[: m.start()] + self._iban(m.group(0)) + self._shape(value[m.end() :])
        compact = re.sub(r"\s", "", value).upper()
        if len(compact) < 8 or not compact[:2].isalpha():
            return self._shape(value)
        bban = self._shape(compact[4:])
        numeric = "".join(str(int(c, 36)) for c in bban + compact[:2] + "00")
        check = f"{98 - int(numeric) % 97:02d}"
        new = compact[:2] + check + bban
        out, j = [], 0
        for c in value:  # the original grouping
            if c.isspace():
                out.append(c)
            else:
                out.append(new[j])
                j += 1
        return "".join(out)

    def _ip(self, value: str) -> str:
        if re.fullmatch(r"\d{1,3}(?:\.\d{1,3}){3}", value):
            return ".".join(
                [str(self.rng.randint(11, 223))]
                + [str(self.rng.randint(0, 255)) for _ in range(2)]
                + [str(self.rng.randint(1, 254))]
            )
        return re.sub(r"[0-9a-fA-F]", lambda m: self.rng.choice("0123456789abcdef"), value)

    def _credential(self, value: str) -> str:
        m = _KEY_PREFIX.match(value)
        return self._shape(value, keep=m.end() if m else 0)

    def _date(self, value: str) -> str:
        year = str(self.rng.randint(1950, 2004))
        month = self.rng.randint(1, 12)
        day = self.rng.randint(1, 28)

        def num(m: re.Match) -> str:
            s = m.group(0)
            n = int(s)
            if len(s) == 4:
                return year
            if len(s) == 2 and n > 31:
                return year[2:]
            return (
                f"{month:0{len(s)}d}"
                if n <= 12 and (m.start() > 0 and value[m.start() - 1] in "/.-")
                else f"{day:0{len(s)}d}"
            )

        out = re.sub(r"\d+", num, value)
        return re.sub(
            r"(?i)\b(" + "|".join(n[:3] for n in _MONTH_NAMES) + r")[a-z]*\.?",
            lambda m: (
                self.rng.choice(_MONTH_NAMES)[: len(m.group(0))]
                if len(m.group(0)) <= 4
                else self.rng.choice(_MONTH_NAMES)
            ),
            out,
        )

    def _address(self, value: str) -> str:
        def word(m: re.Match) -> str:
            w = m.group(0)
            if w.isdigit():
                return "".join(self.rng.choice(string.digits) for _ in w)
            if w.lower().rstrip(".") in _KEEP_WORDS or not w[:1].isupper():
                return w
            g = _GERMANIC_SUFFIX.search(w)
            if g and g.start() > 0:
                return self.fake.last_name() + g.group(1)
            if w.isupper():
                return self._shape(w)
            return self.fake.last_name()

        return re.sub(r"[^\W\d_][\w'’]*\.?|\d+", word, value)
