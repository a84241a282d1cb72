"""The issue-33 canary corpus: kinds, scripts and placements the hand-written corpus
(`tests/pii_canaries.py`) does not have, generated from templates and seeded values.

Two parts with their own templates, values (seeds) and languages:
  - `tuning_probes()` (this file): what the scrubber's issue-33 rules were developed against;
  - `heldback_probes()` (`tests/pii_probe_heldback.py`): written before the rules, never tuned
    on; only measured, its misses are not printed.
A probe is one record: a chat-templated prompt and an output. Placements: `prompt`, `output`,
`both` (the value again in the answer), `history` (an earlier user turn), `json`, `code`,
`split` (a value cut across two user turns), `encoded` (base64 / hex / URL / HTML entities).
Recall is record-level: a probe counts as caught only if none of its secrets is at rest.
"""

from __future__ import annotations

import base64
import html
import json
import random
import string
import urllib.parse
from dataclasses import dataclass, field

from faker import Faker
from stdnum import iban as _iban
from stdnum import luhn
from stdnum.cn import ric
from stdnum.kr import rrn
from stdnum.nl import bsn


@dataclass(frozen=True)
class Probe:
    kind: str
    placement: str
    prompt: str
    output: str
    secrets: tuple[str, ...]
    name_parts: tuple[str, ...] = field(default=())  # parts of names, word-bounded


def chat(*turns: str) -> str:
    """User/assistant turns in SmolLM2's chat template, ending with the assistant's cue."""
    roles = ["user", "assistant"]
    body = "".join(f"<|im_start|>{roles[i % 2]}\n{t}<|im_end|>\n" for i, t in enumerate(turns))
    return body + "<|im_start|>assistant\n"


class Values:
    """Seeded values of every probed kind, each valid for its kind's validator."""

    def __init__(self, seed: int, name_locales: tuple[str, ...]) -> None:
        self.rng = random.Random(seed)
        self.fakers = {loc: Faker(loc) for loc in name_locales}
        for i, f in enumerate(self.fakers.values()):
            f.seed_instance(seed + i)

    def digits(self, n: int) -> str:
        return "".join(self.rng.choice(string.digits) for _ in range(n))

    def plate(self) -> str:
        r, up = self.rng, string.ascii_uppercase
        return r.choice(
            [
                f"{r.choice(up)}{r.choice(up)}{self.digits(2)} {''.join(r.choices(up, k=3))}",  # UK
                f"{r.choice(['B', 'M', 'HH', 'K'])}-{''.join(r.choices(up, k=2))} {r.randint(10, 9999)}",  # DE  # noqa: E501
                f"{''.join(r.choices(up, k=2))}-{self.digits(3)}-{''.join(r.choices(up, k=2))}",  # FR
                f"{r.randint(1, 9)}{''.join(r.choices(up, k=3))}{self.digits(3)}",  # US (CA)
            ]
        )

    def latlon(self) -> tuple[float, float]:
        return round(self.rng.uniform(-60, 65), 5), round(self.rng.uniform(-170, 170), 5)

    def dms(self) -> str:
        lat, lon = self.latlon()

        def one(x: float, pos: str, neg: str) -> str:
            d = abs(x)
            m = (d - int(d)) * 60
            return f"{int(d)}°{int(m)}'{(m - int(m)) * 60:.1f}\"{pos if x >= 0 else neg}"

        return f"{one(lat, 'N', 'S')} {one(lon, 'E', 'W')}"

    def eth(self) -> str:
        return "0x" + "".join(self.rng.choice("0123456789abcdef") for _ in range(40))

    def bsn_dotted(self) -> str:
        while True:
            n = str(self.rng.randint(10000000, 99999999)).zfill(8) + self.digits(1)
            if bsn.is_valid(n):
                return f"{n[:4]}.{n[4:6]}.{n[6:]}"

    def kr_rrn(self) -> str:
        while True:
            n = f"{self.rng.randint(60, 99)}{self.rng.randint(1, 12):02d}{self.rng.randint(1, 28):02d}"
            n += str(self.rng.choice([1, 2])) + self.digits(5)
            for c in "0123456789":
                if rrn.is_valid(n + c):
                    return f"{n[:6]}-{n[6:]}{c}"

    def cn_ric(self) -> str:
        body = (
            f"110105{self.rng.randint(1960, 2000)}{self.rng.randint(1, 12):02d}{self.rng.randint(1, 28):02d}"
        )
        body += self.digits(3)
        return body + ric.calc_check_digit(body + "0")  # stdnum wants a placeholder check digit

    def card(self) -> str:
        body = "4" + self.digits(14)
        n = body + luhn.calc_check_digit(body)
        return " ".join(n[i : i + 4] for i in range(0, 16, 4))

    def iban(self) -> str:
        bban = self.digits(18)
        return _iban.format("DE" + _iban.calc_check_digits("DE00" + bban) + bban)

    def phone(self) -> str:
        return self.rng.choice(
            [
                f"+44 7700 9{self.digits(5)}",
                f"+49 151 {self.digits(8)}",
                f"+33 6 {self.digits(2)} {self.digits(2)} {self.digits(2)} {self.digits(2)}",
            ]
        )

    def email(self) -> str:
        f = next(iter(self.fakers.values()))
        user = f"{self.rng.choice(['kovac', 'eriksen', 'moreau', 'ferreira', 'ozturk'])}.{self.digits(3)}"
        return f"{user}@{self.rng.choice(['posteo.de', 'mail.ee', 'inbox.lv', 'seznam.cz'])}" if f else user

    def hex_key(self, n: int = 32) -> str:
        while True:
            k = "".join(self.rng.choice("0123456789abcdef") for _ in range(n))
            if sum(c.isdigit() for c in k) >= 4 and sum(c.isalpha() for c in k) >= 4:
                return k

    def token(self, n: int = 40) -> str:
        return "".join(self.rng.choice(string.ascii_letters + string.digits) for _ in range(n))

    def password(self) -> str:
        return (
            self.rng.choice(["Tiger", "Amber", "Comet", "Lotus"])
            + self.digits(2)
            + self.rng.choice("!#%&")
            + self.token(5)
        )

    def name(self, locale: str) -> str:
        f = self.fakers[locale]
        return (
            f"{f.last_name()}{f.first_name()}"
            if locale[:2] in ("zh", "ja", "ko")
            else f"{f.first_name()} {f.last_name()}"
        )


