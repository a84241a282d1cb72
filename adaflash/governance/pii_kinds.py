"""Rules for the kinds an independent probe found leaking (issue 33), part of the second pass:
vehicle plates, GPS coordinates (decimal pairs, DMS, `geo:` URIs, map URLs), medical record
numbers, ETH and bech32 BTC addresses, dotted and CJK-adjacent national ids, Korean RRNs, CJK
addresses, e-mails written with `&#64;` / `＠` / `%40`, hex API keys next to a key word, and names
in non-Latin scripts after a cue in any language. Dates of birth in every language are
`pii_dates.py`'s (the second pass runs it).

Every pattern is bounded (issue 32: a scan must stay linear on one long word).
"""

from __future__ import annotations

import re

from adaflash.governance.pii_guard import overlaps, protected
from adaflash.governance.pii_ids import checksum_kind
from adaflash.governance.pii_rules import phone_like, second_pass
from adaflash.governance.pii_scripts import script_names
from adaflash.governance.pii_spans import Hit

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff00-\uffef"


def _ctx(rx: re.Pattern, text: str, start: int, end: int, before: int = 40, after: int = 16) -> bool:
    return bool(
        rx.search(text, max(0, start - before), start) or rx.search(text, end, min(len(text), end + after))
    )


# -- vehicle plates --------------------------------------------------------------------------------
_PLATE_CTX = re.compile(
    r"(?i)(?:licen[cs]e|number|registration|reg\.?|vehicle|car)\s*plate|\bplate\b|\bplates\b|"
    r"\bregistration\b|\breg\.?\s*(?:no|number)|kennzeichen|immatriculation|\btarga\b|matr[ií]cula|"
    r"kenteken|tablica|номерной знак|車牌|车牌|ナンバー"
)
_PLATE = re.compile(
    r"(?<![\w\-])(?=[A-Z0-9\- ]{0,12}\d)(?=[A-Z0-9\- ]{0,12}[A-Z])"
    r"[A-Z0-9]{1,8}(?:[ \-][A-Z0-9]{1,4}){0,3}(?![\w\-])"
)

# What may stand between the plate word and the plate: "is", "no.", "number", ":", "#".
_PLATE_LEAD = re.compile(r"(?i)[\s:#.\-]*(?:(?:is|was|no\.?|nr\.?|number|num\.?)[\s:#.\-]*){0,2}")


def _plates(text: str, hits: list[Hit]) -> None:
    for m in _PLATE_CTX.finditer(text):
        window = text[m.end() : m.end() + 32]
        p = _PLATE.search(window)
        lead = window[: p.start()] if p else ""
        if p and len(re.sub(r"\W", "", p.group(0))) >= 4 and _PLATE_LEAD.fullmatch(lead):
            hits.append(Hit(m.end() + p.start(), m.end() + p.end(), "VEHICLE_PLATE"))


# -- GPS coordinates ----------------------------------------------------------------------------------
_GEO_CTX = re.compile(
    r"(?i)geo:|maps|@|[?&](?:q|ll|query)=|\blat\b|latitude|coordinates?|\bgps\b|location|lat/lon|"
    r"\b(?:i['’]?m|we['’]?re|i am|we are|live|meet(?: me| us)?|stay(?:ing)?|parked|position|pin)"
    r"\s+(?:at|is)\b"
)
# A pair with a comma, or with only a space (then a context word must say it is a place).
_PAIR = re.compile(r"(?<![\d.])(-?\d{1,2}\.(\d{3,8}))(\s*,\s*|\s+)(-?\d{1,3}\.(\d{3,8}))(?![\d.])")
# Decimal degrees with their hemispheres: "48.8584°N 2.2945°E", "33.86 S, 151.21 E".
_HEMI = re.compile(r"(?<![\d.])\d{1,2}\.\d{1,8}\s?°?\s?[NSns]\b[ ,;/]{0,3}\d{1,3}\.\d{1,8}\s?°?\s?[EWew]\b")
_OSM = re.compile(
    r"mlat=(-?\d{1,2}\.\d{2,8})&(?:amp;)?mlon=(-?\d{1,3}\.\d{2,8})|#map=\d{1,2}/(-?\d{1,2}\.\d{2,8})/(-?\d{1,3}\.\d{2,8})"
)
_DMS_ONE = r"\d{1,3}\s?°\s?\d{1,2}\s?['′]\s?(?:\d{1,2}(?:\.\d{1,4})?\s?(?:\"|″|''))?\s?[NSEWnsew]"
_DMS = re.compile(_DMS_ONE + r"(?:[ ,;]{1,3}" + _DMS_ONE + r")?")


