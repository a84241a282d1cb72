"""What the PII layers must never touch (issue 33): text that only looks like personal data.

Every false positive is a wrong training label: the drafter learns to predict text the target
never wrote. So before any span is replaced it is checked against regions that are not personal
whatever a recogniser thinks: loopback / unspecified / private / link-local addresses and CIDR
ranges, UUIDs, version strings, hashes and integrity strings (a hex run next to a hash word, a
git log's short hashes, `sha512-...`, `h1:...`), long decimal fractions, and the numbers of a
math word problem without a PII cue. Eponyms ("the Kelvin scale", "Avogadro's number") are not
persons. A lone given name ("Natalia sold clips", "Thomas is very healthy") identifies nobody: a
record keeps it only when something in the record makes it someone's (`lone_names`).
"""

from __future__ import annotations

import ipaddress
import re

from adaflash.governance.pii_scripts import script_of
from adaflash.governance.pii_spans import Span

# Networks that identify no one: loopback, unspecified, RFC 1918, CGNAT, link-local, ULA.
# Documentation ranges (192.0.2.0/24, 2001:db8::/32) are deliberately absent: they stand in for
# real addresses in examples, and a canary may use them.
_SAFE_NETS = [
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
        "169.254.0.0/16", "255.255.255.255/32", "::/128", "::1/128", "fe80::/10", "fc00::/7",
    )
]  # fmt: skip
_IPV4ISH = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?:/\d{1,2})?(?![\w.])")
_IPV6ISH = re.compile(
    r"(?<![\w:])(?:\[?::1?\]?|f[cde][0-9a-f]{0,2}:[0-9a-f:]*|fe80::[0-9a-f:%\w]*)(?:/\d{1,3})?(?![\w:])", re.I
)
_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_INTEGRITY = re.compile(r"(?i)\b(?:sha(?:1|224|256|384|512)|md5|h1|blake2b?)[-:][A-Za-z0-9+/_=\-]{12,}")
_HASH_WORD = re.compile(
    r"(?i)(?:sha\d*|md5|hash(?:es)?|digest|checksum|commit|fingerprint|etag|revision|\brev\b|tree|parent|"
    r"blob|object|hexdigest|e\.g\.|\bid\b)\W{0,12}$"
)
_HEX_RUN = re.compile(r"(?<![\w])[0-9a-f]{7,128}(?![\w])|(?<![\w])[0-9A-F]{32,128}(?![\w])")
_GIT_SHORT = re.compile(r"(?m)^[*|\\/ ]*([0-9a-f]{7,12})\b(?= )")
_URL_HASH = re.compile(r"[#/\-][0-9a-f]{7,64}\b")
_VERSION = re.compile(r"(?<![\w.])v?\d+(?:\.\d+){1,3}(?:[-+.][0-9A-Za-z.\-]+)?(?![\w])")
_VERSION_CUE = re.compile(
    r"(?i)(?:\bv|version|release|build|upgrade|from|to|python|node|kernel|cuda|driver|chrome|firefox|"
    r"safari|ubuntu|openssl|lts|==|>=|<=|~=|\^|@|[\[(])\W{0,3}$"
)
# Cues that make a four-part dotted number a version even where it parses as an IPv4 address
# ("from" / "to" do not: "connect to 10.1.2.3" is an address).
_STRONG_VERSION_CUE = re.compile(
    r"(?i)(?:\bv|\bversion|\bversions|\brelease|\bbuild|\bupgrade|==|>=|<=|~=|\^)\W{0,3}$"
)
_ID_NEAR = re.compile(
    r"(?i)\bbsn|burgerservice|sofinummer|\bid\b|identi|national|citizen|personal|nummer|number"
)
# Dotted digit groups that are someone's number, not a version: a French phone (06.12.34.56.78),
# a Swiss AHV number (756.1234.5678.97), a Chilean RUT (12.345.678-5).
_DOTTED_ID = re.compile(r"\d{2}(?:\.\d{2}){4}|756\.\d{4}\.\d{4}\.\d{2}|\d{1,2}\.\d{3}\.\d{3}-[\dkK]")
_DECIMAL = re.compile(r"(?<![\d.])\d+\.\d{4,}(?:[eE][+\-]?\d+)?(?![\d.])")
_MATH_HINT = re.compile(
    r"(?i)\bhow (?:many|much|long|far)\b|\bsolve\b|\bcalculate\b|\bcompute\b|\bfind x\b|\bwhat is \d|"
    r"\bpercent(?:age)?\b|\baltogether\b|\bin total\b|\bremaining\b|\bleft\?|\bcost\b|"
    r"\bper (?:hour|day|week)\b"
)
# Words that make a number in a word problem personal data after all (checked near the number).
_PII_CUE = re.compile(
    r"(?i)phone|\btel\b|mobile|\bcell\b|\bcall\b|whatsapp|\bfax\b|ssn|social security|passport|licen[cs]e|"
    r"\bid\b|identity|iban|account|\bcard\b|post ?code|\bzip\b|\bborn\b|birth|\bdob\b|e-?mail|address|"
    r"contact|\bcpf\b|\bbsn\b|pesel|\bnhs\b|\bsin\b|aadhaar|\btax\b|insurance|patient|mrn|member|customer"
)
_EPONYM_NOUN = (
    r"(?:law|laws|effect|scale|constant|number|equation|theorem|principle|sequence|identity|rule|"
    r"formula|distribution|transform|series|limit|method|algorithm|conjecture|paradox|test|lemma|"
    r"inequality|process|function|model|filter|index)"
)
_EPONYM = re.compile(r"^\s*(?:'s|’s|')?\s+" + _EPONYM_NOUN + r"\b")
# Kinds a recogniser finds from digits alone; the rules' kinds that need a context word
# (dates of birth, postcodes) already have their cue.
_NUMERIC_KINDS = {
    "PHONE_NUMBER", "NATIONAL_ID", "US_SSN", "US_ITIN", "US_PASSPORT", "UK_NHS", "MEDICAL_LICENSE",
    "US_BANK_NUMBER",
}  # fmt: skip


