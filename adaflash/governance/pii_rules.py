"""The second PII pass, behind Presidio: rules for what a small NER model and US-centric
recognisers miss (issue 13).

Each rule returns character spans of the original text. The pass is deliberately an allow/deny
policy rather than a model:
  - digit runs and ID-shaped tokens are masked next to a context word ("passport", "PESEL",
    "DOB", "call"...), or without one when python-stdnum validates a formatted national ID or
    libphonenumber a phone number; a checksum-valid bare digit run without context is *unsure*
    (the record is quarantined with its text removed);
  - e-mail addresses in any TLD and in obfuscated forms ("john dot smith at gmail dot com"),
    the user part of profile URLs and URL credentials;
  - credentials: key shapes of well-known providers, `password = ...` assignments, PEM blocks and
    high-entropy tokens (detect-secrets-style Shannon entropy + character-class shape);
  - dates next to birth words (`pii_dates.py`), postcodes, street addresses in several countries'
    formats;
  - person names: capitalised runs scored against first/last-name lists of ~80 locales (faker's
    data) and an English word list, names after cues (titles, `Author:`, `Signed-off-by:`, JSON
    name keys, CSV name columns).
Names are then widened over adjacent name-like words and propagated within a record by the
scrubber (`pii.py`), so a name is masked whole when any part of it is caught.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from adaflash.governance.pii_dates import dates_of_birth
from adaflash.governance.pii_guard import dotted_identifier, overlaps, protected
from adaflash.governance.pii_ids import checksum_kind, digits
from adaflash.governance.pii_names import find_names
from adaflash.governance.pii_spans import Hit, SecondPass

# -- context words ---------------------------------------------------------------------------------
_ID_CONTEXT = (
    r"ssn|social\s+security|social\s+insurance|\bsin\b|nino|national\s+insurance|\bni\s+(?:number|no)|"
    r"\bnhs\b|passport|licen[cs]e|driver|\bid\b|\bids\b|identity|identification|citizen|resident|"
    r"member\s*id|employee\s*id|badge|tax\s*(?:id|file|number|no)|\btfn\b|steuer|"
    r"burgerservicenummer|sofinummer|\bbsn\b|pesel|\bdni\b|\bnie\b|\bnif\b|\bcpf\b|\bcpr\b|aadhaar|"
    r"\bpan\b|insee|s[ée]curit[ée]\s+sociale|codice\s+fiscale|personnummer|personnr|f[øo]dselsnummer|"
    r"henkil[öo]tunnus|hetu|rijksregister|身份证|account|acct|\biban\b|bank|routing|sort\s+code|"
    r"\bcard\b|\bcc\b|visa|amex|mastercard|\bmbr\b|policy\s+(?:no|number)|customer\s+(?:no|number)|"
    r"member|patient|mrn|\bcurp\b|kimlik|\bcnp\b|\binn\b|\bpps\b|\bnric\b|\bfin\b|\bahv\b|\bavs\b|"
    r"\brut\b|\brun\b|\brfc\b|\bcnpj\b|\bhkid\b|hong\s+kong\s+id|\bvin\b|vehicle\s+identification|"
    r"my\s*number|паспорт|инн|снилс|личн|удостоверени|マイナンバー|個人番号|"
    r"住民|주민등록|여권|護照|护照|身分"
)
_PHONE_CONTEXT = (
    r"phone|\btel\b|tel\.|telephone|mobile|\bcell\b|whatsapp|\bcall\b|\bring\b|text\s+me|\bfax\b|"
    r"handy|portable|telefon|telefono|telefone|hotline|number's|contact\s+number|\bsms\b|"
    r"\bmob\b|numer|nummer|num[ée]ro|n[úu]mero|телефон|\bтел\b|моб|電話|电话|手机|携帯|전화|휴대폰|"
    r"τηλ|טלפון|هاتف|جوال"
)
_POSTCODE_CONTEXT = (
    r"postcode|post\s+code|postal\s+code|\bzip\b|zip\s*code|\bplz\b|postleitzahl|code\s+postal|"
    r"\bcap\b|\bcep\b"
)
_RE_ID_CTX = re.compile(_ID_CONTEXT, re.IGNORECASE)
_RE_PHONE_CTX = re.compile(_PHONE_CONTEXT, re.IGNORECASE)
_RE_POST_CTX = re.compile(_POSTCODE_CONTEXT, re.IGNORECASE)


def _near(ctx: re.Pattern, text: str, start: int, end: int, before: int = 48, after: int = 24) -> bool:
    return bool(ctx.search(text, max(0, start - before), start)) or bool(
        ctx.search(text, end, min(len(text), end + after))
    )


# -- identifiers: digit runs and ID-shaped tokens -------------------------------------------------------
# A digit-bearing run: optional letter prefix, digits with single separators, optional letter suffix.
_DIGIT_RUN = re.compile(
    r"(?<![\w@/:.\-])(?:[A-Z]{1,4}[ \-]?)?\+?\(?\d[\d \-./()]{3,30}\d(?:[ \-]?[A-Z]{1,2})?(?![\w@/:])"
)
# Upper-case alphanumeric tokens with letters and digits (passports, PAN, codice fiscale, NINO).
_ALNUM_ID = re.compile(r"(?<![\w\-])(?=[A-Z0-9\-]*\d)(?=[A-Z0-9\-]*[A-Z])[A-Z0-9][A-Z0-9\-]{5,24}(?![\w\-])")
_NUMBER_LIKE = re.compile(r"^\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?$|^\d+\.\d{1,3}$|^\d+(?:\.\d+){2,}$")


_SEPARATED = re.compile(r"\d[\-./ ]\d|\d[\-./ ][A-Z]|[A-Z]\d")

_PHONE_REGIONS = (
    "GB",
    "DE",
    "FR",
    "IT",
    "ES",
    "NL",
    "AU",
    "IN",
    "BR",
    "JP",
    "PL",
    "IE",
    "CA",
    "US",
    "ZA",
    "MX",
)


def phone_like(s: str) -> bool:
    import phonenumbers

    raw = s.strip()
    d = digits(raw)
    if not 7 <= len(d) <= 15:
        return False
    try:
        if raw.startswith("+") or raw.startswith("00"):
            n = phonenumbers.parse("+" + d[2:] if raw.startswith("00") else raw, None)
            return phonenumbers.is_possible_number(n)
        if raw.lstrip("(").startswith("0") and len(d) >= 9 and re.search(r"[ \-().]", raw):
            return any(phonenumbers.is_valid_number(phonenumbers.parse(raw, r)) for r in _PHONE_REGIONS)
    except phonenumbers.NumberParseException:
        return False
    return False


def _identifiers(text: str, hits: list[Hit], unsure: list[str], regions: list) -> None:
    for m in _DIGIT_RUN.finditer(text):
        s, e = m.start(), m.end()
        tok = text[s:e].rstrip(" -./(")
        e = s + len(tok)
        if tok.startswith("(") and ")" not in tok:
            s, tok = s + 1, tok[1:]
        lead = re.match(r"[A-Z]{1,4} (?=[+(A-Z0-9])", tok)  # "CPF 201.144.060-22": a word, then the number
        if lead:
            s, tok = s + lead.end(), tok[lead.end() :]
        d = digits(tok)
        number_like = _NUMBER_LIKE.match(tok) and not dotted_identifier(tok)
        if len(d) < 5 or number_like or "\n" in tok or overlaps(s, e, regions):
            continue
        quantity = len(set(d)) <= 2 or d.endswith("0000")  # 331000000, 9999999999: not an identifier
        if quantity:
            continue
        if phone_like(tok) or (len(d) >= 7 and _near(_RE_PHONE_CTX, text, s, e)):
            hits.append(Hit(s, e, "PHONE_NUMBER"))
            continue
        if len(d) >= 6 and _near(_RE_ID_CTX, text, s, e):
            hits.append(Hit(s, e, "NATIONAL_ID"))
            continue
        if _near(_RE_POST_CTX, text, s, e, 32, 0) and len(d) <= 9:
            hits.append(Hit(s, e, "POSTCODE"))
            continue
        found = checksum_kind(tok) or checksum_kind(tok.replace(" ", ""))
        if found is None or len(d) < 8:
            continue
        kind, strong = found
        if strong or _SEPARATED.search(tok) and kind != "NATIONAL_ID" or (len(d) >= 11 and "-" in tok):
            hits.append(Hit(s, e, kind))
        elif _SEPARATED.search(tok) and kind == "NATIONAL_ID":
            hits.append(Hit(s, e, kind))
        else:
            unsure.append("checksum-valid digit run without context")
    for m in _ALNUM_ID.finditer(text):
        tok = m.group(0)
        if sum(c.isdigit() for c in tok) < 2 or tok.isdigit():
            continue
        found = checksum_kind(tok)
        if found and found[1]:
            hits.append(Hit(m.start(), m.end(), found[0]))
        elif _near(_RE_ID_CTX, text, m.start(), m.end()) and len(tok) >= 6:
            hits.append(Hit(m.start(), m.end(), "NATIONAL_ID"))
    # UK National Insurance numbers, spaced or not: two letters, six digits, one letter.
    for m in re.finditer(r"\b[A-CEGHJ-PR-TW-Z]{2}\s?\d{2}\s?\d{2}\s?\d{2}\s?[A-D]\b", text):
        hits.append(Hit(m.start(), m.end(), "NATIONAL_ID"))
    # "SMITH 710238 J99", "D6101-40706-60905": licence-style groups next to a licence word.
    for m in re.finditer(r"\b[A-Z0-9]{3,6}[ \-][A-Z0-9]{4,6}[ \-][A-Z0-9]{3,6}\b", text):
        head = m.group(0).split()[0].split("-")[0]
        if _RE_ID_CTX.fullmatch(head) or head in {"IBAN", "CARD", "BIC"}:  # "IBAN GB44 WFOQ ...": an IBAN
            continue
        if digits(m.group(0)) and _near(_RE_ID_CTX, text, m.start(), m.end()):
            hits.append(Hit(m.start(), m.end(), "NATIONAL_ID"))


# -- postcodes ----------------------------------------------------------------------------------------
_UK_POSTCODE = re.compile(r"\b(?:[A-Z]{1,2}\d[A-Z\d]?|GIR) ?\d[ABD-HJLNP-UW-Z]{2}\b")
_CA_POSTCODE = re.compile(r"\b[ABCEGHJ-NPRSTVXY]\d[ABCEGHJ-NPRSTV-Z] ?\d[ABCEGHJ-NPRSTV-Z]\d\b")


def _postcodes(text: str, hits: list[Hit]) -> None:
    for rx in (_UK_POSTCODE, _CA_POSTCODE):
        for m in rx.finditer(text):
            tok = m.group(0)
            if " " in tok or _near(_RE_POST_CTX, text, m.start(), m.end(), 40, 0):
                hits.append(Hit(m.start(), m.end(), "POSTCODE"))


# -- addresses ---------------------------------------------------------------------------------------
# Every quantifier below is bounded (a place name is a few words of at most ~40 characters) and
# every pattern that can start inside a word is anchored to the word's start: the work per start
# position is then constant and a scan is linear. An unbounded one is quadratic on one long word
# (issue 32: a 501 KB record holds governance for 352 s).
_CAPW = r"(?:[A-ZÀ-ÖØ-Þ][\w'’.\-]{0,40})"
_CITY_TAIL = (
    r"(?:,?\s+(?:[A-Z]{1,2}\d[A-Z\d]?\s?\d[A-Z]{2}|[A-Z]\d[A-Z]\s?\d[A-Z]\d|[A-Z]{1,2}-)?)?"
    r"(?:,\s*(?:\d{2}-\d{3}|\d{4}-\d{3}|\d{4,5}(?:\s[A-Z]{2})?)?\s*" + _CAPW + r"(?:[ \-]" + _CAPW + r")?"
    r"(?:,?\s+(?:[A-Z]{2}\s+)?(?:[A-Z]{1,2}\d[A-Z\d]?\s?\d[A-Z]{2}|[A-Z]\d[A-Z]\s?\d[A-Z]\d|\d{3}-\d{4}|\d{5}))?)*"
)
_ADDRESS_PATTERNS = [
    # Germanic compounds: "Hauptstraße 12", "Kurfürstendamm 21", "Prinsengracht 263"
    r"(?<![^\W\d_])[A-ZÀ-ÖØ-Þ][^\W\d_]{2,40}?"
    + r"(?:stra(?:ß|ss)e|str\.|weg|gasse|allee|platz|damm|ring|gracht|laan|straat|vej|gatan|gata|veien|vei|"
    r"katu|utca|steeg|kade|plein)" + r"\s+\d+[a-zA-Z]?",
    # Romance and Slavic: "12 rue de la Paix", "Calle Mayor 5", "Via Roma 10", "ul. Marszałkowska 84"
    r"(?<!\d)\d{1,6}[a-zA-Z]?,?\s+(?:rue|avenue|av\.|boulevard|bd|place|chemin|allée|impasse|quai|cours)\s+"
    r"(?:(?:de|du|des|la|le|l'|d')\s*){0,3}" + _CAPW + r"(?:\s+" + _CAPW + r"){0,5}",
    r"(?<![^\W\d_])(?:Calle|C/|Avenida|Avda\.?|Paseo|Plaza|Via|Viale|Piazza|Corso|Largo|Rua|Travessa|Praça|"
    r"ul\.|ulica|al\.|aleja|Carrer|Rúa)\s+"  # a word of its own: "total. If 5 rooms" holds no "al."
    + r"(?:(?:de|del|da|do|dos|la|di|della)\s+){0,3}"
    + _CAPW
    + r"(?:\s+"
    + _CAPW
    + r"){0,5},?\s+\d{1,6}[a-zA-Z]?",
    # English: "221B Baker Street", "77 Queen Street West", "1428 Elm St Apt 3B"
    r"\b\d{1,6}[A-Z]?\s+(?:"
    + _CAPW
    + r"\s+){1,4}(?:Street|St|Avenue|Ave|Road|Rd|Boulevard|Blvd|Lane|Ln|Drive|Dr|Court|Ct|"
    r"Way|Place|Pl|Terrace|Circle|Parkway|Pkwy|Highway|Hwy|Square|Sq|Crescent|Close|Mews|Row|Gardens)\b\.?"
    r"(?:\s+(?:North|South|East|West|N|S|E|W|NE|NW|SE|SW)\b)?(?:,?\s+(?:Apt|Apartment|Suite|Ste|Unit|Flat|#)\.?\s*[\w\-]+)?",
    # Japanese block addresses: "4-2-8 Shibakoen, Minato-ku, Tokyo 105-0011"
    r"\b\d{1,4}(?:-\d{1,4}){1,2}\s+" + _CAPW + r"(?=,\s*" + _CAPW + r"-(?:ku|shi|cho|machi))",
]
_RE_ADDRESS = [re.compile(p + _CITY_TAIL) for p in _ADDRESS_PATTERNS]


def _addresses(text: str, hits: list[Hit]) -> None:
    for rx in _RE_ADDRESS:
        for m in rx.finditer(text):
            hits.append(Hit(m.start(), m.end(), "STREET_ADDRESS"))


# -- e-mail and contact handles ----------------------------------------------------------------------
_EMAIL = re.compile(
    r"(?<![\w.+\-])[\w.+\-]{0,63}\w@[\w\-]+(?:\.[\w\-]+)+"  # any TLD; a local part is <= 64
    r"|(?<![\w.+\-])\w[\w.+\-]{0,63}\s@\s[\w\-]+(?:\s\.\s[\w\-]+)+"  # "lars @ telia . se"
)
_AT = r"(?:\s*[\[({<]\s*at\s*[\])}>]\s*|\s+at\s+|\s+AT\s+|\s*\(@\)\s*)"
_DOT = r"(?:\s*[\[({<]\s*dot\s*[\])}>]\s*|\s+dot\s+|\s+DOT\s+|\.)"
_TLD = (
    r"(?:com|org|net|edu|gov|io|co|uk|de|fr|it|es|ru|cn|jp|in|br|me|se|no|dk|nl|be|ch|at|pl|pt|ie|au|"
    r"ca|mx|ar|za|ng|ke|tr|gr|cz|fi|hu|ro|kr|tw|vn|id|sa|ae|il|info|biz|dev|ai|app|eu|us)"
)
_OBFUSCATED_EMAIL = re.compile(
    r"(?<![\w.+\-])[\w.+\-]{1,64}(?:\s+(?:dot|DOT)\s+[\w\-]{1,64}){0,8}"
    + _AT
    + r"[\w\-]+(?:"
    + _DOT
    + r"[\w\-]+)*"
    + _DOT
    + _TLD
    + r"\b"
)
_PROFILE_URL = re.compile(
    r"(?:https?://)?(?:www\.)?(?:linkedin\.com/in|github\.com|gitlab\.com|twitter\.com|x\.com|instagram\.com|"
    r"facebook\.com|fb\.com|behance\.net|dribbble\.com|medium\.com/@|t\.me|tiktok\.com/@|youtube\.com/@|"
    r"reddit\.com/u(?:ser)?|keybase\.io|mastodon\.social/@)/?([\w.\-]+)"
)
_URL_USERINFO = re.compile(r"(?<![\w+.\-])[a-z][a-z0-9+.\-]{0,30}://([^\s:/@]*)(?::([^\s/@]+))?@")
_SKYPE = re.compile(r"\blive:[\w.\-]+")


def _contacts(text: str, hits: list[Hit]) -> None:
    for m in _EMAIL.finditer(text):
        if re.search(r"://[^\s/@]{0,80}$", text[max(0, m.start() - 90) : m.start()]):
            continue  # the password and host of scheme://user:pass@host, not an e-mail
        hits.append(Hit(m.start(), m.end(), "EMAIL_ADDRESS"))
    for m in _OBFUSCATED_EMAIL.finditer(text):
        hits.append(Hit(m.start(), m.end(), "EMAIL_ADDRESS"))
    for m in _PROFILE_URL.finditer(text):
        user = m.group(1)
        if re.match(r"/[\w.\-]+\s+v\d", text[m.end() : m.end() + 80]):  # a Go module path, not a profile
            continue
        if user and user.lower() not in {
            "login",
            "about",
            "features",
            "pricing",
            "explore",
            "topics",
            "orgs",
            "settings",
        }:
            hits.append(Hit(m.start(1), m.end(1), "USERNAME"))
    for m in _URL_USERINFO.finditer(text):
        if m.group(1):  # redis://:password@host has no user
            hits.append(Hit(m.start(1), m.end(1), "USERNAME"))
        if m.group(2):
            hits.append(Hit(m.start(2), m.end(2), "CREDENTIAL"))
    for m in _SKYPE.finditer(text):
        hits.append(Hit(m.start(), m.end(), "USERNAME"))


# -- credentials and keys --------------------------------------------------------------------------
_KEY_SHAPES = re.compile(
    r"(?<![\w\-])(?:sk-(?:proj-|live-|test-)?[A-Za-z0-9_\-]{16,}|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}|"
    r"AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|"
    r"glpat-[A-Za-z0-9_\-]{20}|xox[abposr]-[A-Za-z0-9\-]{10,}|AIza[A-Za-z0-9_\-]{35}|hf_[A-Za-z]{30,}|"
    r"eyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+|npm_[A-Za-z0-9]{36}|SG\.[\w\-]{16,}\.[\w\-]{16,})"
)
_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----(.*?)(?:-----END [A-Z ]*PRIVATE KEY-----|$)", re.DOTALL)
_SECRET_ASSIGN = re.compile(
    r"(?i:(?<![A-Za-z0-9])(?:password|passwd|passphrase|pwd|pass|secret|api[_\-]?key|apikey|access[_\-]?key|secret[_\-]?key|"
    r"private[_\-]?key|client[_\-]?secret|auth[_\-]?token|token|pin|passcode|passkey|passwort)"
    r"(?:s|\d+|[_\-]\w*|(?-i:[A-Z])\w*)?\b)"  # password2, secret_key, passwordHash; never "passing", "pine"
    r"(?:\s*[\"']?\s*(?:[:=]|=>)\s*|\s+(?:is|was|=)\s+)[\"']?([^\s\"',;)}\]]{4,})"
)
_CLI_PASSWORD = re.compile(
    r"(?:mysql|mysqldump|psql|mongo\w{0,20}|redis-cli)\b[^\n]{0,200}?\s-p([^\s\-][^\s]{3,})"
)
# `curl -u user:pass`, `wget --password=...`, `sshpass -p pass`, `--password pass` on any command line.
_CLI_SECRET = re.compile(
    r"(?:\s(?:-u|--user)\s*['\"]?[^\s:'\"]{1,64}:|\bsshpass\s+-p\s*|"
    r"\s--(?:http-|ftp-|db-|admin-)?pass(?:word)?[= ])['\"]?([^\s'\"]{3,})"
)
# "password hunter2": no separator at all, so the value must hold a digit ("password field" is prose).
_SECRET_SPACED = re.compile(
    r"(?i:\b(?:password|passwd|pwd|passcode|passphrase|passwort|contrase[ñn]a|mot de passe|senha))\s+"
    r"[\"']?((?=[^\s\"',;)}\]]*\d)[^\s\"',;)}\]]{4,})"
)
# A chat user's own account name: "my login is jsmith1984", "my username: k.tanaka".
_OWN_USERNAME = re.compile(
    r"(?i:\bmy\s+(?:user\s?name|login|user\s?id|handle|screen\s?name|gamertag|account\s+name)"
    r"(?:\s+is|\s*[:=]))\s*[\"'@]?([A-Za-z0-9][\w.\-]{2,31})"
)
# Webhook URLs carry their secret in the path.
_WEBHOOK = re.compile(
    r"hooks\.slack\.com/(?:services|workflows)/([\w/]{16,})|discord(?:app)?\.com/api/webhooks/(\d+/[\w\-]{16,})"
)
_AUTH_TUPLE = re.compile(r"auth\s*=\s*\(\s*['\"][^'\"]+['\"]\s*,\s*['\"]([^'\"]{4,})['\"]")
_NOT_SECRET = {
    "required", "incorrect", "invalid", "wrong", "correct", "strong", "weak", "too", "not", "the", "a",
    "an", "your", "empty", "valid", "hashed", "generated", "stored", "saved", "changed", "reset",
    "updated", "missing", "none", "null", "true", "false", "self", "input", "field", "must", "should",
    "will", "and", "for", "with", "length", "hash", "value", "here", "needed", "protected", "manager",
    "expired", "that", "this", "which", "string", "str", "int", "type", "types", "from",
    "into", "used", "uses", "using", "only", "also", "then", "when", "once", "still", "very", "more",
    "less", "has", "have", "are", "can", "cannot", "does", "being", "been", "same", "different",
    "matches", "match", "contains", "policy", "strength", "characters", "check", "checker", "entered",
    "provided", "given", "user", "users", "word", "words", "prompt", "prompts", "confirm", "confirmation",
    "like", "example", "of", "to", "in", "on", "at", "by", "or", "it", "its", "is", "be", "as", "if",
    "number", "numbers", "code", "codes", "key", "keys", "len", "list", "dict", "name",
    "names", "data", "text", "format", "pattern", "regex", "rules", "rule", "generator", "validation",
}  # fmt: skip
_PLACEHOLDER = re.compile(r"(?i)your|example|placeholder|dummy|sample|xxxx|\*\*\*|changeme|<|>|\.\.\.")
_PLACEHOLDER_VALUES = {"password", "secret", "token", "passw0rd", "pass", "pwd", "key", "apikey", "api_key"}
_CODE_VALUE = re.compile(
    r"^[A-Za-z_][\w.]*(?:\(|\[)|^(?:self|os|args|request|config|settings|env|kwargs)\.|^\w+\("
)
_ENTROPY_TOKEN = re.compile(r"(?<![\w/+=\-])[A-Za-z0-9+/=_\-]{16,}(?![\w/+=\-])")


def shannon_entropy(s: str) -> float:
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _classes(s: str) -> int:
    return sum((any(c.islower() for c in s), any(c.isupper() for c in s), any(c.isdigit() for c in s)))


def _credentials(text: str, hits: list[Hit], unsure: list[str], regions: list) -> None:
    for m in _KEY_SHAPES.finditer(text):
        hits.append(Hit(m.start(), m.end(), "CREDENTIAL"))
    for m in _PEM.finditer(text):
        if m.group(1).strip():
            hits.append(Hit(m.start(1), m.end(1), "CREDENTIAL"))
    for rx in (_CLI_PASSWORD, _CLI_SECRET, _AUTH_TUPLE):
        for m in rx.finditer(text):
            hits.append(Hit(m.start(1), m.end(1), "CREDENTIAL"))
    for m in _WEBHOOK.finditer(text):
        g = 1 if m.group(1) else 2
        hits.append(Hit(m.start(g), m.end(g), "CREDENTIAL"))
    for m in _OWN_USERNAME.finditer(text):
        v = m.group(1).rstrip(".")
        if v.lower() not in _NOT_SECRET and not _PLACEHOLDER.search(v):
            hits.append(Hit(m.start(1), m.start(1) + len(v), "USERNAME"))
    for m in (*_SECRET_ASSIGN.finditer(text), *_SECRET_SPACED.finditer(text)):
        v = m.group(1).rstrip(":.!?")
        if v.lower() in _NOT_SECRET or _CODE_VALUE.match(v) or v.startswith(("<", "{", "$", "%", "*")):
            continue
        if _PLACEHOLDER.search(v) or v.lower().strip("'\"") in _PLACEHOLDER_VALUES:
            continue
        if v.isalpha() and v.islower() and len(v) < 8:  # "password is short", "pass it on"
            continue
        if re.fullmatch(r"[a-z]+(?:_[a-z]+)+", v) and "=" in m.group(0):  # password = user_password
            continue
        hits.append(Hit(m.start(1), m.start(1) + len(v), "CREDENTIAL"))
    for m in _ENTROPY_TOKEN.finditer(text):
        tok = m.group(0)
        if _classes(tok) < 3 or overlaps(m.start(), m.end(), regions):
            continue
        ent = shannon_entropy(tok)
        if len(tok) >= 20 and ent >= 3.5 and not re.fullmatch(r"[A-Za-z]+(?:[_\-][A-Za-z]+)*\d*", tok):
            hits.append(Hit(m.start(), m.end(), "CREDENTIAL"))
        elif len(tok) >= 16 and ent >= 3.6 and sum(c.isdigit() for c in tok) >= 3:
            unsure.append("high-entropy token of key-like shape")


def second_pass(text: str, regions: list[tuple[int, int]] | None = None) -> SecondPass:
    """`regions`: what must never be touched (`pii_guard.protected`); doubts inside them are none."""
    regions = protected(text) if regions is None else regions
    hits: list[Hit] = []
    unsure: list[str] = []
    _contacts(text, hits)
    _credentials(text, hits, unsure, regions)
    _identifiers(text, hits, unsure, regions)
    _postcodes(text, hits)
    _addresses(text, hits)
    dates_of_birth(text, hits)
    find_names(text, hits)
    return SecondPass(hits, unsure)