def _coordinates(text: str, hits: list[Hit]) -> None:
    for m in _PAIR.finditer(text):
        lat, lon = float(m.group(1)), float(m.group(4))
        if abs(lat) > 90 or abs(lon) > 180:
            continue
        cued = _ctx(_GEO_CTX, text, m.start(), m.end(), 40, 0)
        precise = min(len(m.group(2)), len(m.group(5))) >= 4 and "," in m.group(3)
        if precise or cued:
            hits.append(Hit(m.start(), m.end(), "LOCATION_GPS"))
    for m in _HEMI.finditer(text):
        hits.append(Hit(m.start(), m.end(), "LOCATION_GPS"))
    for m in _OSM.finditer(text):
        for g in (1, 2, 3, 4):
            if m.group(g):
                hits.append(Hit(m.start(g), m.end(g), "LOCATION_GPS"))
    for m in _DMS.finditer(text):
        hits.append(Hit(m.start(), m.end(), "LOCATION_GPS"))


# -- medical record numbers, crypto addresses, ids ------------------------------------------------------
_MRN = re.compile(
    r"(?i)(?:\bmrn\b|medical\s+record(?:\s+(?:number|no\.?|#))?|(?:patient|chart|record)(?:'s)?\s+(?:record\s+)?"
    r"(?:number|no\.?|#|id))\W{0,4}((?:MRN-?)?[A-Z]{0,3}\d[\d\-]{3,14}\d)"
)
_ETH = re.compile(r"(?<![\w])0x[0-9a-fA-F]{40}(?![\w])")
_BECH32 = re.compile(r"(?<![\w])(?:bc1|tb1|ltc1)[02-9ac-hj-np-z]{11,71}(?![\w])")
_KR_RRN = re.compile(r"(?<!\d)\d{6}-[1-8]\d{6}(?!\d)")
_DOTTED = re.compile(r"(?<![\d.])\d{2,4}\.\d{2,4}\.\d{2,4}(?:\.\d{1,4})?(?!\d|\.\d)")
_CJK_DIGITS = re.compile(
    rf"(?<=[{_CJK}：:])[0-9][0-9 \-]{{4,22}}[0-9Xx]|[0-9][0-9 \-]{{4,22}}[0-9Xx](?=[{_CJK}])"
)
_CJK_ID_CTX = re.compile(
    r"身份证|身份證|证件|號碼|号码|番号|番號|マイナンバー|번호|주민|电话|電話|手机|手機|携帯"
)
_RRN_CTX = re.compile(r"(?i)주민|등록번호|\brrn\b|resident\s+registration")


def _ids(text: str, hits: list[Hit], regions: list) -> None:
    for m in _MRN.finditer(text):
        hits.append(Hit(m.start(1), m.end(1), "MEDICAL_RECORD"))
    for m in _ETH.finditer(text):
        hits.append(Hit(m.start(), m.end(), "CRYPTO"))
    for m in _BECH32.finditer(text):
        hits.append(Hit(m.start(), m.end(), "CRYPTO"))
    for m in _KR_RRN.finditer(text):
        from stdnum.kr import rrn

        if rrn.is_valid(m.group(0)) or _ctx(_RRN_CTX, text, m.start(), m.end()):
            hits.append(Hit(m.start(), m.end(), "NATIONAL_ID"))
    for m in _DOTTED.finditer(text):  # 1234.56.782: a dotted BSN (a version string is protected)
        digits = m.group(0).replace(".", "")
        found = checksum_kind(digits)
        if found and len(digits) >= 8 and not overlaps(m.start(), m.end(), regions):
            hits.append(Hit(m.start(), m.end(), found[0]))
    for m in _CJK_DIGITS.finditer(text):  # glued to CJK text, a \b never fires
        tok = m.group(0).strip()
        found = checksum_kind(tok.replace(" ", "").replace("-", "")) or checksum_kind(tok)
        if found:
            hits.append(Hit(m.start(), m.start() + len(tok), found[0]))
        elif phone_like(tok):
            hits.append(Hit(m.start(), m.start() + len(tok), "PHONE_NUMBER"))
        elif len(re.sub(r"\D", "", tok)) >= 6 and _ctx(_CJK_ID_CTX, text, m.start(), m.end(), 16, 8):
            hits.append(Hit(m.start(), m.start() + len(tok), "NATIONAL_ID"))


