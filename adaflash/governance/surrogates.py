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
_MONTHS_LOWER = {n.lower() for n in _MONTH_NAMES}  # a full month name is replaced by a full one


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
            if entity.startswith("ENCODED_"):
                self.values[key] = self._encoded(value)
                return self.values[key]
            fn = {
                "NATIONAL_ID": self._checksummed,
                "US_SSN": self._checksummed,
                "UK_NHS": self._checksummed,
                "CRYPTO": self._crypto,
                "LOCATION_GPS": self._gps,
                "MAC_ADDRESS": self._hex,
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
            if out == value:  # a shape no generator above changes: at least its digits differ
                out = re.sub(r"\d", lambda _: self.rng.choice(string.digits), value)
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
        from adaflash.governance.pii_scripts import script_of

        script = script_of(value)
        if script is not None:
            return _in_script(value, script, self.rng)
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
        cidr = re.fullmatch(r"(\d{1,3}(?:\.\d{1,3}){3})(/\d{1,2})", value)
        if cidr:  # a network keeps its prefix length and stays a valid address
            return self._ip(cidr.group(1)) + cidr.group(2)
        if re.fullmatch(r"\d{1,3}(?:\.\d{1,3}){3}", value):
            return ".".join(
                [str(self.rng.randint(11, 223))]
                + [str(self.rng.randint(0, 255)) for _ in range(2)]
                + [str(self.rng.randint(1, 254))]
            )
        return re.sub(r"[0-9a-fA-F]", lambda m: self.rng.choice("0123456789abcdef"), value)

    def _credential(self, value: str) -> str:
        if re.fullmatch(r"[0-9a-fA-F]{16,}", value):  # a hex key stays hex
            return self._hex(value)
        m = _KEY_PREFIX.match(value)
        return self._shape(value, keep=m.end() if m else 0)

    # -- kinds with a validator: the surrogate passes the validator that detected the value ----------
    def _hex(self, value: str, keep: int = 0) -> str:
        def one(c: str) -> str:
            d = self.rng.choice("0123456789abcdef")
            return d.upper() if c.isupper() else d

        return value[:keep] + "".join(one(c) if c in string.hexdigits else c for c in value[keep:])

    def _checksummed(self, value: str) -> str:
        """Same shape, and valid for every checksum the value was valid for (CPF, SIN, BSN, ...)."""
        from adaflash.governance.pii_ids import valid_kinds

        checks = valid_kinds(value)

        def passes(s: str) -> bool:
            try:
                return all(ok(s) for ok in checks)
            except Exception:  # noqa: BLE001 - stdnum raises on some odd inputs (cn.ric: KeyError)
                return False

        # The body is drawn, then the check character is searched for. Ids with a region or a
        # birth date inside (cn.ric, pl.pesel, it.codicefiscale) rarely have a valid body when
        # every digit is drawn, so later rounds keep more of the original's head.
        last = "0123456789" + string.ascii_uppercase if value[-1:].isalnum() else value[-1:]
        for keep in (0, 6, max(len(value) - 5, 0)):
            for _ in range(60):
                body = self._shape(value[:-1], keep=keep)
                for c in last:
                    if body + c != value and passes(body + c):
                        return body + c
        return self._shape(value)

    def _phone(self, value: str) -> str:
        import phonenumbers

        m = re.match(r"^\s*(?:\+|00)\d{1,2}|^\s*\(?0", value)
        keep = m.end() if m else 1
        try:
            parsed = phonenumbers.parse(
                value.replace("00", "+", 1) if value.startswith("00") else value, "GB"
            )
            valid = phonenumbers.is_valid_number(parsed)
        except phonenumbers.NumberParseException:
            valid = False
        out = self._shape(value, keep=keep)
        for _ in range(200 if valid else 0):  # a valid number gets a valid number of its region
            try:
                n = phonenumbers.parse(out.replace("00", "+", 1) if out.startswith("00") else out, "GB")
                if phonenumbers.is_valid_number(n) and n.country_code == parsed.country_code:
                    break
            except phonenumbers.NumberParseException:
                pass
            out = self._shape(value, keep=keep)
        return out

    def _crypto(self, value: str) -> str:
        if value.lower().startswith("0x"):
            return "0x" + self._hex(value[2:].lower())
        m = re.match(r"(bc|tb|ltc)1", value.lower())
        if m:
            return _bech32(m.group(1), len(value) - len(m.group(0)) - 6, self.rng)
        return self._shape(value)

    def _gps(self, value: str) -> str:
        nums = list(re.finditer(r"-?\d+(?:\.\d+)?", value))

        def one(i: int, m: re.Match) -> str:
            s = m.group(0)
            dec = len(s.split(".")[1]) if "." in s else 0
            bound = 80 if i % 2 == 0 else 179
            if "°" in value:  # degrees, minutes, seconds: each in its own range
                bound = [80, 59, 59][i % 3] if value.count("°") < 2 else [80, 59, 59, 179, 59, 59][i % 6]
            x = self.rng.uniform(0 if "°" in value else -bound, bound)
            return f"{x:.{dec}f}" if dec else str(int(x))

        out, pos = [], 0
        for i, m in enumerate(nums):
            out += [value[pos : m.start()], one(i, m)]
            pos = m.end()
        return "".join(out) + value[pos:]

    def _encoded(self, value: str) -> str:
        """Decode, replace what the rules find with this record's surrogates, encode again."""
        from adaflash.governance.pii_kinds import rule_hits
        from adaflash.governance.pii_record import decode, encode, encoding_of

        enc = encoding_of(value)
        text = decode(enc, value)
        if text is None:
            return self._shape(value)
        parts, pos = [], 0
        for h in sorted(rule_hits(text), key=lambda h: h.start):
            if h.start < pos:
                continue
            parts += [text[pos : h.start], self.surrogate(h.entity, text[h.start : h.end])]
            pos = h.end
        return encode(enc, "".join(parts) + text[pos:], value)

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
        # "3rd of July" -> "15th of July", never "15rd".
        out = re.sub(r"(\d+)(?:st|nd|rd|th)\b", lambda m: _ordinal(int(m.group(1))), out)

        def month_name(m: re.Match) -> str:  # a full name for a full name ("July"), else "Nov" / "Nov."
            w, fake = m.group(0), self.rng.choice(_MONTH_NAMES)
            if w.rstrip(".").lower() in _MONTHS_LOWER:
                return fake
            return fake[:3] + ("." if w.endswith(".") else "")

        return re.sub(r"(?i)\b(" + "|".join(n[:3] for n in _MONTH_NAMES) + r")[a-z]*\.?", month_name, out)

    def _cjk_address(self, value: str) -> str:
        return _cjk_place(self.rng, value)

    def _address(self, value: str) -> str:
        if re.search(r"[\u3040-\u30ff\u4e00-\u9fff\uac00-\ud7af]", value):
            return self._cjk_address(value)

        def word(m: re.Match) -> str:
            w = m.group(0)
            if w[:1].isdigit():  # a house number or an ordinal street ("42nd"): no leading zero
                digits = m.group(1) or w
                n = self.rng.randrange(10 ** (len(digits) - 1) if len(digits) > 1 else 1, 10 ** len(digits))
                return _ordinal(n) if m.group(1) else str(n)
            if w.lower().rstrip(".") in _KEEP_WORDS or not w[:1].isupper():
                return w
            g = _GERMANIC_SUFFIX.search(w)
            if g and g.start() > 0:
                return self.fake.last_name() + g.group(1)
            if w.isupper():
                return self._shape(w)
            return self.fake.last_name()

        return re.sub(r"(\d+)(?:st|nd|rd|th)\b|\d+|[^\W\d_][\w'’]*\.?", word, value)


def _ordinal(n: int) -> str:
    """21 -> "21st", 12 -> "12th", 103 -> "103rd"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


_BECH32 = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"


def _bech32(hrp: str, n_data: int, rng: random.Random) -> str:
    """A random bech32 address (BIP 173) with a valid checksum: witness version 0, `n_data` symbols."""

    def polymod(values: list[int]) -> int:
        gen = [0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3]
        chk = 1
        for v in values:
            top = chk >> 25
            chk = (chk & 0x1FFFFFF) << 5 ^ v
            for i in range(5):
                chk ^= gen[i] if (top >> i) & 1 else 0
        return chk

    data = [0] + [rng.randrange(32) for _ in range(max(n_data - 1, 1))]
    expand = [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp]
    mod = polymod(expand + data + [0] * 6) ^ 1
    checksum = [(mod >> 5 * (5 - i)) & 31 for i in range(6)]
    return hrp + "1" + "".join(_BECH32[d] for d in data + checksum)


def _in_script(value: str, script: str, rng: random.Random) -> str:
    """A name of the same script (a faker locale that writes it), as many words as the original."""
    from adaflash.governance.pii_scripts import SCRIPTS

    g = _script_faker(rng.choice(SCRIPTS[script][1]))
    g.seed_instance(rng.getrandbits(32))
    if " " not in value.strip():  # CJK: family name + given name, no space
        return (g.last_name() + g.first_name())[: max(len(value), 2)]
    words = value.split()
    out = [g.first_name()] + [g.last_name() for _ in words[1:]]
    return " ".join(w.split()[0] for w in out)


def _script_faker(locale: str):
    from importlib import import_module

    from faker import Generator

    if locale not in _SCRIPT_FAKERS:
        g = Generator()
        g.add_provider(import_module(f"faker.providers.person.{locale}").Provider)
        _SCRIPT_FAKERS[locale] = g
    return _SCRIPT_FAKERS[locale]


_SCRIPT_FAKERS: dict = {}


# Place-name characters for CJK address surrogates; the administrative suffixes (市, 区, 路, 号...)
# and the digits' positions are kept, so the surrogate still reads as an address.
_CJK_PLACE = "东南西北中新安宁平和华光明长春兴福德山川江河湖海林松竹梅桜田村井本上下大小"
_CJK_KEEP = set("省市都道府県縣县区區町村郡路街道大号號番地丁目楼樓室階巷弄")


def _cjk_place(rng: random.Random, value: str) -> str:
    return "".join(
        rng.choice(_CJK_PLACE)
        if "\u4e00" <= c <= "\u9fff" and c not in _CJK_KEEP
        else rng.choice(string.digits)
        if c.isdigit()
        else c
        for c in value
    )