def name_parts(name: str) -> tuple[str, ...]:
    parts = tuple(p for p in name.split() if len(p) >= 3)
    return parts if len(name.split()) > 1 else ()


def encode(kind: str, text: str) -> str:
    if kind == "base64":
        return base64.b64encode(text.encode()).decode()
    if kind == "hex":
        return text.encode().hex()
    if kind == "url":
        return urllib.parse.quote(text, safe="")
    return "".join(f"&#{ord(c)};" for c in text)  # HTML decimal entities


def place(
    kind: str,
    placement: str,
    sentence: str,
    value: str,
    *,
    fillers: list[str],
    rng: random.Random,
    extra=(),
    parts=(),
) -> Probe:
    """`sentence` holds `value` once; the probe puts it where `placement` says."""
    filler = rng.choice(fillers)
    secrets = (value, *extra)
    if placement == "prompt":
        return Probe(kind, placement, chat(sentence), filler, secrets, parts)
    if placement == "output":
        return Probe(
            kind, placement, chat("Can you fill in the form for me?"), f"{filler}\n{sentence}", secrets, parts
        )
    if placement == "both":
        return Probe(
            kind, placement, chat(sentence), f"Noted, I will use {value} from now on.", secrets, parts
        )
    if placement == "history":
        return Probe(
            kind,
            placement,
            chat(sentence, "Thanks, noted.", "And what is the next step?"),
            filler,
            secrets,
            parts,
        )
    if placement == "json":
        doc = json.dumps({"ticket": rng.randint(100, 999), "note": sentence}, ensure_ascii=False)
        return Probe(kind, placement, chat(f"Parse this: {doc}"), filler, secrets, parts)
    if placement == "code":
        return Probe(
            kind,
            placement,
            chat(f'Fix the bug:\nrecord = {{"note": "{sentence}"}}\nprint(record)'),
            filler,
            secrets,
            parts,
        )
    if placement == "split":
        cut = len(value) // 2
        head, tail = value[:cut], value[cut:]
        pre = sentence[: sentence.index(value)]
        prompt = chat(f"{pre}{head}", "Go on, the rest is missing.", f"{tail}")
        return Probe(
            kind,
            placement,
            prompt,
            filler,
            tuple(p.strip() for p in (head, tail) if len(p.strip()) >= 4) + tuple(extra),
            parts,
        )
    if placement.startswith("encoded:"):
        enc = encode(placement.split(":", 1)[1], sentence)
        return Probe(kind, placement, chat(f"What does this say? {enc}"), filler, (value, enc, *extra), parts)
    raise ValueError(placement)