# -- CJK addresses ---------------------------------------------------------------------------------------
_CJK_ADDRESS = re.compile(
    r"[\u4e00-\u9fff]{1,6}(?:省|市|都|道|府|県|縣|县)[\u4e00-\u9fff]{0,8}(?:区|區|市|县|縣|町|村|郡)"
    r"[\u4e00-\u9fff\u3040-\u30ff0-9０-９\-－‐]{1,24}(?:号|號|番地|番|丁目|楼|樓|室|[0-9０-９])"
    r"(?:[0-9０-９\-－]{0,8}(?:号|號|楼|樓|室|階))?"
)
_KO_ADDRESS = re.compile(
    r"[\uac00-\ud7af]{1,6}(?:시|도)\s[\uac00-\ud7af]{1,6}(?:구|군|시)\s[\uac00-\ud7af0-9]{1,10}(?:로|길|동)\s?\d{1,4}(?:-\d{1,4})?"
)


def _cjk_addresses(text: str, hits: list[Hit]) -> None:
    for rx in (_CJK_ADDRESS, _KO_ADDRESS):
        for m in rx.finditer(text):
            hits.append(Hit(m.start(), m.end(), "STREET_ADDRESS"))


# -- e-mails written with an entity, a full-width or a percent-encoded @ -----------------------------------
_ODD_EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]{1,64}(?:&#0*64;|&#[xX]0*40;|&commat;|＠|%40|\s?\[@\]\s?)"
    r"[A-Za-z0-9\-]{1,63}(?:(?:\.|．|&#0*46;)[A-Za-z0-9\-]{1,63}){1,4}"
)
_KEY_CTX = re.compile(r"(?i)key|token|secret|passw|bearer|auth|credential|api")
_HEX_KEY = re.compile(r"(?<![\w/+\-])[0-9a-fA-F]{32,64}(?![\w/+=\-])")


def _odd_emails_and_keys(text: str, hits: list[Hit], regions: list) -> None:
    for m in _ODD_EMAIL.finditer(text):
        hits.append(Hit(m.start(), m.end(), "EMAIL_ADDRESS"))
    for m in _HEX_KEY.finditer(text):
        tok = m.group(0)
        mixed = any(c.isdigit() for c in tok) and any(c.isalpha() for c in tok)
        if (
            mixed
            and not overlaps(m.start(), m.end(), regions)
            and _ctx(_KEY_CTX, text, m.start(), m.end(), 32, 0)
        ):
            hits.append(Hit(m.start(), m.end(), "CREDENTIAL"))


def kind_hits(text: str, hits: list[Hit], regions: list) -> None:
    """Append the hits of every rule above (the multilingual names are in `pii_scripts`)."""
    _plates(text, hits)
    _coordinates(text, hits)
    _ids(text, hits, regions)
    _cjk_addresses(text, hits)
    _odd_emails_and_keys(text, hits, regions)
    script_names(text, hits)


def rule_hits(text: str) -> list[Hit]:
    """Every rule-based hit in `text` but name-list guesses: what a decoded run or two joined
    turns are scanned with (no NER: the pieces are short and out of their sentence)."""
    regions = protected(text)
    sp = second_pass(text, regions)
    kind_hits(text, sp.hits, regions)
    return [h for h in sp.hits if h.entity != "PERSON" or h.cue]