def _safe_ip(token: str) -> bool:
    try:
        net = ipaddress.ip_network(token.strip("[]").split("%")[0], strict=False)
    except ValueError:
        return False
    return any(net.version == s.version and net.subnet_of(s) for s in _SAFE_NETS)


def _looks_like_ipv4(token: str) -> bool:
    try:
        ipaddress.ip_network(token, strict=False)
        return True
    except ValueError:
        return False


def protected(text: str) -> list[tuple[int, int]]:
    """Character ranges of `text` that no PII span may touch."""
    out: list[tuple[int, int]] = []
    for rx in (_IPV4ISH, _IPV6ISH):
        out += [m.span() for m in rx.finditer(text) if _safe_ip(m.group(0))]
    out += [m.span() for m in _UUID.finditer(text)]
    out += [m.span() for m in _INTEGRITY.finditer(text)]
    out += [m.span(1) for m in _GIT_SHORT.finditer(text)]
    out += [
        m.span()
        for m in _URL_HASH.finditer(text)
        if re.search(r"\.(?:tgz|tar|zip|git)\b|#", text[: m.start() + 1][-60:])
    ]
    for m in _HEX_RUN.finditer(text):
        tok = m.group(0)
        if (
            any(c.isdigit() for c in tok)
            and any(c.isalpha() for c in tok)
            and _HASH_WORD.search(text, max(0, m.start() - 40), m.start())
        ):
            out.append(m.span())
    for m in _VERSION.finditer(text):
        tok = m.group(0)
        if re.fullmatch(r"\d{3}\.\d{3}\.\d{4}", tok):  # a phone number written with dots
            continue
        if re.match(r"/\d{4}-\d{2}\b", text[m.end() : m.end() + 8]):  # a CNPJ: 11.222.333/0001-81
            continue
        if (
            tok.count(".") == 3
            and _looks_like_ipv4(tok)
            and not _STRONG_VERSION_CUE.search(text, max(0, m.start() - 24), m.start())
        ):  # addresses are judged as addresses; "version 1.2.3.4" is a version
            continue
        if re.fullmatch(r"\d{1,2}\.\d{1,2}\.(?:19|20)?\d{2}", tok):  # a date, judged as a date
            continue
        if all(
            len(c) >= 3 for c in tok.split("-")[0].split(".")
        ):  # 201.144.060-22: an ID's groups, not a version
            continue
        if _ID_NEAR.search(text, max(0, m.start() - 40), m.start()):  # "BSN 1384.14.890": an id
            continue
        if dotted_identifier(tok) or (
            sum(c.isdigit() for c in tok) >= 7 and _PII_CUE.search(text, max(0, m.start() - 40), m.start())
        ):  # "tel. 06.12.34.56.78", "AHV 756.1234.5678.97"
            continue
        if (
            tok.count(".") >= 2
            or tok.startswith("v")
            or _VERSION_CUE.search(text, max(0, m.start() - 24), m.start())
        ):
            out.append(m.span())
    out += [m.span() for m in _DECIMAL.finditer(text)]
    return out


def dotted_identifier(token: str) -> bool:
    """A dotted run of digit groups shaped like a phone number or a national id, not a version."""
    return _DOTTED_ID.fullmatch(token) is not None