TUNING_FILLERS = [
    "Sure, here is how to approach it step by step.",
    "def total(xs):\n    return sum(x for x in xs if x > 0)",
    "The answer is 42. Let me know if anything else is unclear.",
]
# kind -> (value maker, sentence templates); "{v}" is the value.
TUNING_TEMPLATES: dict[str, tuple[str, list[str]]] = {
    "plate": (
        "plate",
        [
            "My car's licence plate is {v}, it was towed.",
            "Kennzeichen {v}, bitte prüfen.",
            "registration {v} got a parking ticket",
        ],
    ),
    "gps_decimal": ("gps", ["I live at {v}, can you deliver there?", "home coordinates: {v}"]),
    "gps_dms": ("dms", ["Our house is at {v}.", "location {v} (my home)"]),
    "gps_geo_uri": ("geo", ["my home pin: {v}", "Send the parcel to {v}"]),
    "gps_map_url": ("map", ["here is my place: {v}", "Directions to my flat: {v}"]),
    "mrn": ("mrn", ["Patient MRN {v}, please pull the chart.", "medical record number: {v}"]),
    "eth_address": ("eth", ["send the ETH to {v}", "my wallet: {v}"]),
    "btc_address": ("btc", ["BTC wallet {v}", "pay to {v} please"]),
    "bsn_dotted": ("bsn", ["Mijn BSN is {v}.", "burgerservicenummer {v}"]),
    "kr_rrn": ("rrn", ["주민등록번호 {v} 입니다", "my resident registration number is {v}"]),
    "cn_ric_cjk": ("ric", ["我的身份证号码是{v}请查收", "身份证号：{v}，谢谢"]),
    "cjk_address": ("cjk_addr", ["我住在{v}。", "住所は{v}です。"]),
    "dob_de": ("dob_de", ["Ich bin am {v} geboren.", "Geburtsdatum: {v}"]),
    "dob_ja": ("dob_ja", ["{v}生まれです。", "生年月日：{v}"]),
    "dob_other": ("dob_other", ["né le {v} à Lyon", "fecha de nacimiento {v}", "дата рождения {v}"]),
    "email_entity": ("email_entity", ["mail me at {v}", "contact: {v}"]),
    "email_fullwidth": ("email_fw", ["メールは{v}です", "my mail {v}"]),
    "api_key_hex": ("hex_key", ["X-Api-Key: {v}", "api key {v} stopped working"]),
    "api_key_generic": ("token", ["MAILGUN_KEY={v}", "my token is {v}"]),
    "url_password": ("redis", ["REDIS_URL={v}", "connect with {v}"]),
    "email": ("email", ["write to {v} please", "my e-mail is {v}"]),
    "phone": ("phone", ["call me on {v}", "my number is {v}"]),
    "card": ("card", ["card number {v}", "charge my card {v}"]),
    "iban": ("iban", ["IBAN {v} for the refund", "my IBAN is {v}"]),
}
NAME_CUES = {
    "ru_RU": ["Меня зовут {v}.", "С уважением, {v}"],
    "zh_CN": ["我叫{v}，请帮我查一下。", "我是{v}。"],
    "ar_AA": ["اسمي {v}", "مع تحياتي، {v}"],
    "hi_IN": ["मेरा नाम {v} है।", "My name is {v}."],
    "el_GR": ["Με λένε {v}.", "Ονομάζομαι {v}."],
    "ja_JP": ["私の名前は{v}です。", "{v}と申します。"],
}


