"""The held-back part of the issue-33 corpus: other templates, values (another seed), languages
and scripts than `tests/pii_probe.py`'s tuning part. Written before the issue-33 rules and never
tuned on: it is only measured (`tests/test_governance_probe.py`, `adaflash governance bench`),
and its misses are not printed. Add cases to the tuning part instead and keep this file as it is.
"""

from __future__ import annotations

from tests.pii_probe import Probe, build

HELDBACK_FILLERS = [
    "Of course. First, let us restate the problem in plain words.",
    "for i in range(3):\n    print(i)",
    "That should work now; tell me if the error comes back.",
]
HELDBACK_TEMPLATES: dict[str, tuple[str, list[str]]] = {
    "plate": (
        "plate",
        [
            "The van with number plate {v} blocks my driveway.",
            "immatriculation {v}",
            "plate no. {v} — is it stolen?",
        ],
    ),
    "gps_decimal": ("gps", ["pick me up at lat/long {v}", "We are staying at ({v}) this week."]),
    "gps_dms": ("dms", ["coordinates of my cabin: {v}", "GPS {v}"]),
    "gps_geo_uri": ("geo", ['<a href="{v}">our home</a>', "location={v}"]),
    "gps_map_url": ("map", ["I'm here → {v}", "meet me at {v} tonight"]),
    "mrn": ("mrn", ["MRN: {v} (admitted Tuesday)", "the patient's record no. {v}"]),
    "eth_address": ("eth", ["ETH: {v}", "refund the gas to {v}, thanks"]),
    "btc_address": ("btc", ["bitcoin address {v}", "donate: {v}"]),
    "bsn_dotted": ("bsn", ["BSN: {v}", "ons BSN-nummer is {v}"]),
    "kr_rrn": ("rrn", ["RRN {v}", "주민번호는 {v}"]),
    "cn_ric_cjk": ("ric", ["身份证{v}已上传", "请核对身份证号码{v}。"]),
    "cjk_address": ("cjk_addr", ["地址：{v}", "送り先は{v}"]),
    "dob_de": ("dob_de", ["geb. {v}", "Mein Geburtstag ist der {v}."]),
    "dob_ja": ("dob_ja", ["誕生日は{v}です", "生年月日 {v}"]),
    "dob_other": ("dob_other", ["data di nascita: {v}", "geboortedatum {v}", "nascido em {v}"]),
    "email_entity": ("email_entity", ["<p>Email: {v}</p>", "reply-to {v}"]),
    "email_fullwidth": ("email_fw", ["連絡先：{v}", "e-mail {v}"]),
    "api_key_hex": ("hex_key", ["api_key={v}", "Authorization: Token {v}"]),
    "api_key_generic": ("token", ["SENDGRID_TOKEN: {v}", "the secret key {v} leaked"]),
    "url_password": ("redis", ["cache: {v}", "export CACHE_URL='{v}'"]),
    "email": ("email", ["forward it to {v}", "E-Mail-Adresse: {v}"]),
    "phone": ("phone", ["text {v} when you arrive", "Telefon {v}"]),
    "card": ("card", ["visa {v} exp 08/28", "pay with {v}"]),
    "iban": ("iban", ["Bankverbindung {v}", "wire it to {v}"]),
}
HELDBACK_NAME_CUES = {
    "uk_UA": ["Мене звати {v}.", "Передайте, будь ласка, {v}."],
    "zh_TW": ["我的名字是{v}。", "聯絡人：{v}"],
    "fa_IR": ["نام من {v} است", "با احترام، {v}"],
    "ne_NP": ["मेरो नाम {v} हो।", "Signed, {v}"],
    "ko_KR": ["제 이름은 {v}입니다.", "저는 {v}입니다."],
    "he_IL": ["קוראים לי {v}", "Regards, {v}"],
}
HELDBACK_PLACEMENTS = ["output", "history", "both", "code", "prompt", "json"]


def heldback_probes() -> list[Probe]:
    return build(
        90217,
        HELDBACK_TEMPLATES,
        HELDBACK_NAME_CUES,
        HELDBACK_PLACEMENTS,
        HELDBACK_FILLERS,
        ["url", "base64", "html", "hex"],
    )