def _mathy(text: str) -> bool:
    """A word problem: a math hint, or a question with two or more numbers in it."""
    if _MATH_HINT.search(text):
        return True
    # Two numbers with words between them: a phone number's digit groups are not two numbers.
    return "?" in text and bool(re.search(r"\d[\d.,]*\s+[^\W\d_]{2,}(?:\s+[^\W\d_]+)*\s+\$?\d", text))


def _cued(span: Span, text: str) -> bool:
    return bool(_PII_CUE.search(text, max(0, span.start - 48), min(len(text), span.end + 24)))


def keep(span: Span, text: str, regions: list[tuple[int, int]]) -> bool:
    """False for a detection that is not personal data (see the module doc)."""
    value = text[span.start : span.end]
    if any(a < span.end and span.start < b for a, b in regions):
        # An e-mail, a name, a coordinate pair or a wallet is never inside a hash or a version.
        return span.entity in {"EMAIL_ADDRESS", "PERSON", "LOCATION_GPS", "CRYPTO"}
    if span.entity == "IP_ADDRESS" and _safe_ip(value):
        return False
    if span.entity == "PHONE_NUMBER":
        digits = re.sub(r"\D", "", value)
        if re.search(r"\d{4}-\d{2}-\d{2}|\]", value) or re.match(
            r"^(?:1?555\d{4}|1?\d{3}555\d{4}|555\d{4})$", digits
        ):
            return False  # a changelog date, a fictional 555 number
    if span.entity == "PERSON" and _EPONYM.match(text[span.end : span.end + 30]) and len(value.split()) == 1:
        return False
    formatted = re.search(r"\d[\-.()]\d|\(\d|^\+", value)  # 404-512-3130, (212) 524: a phone's shape is a cue
    if span.entity in _NUMERIC_KINDS and not formatted and _mathy(text) and not _cued(span, text):
        return False
    return True


# What makes a lone name someone's: a cue right before it (an introduction, a greeting, a label,
# a title, someone in the writer's life such as "my colleague", a sign-off line) or right after
# it ("Anna here").
_NAME_CUE_BEFORE = re.compile(
    r"(?i)(?:\bmy\s+name(?:\s+is|'s|’s)|(?:\b|_)name\b\W{0,3}[:=]|\bi\s+am|\bi['’]m|\bcall\s+me|\bthis\s+is|"
    r"\b(?:dear|hi|hello|hey|thanks|thank\s+you)|\b(?:written|signed|sent|authored|maintained|created)\s+by|"
    r"\b(?:from|to|cc|author|contact|signed|attn|patient|customer|employee|applicant|recipient|sender)\s*:|"
    r"\b(?:ask\s+for|speak\s+(?:to|with)|behalf\s+of)|"
    r"\b(?:my|our)\s+(?:[a-z\-]+\s+)?(?:friend|colleague|co-?worker|boss|manager|supervisor|assistant|"
    r"wife|husband|partner|son|daughter|mother|mom|mum|father|dad|sister|brother|cousin|aunt|uncle|"
    r"nephew|niece|grand(?:son|daughter|mother|father)|boyfriend|girlfriend|fianc[ée]e?|roommate|"
    r"neighbou?r|landlord|tenant|doctor|dentist|therapist|lawyer|teacher|client|patient|employee)s?,?|"
    r"\b(?:mr|mrs|ms|mx|miss|dr|prof|sir|dame|herr|frau|mme|mlle|sr|sra|srta)\.?|"
    r"\b(?:regards|sincerely|cheers|best(?:\s+wishes)?|yours(?:\s+truly)?|love|thanks)\W{0,2}\n|"
    r"(?:^|\n)\s*(?:--|—|–))[\s,:\"'(]{0,4}\Z"
)
_NAME_CUE_AFTER = re.compile(r"[\s,]{0,2}(?:here|speaking)\b", re.IGNORECASE)


def _lone_uncued(span: Span, text: str) -> bool:
    value = text[span.start : span.end]
    if span.entity != "PERSON" or len(value.split()) != 1 or script_of(value) is not None:
        return False
    before = text[max(0, span.start - 48) : span.start]
    return not (_NAME_CUE_BEFORE.search(before) or _NAME_CUE_AFTER.match(text, span.end))


def lone_names(texts: list[str], spans: list[list[Span]]) -> list[list[Span]]:
    """One record's spans (per text) without its lone given names when nothing else in the record
    is personal: a single Latin-script word tagged as a person, with no name cue at it, in a record
    with no other personal data (no full name, no contact data, no id) names a character in a word
    problem or an instruction. A name after a cue, or in a record that holds anything else
    personal, stays (and so does every recurrence of a full name's parts)."""
    if all(_lone_uncued(s, t) for t, ss in zip(texts, spans, strict=True) for s in ss):
        return [[] for _ in spans]
    return spans


def overlaps(start: int, end: int, regions: list[tuple[int, int]]) -> bool:
    return any(a < end and start < b for a, b in regions)