def _value(vals: Values, maker: str) -> tuple[str, tuple[str, ...]]:
    """(value, extra secrets) for a maker name."""
    r = vals.rng
    if maker == "gps":
        lat, lon = vals.latlon()
        return f"{lat}, {lon}", ()
    if maker == "geo":
        lat, lon = vals.latlon()
        return f"geo:{lat},{lon}", ()
    if maker == "map":
        lat, lon = vals.latlon()
        return r.choice(
            [
                f"https://www.google.com/maps/@{lat},{lon},17z",
                f"https://maps.google.com/?q={lat},{lon}",
                f"https://www.openstreetmap.org/?mlat={lat}&mlon={lon}#map=18",
            ]
        ), ()
    if maker == "mrn":
        return r.choice(
            [f"{vals.digits(8)}", f"MRN-{vals.digits(7)}", f"{vals.digits(3)}-{vals.digits(4)}"]
        ), ()
    if maker == "btc":
        return "bc1q" + "".join(r.choice("023456789acdefghjklmnpqrstuvwxyz") for _ in range(38)), ()
    if maker in ("eth", "plate", "dms", "card", "iban", "phone", "email"):
        return getattr(vals, {"bsn": "bsn_dotted"}.get(maker, maker))(), ()
    if maker == "bsn":
        return vals.bsn_dotted(), ()
    if maker == "rrn":
        return vals.kr_rrn(), ()
    if maker == "ric":
        return vals.cn_ric(), ()
    if maker == "cjk_addr":
        return r.choice(
            [
                f"北京市朝阳区建国路{r.randint(1, 200)}号{r.randint(1, 30)}楼",
                f"東京都港区芝公園{r.randint(1, 9)}-{r.randint(1, 20)}-{r.randint(1, 30)}",
                f"上海市浦东新区世纪大道{r.randint(1, 999)}号",
            ]
        ), ()
    y, m, d = r.randint(1950, 2004), r.randint(1, 12), r.randint(1, 28)
    if maker == "dob_de":
        months = [
            "Januar",
            "Februar",
            "März",
            "April",
            "Mai",
            "Juni",
            "Juli",
            "August",
            "September",
            "Oktober",
            "November",
            "Dezember",
        ]
        return r.choice([f"{d}. {months[m - 1]} {y}", f"{d:02d}.{m:02d}.{y}"]), ()
    if maker == "dob_ja":
        return f"{y}年{m}月{d}日", ()
    if maker == "dob_other":
        return r.choice([f"{d:02d}/{m:02d}/{y}", f"{d}.{m:02d}.{y}"]), ()
    if maker == "email_entity":
        e = vals.email()
        return e.replace("@", "&#64;"), (e.split("@")[0],)
    if maker == "email_fw":
        e = vals.email()
        return e.replace("@", "＠"), (e.split("@")[0],)
    if maker == "hex_key":
        return vals.hex_key(), ()
    if maker == "token":
        return vals.token(r.choice([32, 40])), ()
    if maker == "redis":
        pw = vals.password()
        return f"redis://:{pw}@cache.internal:6379/0", (pw,)
    raise ValueError(maker)


def build(seed: int, templates, name_cues, placements, fillers, encodings) -> list[Probe]:
    vals = Values(seed, tuple(name_cues))
    rng = random.Random(seed + 1)
    out = []
    for kind, (maker, sentences) in templates.items():
        for i, where in enumerate(placements):
            value, extra = _value(vals, maker)
            sentence = sentences[i % len(sentences)].format(v=value)
            secret = value if maker not in ("redis",) else extra[0]
            out.append(place(kind, where, sentence, secret, fillers=fillers, rng=rng, extra=extra))
    for loc, sentences in name_cues.items():
        for i, where in enumerate(placements):
            name = vals.name(loc)
            sentence = sentences[i % len(sentences)].format(v=name)
            out.append(
                place(f"name_{loc}", where, sentence, name, fillers=fillers, rng=rng, parts=name_parts(name))
            )
    for maker in ("email", "phone", "card", "iban"):  # a value cut across two user turns
        for _i in range(3):
            value, _ = _value(vals, maker)
            out.append(
                place(f"split_{maker}", "split", f"my {maker} is {value}", value, fillers=fillers, rng=rng)
            )
    for enc in encodings:
        for maker in ("email", "phone"):
            value, _ = _value(vals, maker)
            out.append(
                place(
                    f"encoded_{maker}", f"encoded:{enc}", f"contact {value}", value, fillers=fillers, rng=rng
                )
            )
    return out


TUNING_PLACEMENTS = ["prompt", "output", "both", "history", "json", "code"]


def tuning_probes() -> list[Probe]:
    return build(
        3301, TUNING_TEMPLATES, NAME_CUES, TUNING_PLACEMENTS, TUNING_FILLERS, ["base64", "hex", "url", "html"]
    )


def decoded(text: str) -> str:
    """HTML entities decoded (what a reader of the stored text sees)."""
    return html.unescape(text)
