"""Issue 33: governance beyond its own corpus — precision on PII-free text, recall on the probe
corpus's two parts, surrogates valid for their kind, keyed quarantine hashes.

The real scrubber (Presidio + spaCy + the rules) and the real `Governor` (re-tokenisation, GX,
filters) run on every record; nothing is mocked.
"""

from __future__ import annotations

import re

import pytest

from tests.pii_free_corpus import pii_free_corpus


def test_pii_free_corpus_is_left_as_written(scrubber):
    corpus = pii_free_corpus()
    results = scrubber.scrub([t for _, t in corpus])
    altered = [(g, t, r) for (g, t), r in zip(corpus, results, strict=True) if r.spans or r.unsure]
    share = len(altered) / len(corpus)
    print(f"PII-free corpus: {len(altered)}/{len(corpus)} altered ({share:.1%})")
    assert share <= 0.03, [(g, [t[s.start : s.end] for s in r.spans], r.unsure) for g, t, r in altered]
    for (group, text), r in zip(corpus, results, strict=True):
        if group == "code":  # not one code line changes
            assert r.text == text, (text, r.spans)
        if group == "math":  # a name may become another name; no number changes
            assert re.findall(r"\d+", r.text) == re.findall(r"\d+", text), (text, r.text)


def test_addresses_hashes_and_versions_are_never_touched(scrubber):
    keep = [
        "127.0.0.1", "0.0.0.0", "::1", "192.168.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "10.244.1.1",
        "sha512-v2kDEe57lecTulaDIuNTPy3Ry4gLGJ6Z1O3vE1krgXZNrsQ+LFTGHVxVjcXPs17LhbZVGedAJv8XZ1tvj5FvSg==",
        "9fceb02d0ae598e95dc970b74767f19372d61af8", "a1b2c3d", "2.4.1", "124.0.6367.91", "2024-05-17",
        "3f0e8a2c-9b1d-4c7e-8f3a-2d6b5e4c1a09", "6.02214076",
    ]  # fmt: skip
    texts = [t for _, t in pii_free_corpus()]
    joined = [t for t in texts if any(k in t for k in keep)]
    for t, r in zip(joined, scrubber.scrub(joined), strict=True):
        for k in keep:
            if k in t:
                assert k in r.text, (k, t, r.text)


def test_four_part_versions_are_versions_and_addresses_stay_addresses(scrubber):
    """A four-part version parses as an IPv4 address too: a version word before it keeps it, and
    "to" / "from" (which also precede addresses) do not."""
    kept = ["Please upgrade to version 1.2.3.4 before Friday.", "pin it: mylib==10.2.3.4 in requirements."]
    for t, r in zip(kept, scrubber.scrub(kept), strict=True):
        assert t == r.text, (t, r.spans)
    gone = ["My home server is at 84.17.203.9, connect to 84.17.203.9 from outside."]
    (r,) = scrubber.scrub(gone)
    assert "84.17.203.9" not in r.text, r.text


def _valid(kind: str, value: str) -> bool:
    """The validator that detects each kind, applied to its surrogate."""
    import ipaddress

    import phonenumbers
    from presidio_analyzer.predefined_recognizers import CryptoRecognizer
    from stdnum import iban, luhn
    from stdnum.br import cpf
    from stdnum.ca import sin
    from stdnum.cn import ric
    from stdnum.es import dni
    from stdnum.it import codicefiscale
    from stdnum.kr import rrn
    from stdnum.nl import bsn
    from stdnum.pl import pesel

    checks = {
        "cpf": cpf.is_valid, "sin": sin.is_valid, "codice_fiscale": codicefiscale.is_valid,
        "bsn": lambda v: bsn.is_valid(v.replace(".", "")), "pesel": pesel.is_valid, "dni": dni.is_valid,
        "ric": ric.is_valid, "rrn": rrn.is_valid, "card": lambda v: luhn.is_valid(re.sub(r"\D", "", v)),
        "iban": iban.is_valid, "phone": lambda v: phonenumbers.is_valid_number(phonenumbers.parse(v)),
        "eth": lambda v: re.fullmatch(r"0x[0-9a-f]{40}", v) is not None,
        "btc": lambda v: v.startswith("bc1") and CryptoRecognizer().validate_result(v),
        "mac": lambda v: re.fullmatch(r"(?:[0-9A-Fa-f]{2}[:\-]){5}[0-9A-Fa-f]{2}", v) is not None,
        "ipv4": lambda v: ipaddress.ip_address(v).is_global,
        "cidr": lambda v: bool(ipaddress.ip_network(v, strict=False)),
        "hex_key": lambda v: re.fullmatch(r"[0-9a-f]{32}", v) is not None,
        "gps": lambda v: abs(float(v.split(",")[0])) <= 90 and abs(float(v.split(",")[1])) <= 180,
    }  # fmt: skip
    return bool(checks[kind](value))


SURROGATE_CASES = [
    ("cpf", "NATIONAL_ID", "201.144.060-22"), ("sin", "NATIONAL_ID", "130 692 544"),
    ("codice_fiscale", "NATIONAL_ID", "RSSMRA85T10A562S"), ("bsn", "NATIONAL_ID", "1112.22.333"),
    ("pesel", "NATIONAL_ID", "84041249565"), ("dni", "NATIONAL_ID", "47680360A"),
    ("ric", "NATIONAL_ID", "11010519491231002X"), ("rrn", "NATIONAL_ID", "971013-9019902"),
    ("card", "CREDIT_CARD", "4539 1488 0343 6467"), ("iban", "IBAN_CODE", "DE89 3704 0044 0532 0130 00"),
    ("phone", "PHONE_NUMBER", "+44 7911 123456"), ("phone", "PHONE_NUMBER", "+49 30 90182736"),
    ("eth", "CRYPTO", "0x52908400098527886e0f7030069857d2e4169ee7"),
    ("btc", "CRYPTO", "bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq"),
    ("mac", "MAC_ADDRESS", "00:1A:2B:3C:4D:5E"),
    ("ipv4", "IP_ADDRESS", "81.2.69.160"), ("cidr", "IP_ADDRESS", "81.2.69.0/24"),
    ("hex_key", "CREDENTIAL", "9f2c4e1a7b3d5f6089a1b2c3d4e5f607"),
    ("gps", "LOCATION_GPS", "52.52437, 13.41053"),
]  # fmt: skip


def test_every_surrogate_passes_its_kinds_validator():
    from adaflash.governance.surrogates import Surrogates, fakers

    fake = fakers(0)
    for seed in range(5):
        for kind, entity, value in SURROGATE_CASES:
            assert _valid(kind, value), (kind, value)  # the case itself is valid
            out = Surrogates(fake, f"record {seed}").surrogate(entity, value)
            assert out != value and _valid(kind, out), (kind, value, out)


def test_name_surrogates_keep_their_script():
    from adaflash.governance.pii_scripts import script_of
    from adaflash.governance.surrogates import Surrogates, fakers

    names = [
        "Иван Петров",
        "王志强",
        "محمد العلي",
        "इन्द्र रंगन",
        "Ευσταθία Καταραχιάς",
        "伊藤さゆり",
        "김민준",
        "יואב כהן",
    ]
    sur = Surrogates(fakers(0), "names")
    for name in names:
        out = sur.surrogate("PERSON", name)
        assert out != name and script_of(out) == script_of(name), (name, out)
        assert len(out.split()) == len(name.split())
    assert script_of(sur.surrogate("PERSON", "Tomasz Wiśniewski")) is None  # Latin stays Latin


def test_street_and_date_surrogates_keep_ordinals_readable():
    """Street "221 W 42nd St" becomes another numbered street ("86th", never "06nd"); house numbers keep
    their length and never start with a zero; a birth date's "3rd of July" becomes "15th of May"."""
    import re

    from adaflash.governance.surrogates import Surrogates, fakers

    months = {"January", "February", "March", "April", "May", "June", "July", "August", "September",
              "October", "November", "December"}  # fmt: skip

    def english(k: int) -> str:
        return "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")

    for seed in range(20):
        sur = Surrogates(fakers(0), f"street {seed}")
        for value in ("221 W 42nd St", "350 5th Avenue", "7 111th Street", "12 23rd St", "1600 Main Street"):
            out = sur.surrogate("STREET_ADDRESS", value)
            assert out != value, value
            for n, suffix in re.findall(r"\b(\d+)(st|nd|rd|th)\b", out):
                assert suffix == english(int(n)) and not n.startswith("0"), (value, out)
            house = out.split()[0]
            assert house.isdigit() and len(house) == len(value.split()[0]) and house[0] != "0", (value, out)
        for value in ("3rd of July 1985", "July 21st, 1990", "born 2nd Sept. 1961"):
            out = sur.surrogate("DATE_OF_BIRTH", value)
            (n, suffix), *_ = re.findall(r"\b(\d+)(st|nd|rd|th)\b", out)
            assert suffix == english(int(n)) and not n.startswith("0"), (value, out)
            words = [w.rstrip(".") for w in re.findall(r"[A-Z][a-z]+\.?", out)]
            assert words and all(w in months or w in {m[:3] for m in months} for w in words), (value, out)


def test_probe_recall_on_both_parts(tmp_path, vocab, scrubber):
    """Both parts of the issue-33 probe corpus through the real governor: >= 99% of records with no
    planted value left outside split-turn placements, >= 95% with them; on the held-back part no
    kind below 90%, and its misses are not printed (nobody tunes against them)."""
    from adaflash.bench.pii_quality import probe_recall
    from adaflash.governance.governor import GovernanceConfig, Governor
    from tests.pii_probe import tuning_probes
    from tests.pii_probe_heldback import heldback_probes

    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov"), vocab, scrubber)
    for part, probes in (("tuning", tuning_probes()), ("heldback", heldback_probes())):
        r = probe_recall(gov, probes, seed=len(part))
        print(part, r["recall"], r["recall_without_split"], r["misses"] if part == "tuning" else "")
        assert r["recall_without_split"] >= 0.99 and r["recall"] >= 0.95, part
        if part == "heldback":  # the acceptance's floor; the tuning part's known miss is printed above
            assert min(r["by_kind"].values()) >= 0.9, {k: v for k, v in r["by_kind"].items() if v < 0.9}


def test_quarantine_hashes_are_keyed_and_rotate_by_config(tmp_path):
    """A plain SHA-256 of a templated prompt with a 9-digit id is brute-forced in minutes; an
    HMAC under a secret key is not, and the key id in each hash lets a rotated key still match."""
    import hashlib

    from adaflash.governance.quarantine import KEY_ENV, KEY_FILE_ENV, KEY_ID_ENV, key_from_env, matches

    text = "My BSN is 111222333, please update my address."
    one, two = "3f9c1e-s3cret-one-b27d", "a81d44-s3cret-two-0c6e"
    k1 = key_from_env({KEY_ENV: one, KEY_ID_ENV: "2026-11"})
    (tmp_path / "key").write_text(two + "\n")  # a mounted Secret's file may end in a newline
    k2 = key_from_env({KEY_FILE_ENV: str(tmp_path / "key"), KEY_ID_ENV: "2026-12"})
    h1, h2 = k1.hash(text), k2.hash(text)
    assert h1.startswith("hmac-sha256:2026-11:") and h2.startswith("hmac-sha256:2026-12:")
    assert hashlib.sha256(text.encode()).hexdigest() not in h1 + h2 and h1[-64:] != h2[-64:]
    assert h1 == key_from_env({KEY_ENV: one, KEY_ID_ENV: "2026-11"}).hash(text)  # stable
    ring = {"2026-11": one.encode(), "2026-12": two.encode()}
    assert matches(text, h1, ring) and matches(text, h2, ring)
    assert not matches(text.replace("111", "112"), h1, ring) and not matches(text, h1, {"2026-11": b"x"})
    eph = key_from_env({})  # no key configured: random, never the same twice
    assert eph.key_id.startswith("ephemeral-") and eph.hash(text) != key_from_env({}).hash(text)


def test_a_required_missing_unreadable_or_short_hash_key_stops_governance_at_start(
    tmp_path, vocab, scrubber, monkeypatch, caplog
):
    """The cluster sets ADAFLASH_QUARANTINE_HASH_KEY_REQUIRED (manifests/base/governance.yaml): a
    Governor is then not built without a key. A configured key that cannot be used stops it
    everywhere; with no key and no requirement it starts, saying so once."""
    from adaflash.governance import quarantine as q
    from adaflash.governance.governor import GovernanceConfig, Governor

    (tmp_path / "empty").write_text("\n")
    (tmp_path / "short").write_text("changeme")
    bad = [
        {q.REQUIRED_ENV: "true"},
        {q.REQUIRED_ENV: "true", q.KEY_ID_ENV: "2026-12"},  # an id alone is no key
        {q.KEY_FILE_ENV: str(tmp_path / "absent")},
        {q.KEY_FILE_ENV: str(tmp_path / "empty")},
        {q.KEY_FILE_ENV: str(tmp_path / "short")},
        {q.KEY_ENV: "hunter2"},
    ]
    for env in bad:
        with pytest.raises(q.HashKeyError):
            q.key_from_env(env)
    for var in (q.KEY_ENV, q.KEY_FILE_ENV, q.KEY_ID_ENV):
        monkeypatch.delenv(var, raising=False)
    cfg = GovernanceConfig(data_dir=tmp_path / "gov")
    try:
        monkeypatch.setenv(q.REQUIRED_ENV, "true")
        q.process_key.cache_clear()
        with pytest.raises(q.HashKeyError, match="Secret"):
            Governor(cfg, vocab, scrubber)
        assert not (tmp_path / "gov").exists()  # refused before it wrote anything
        monkeypatch.delenv(q.REQUIRED_ENV)
        q.process_key.cache_clear()
        with caplog.at_level("WARNING", logger=q.__name__):
            Governor(cfg, vocab, scrubber).lineage.close()
        assert "random per-process key" in caplog.text  # at start, before any record is quarantined
    finally:
        q.process_key.cache_clear()


DOB_WRITTEN = [
    ("born 14/03/1990", "14/03/1990"), ("DOB: 1990-03-14", "1990-03-14"),
    ("date of birth: 12th of March, 1990", "12th of March, 1990"),
    ("birthday March 14th, 1990", "March 14th, 1990"), ("Geburtsdatum: 14. März 1990", "14. März 1990"),
    ("née le 3 décembre 1982", "3 décembre 1982"),
    ("fecha de nacimiento: 14 de enero de 1990", "14 de enero de 1990"),
    ("data di nascita 3 maggio 1977", "3 maggio 1977"), ("geboortedatum 3 maart 1977", "3 maart 1977"),
    ("生年月日：1990年3月14日", "1990年3月14日"), ("생년월일 1990년 3월 14일", "1990년 3월 14일"),
    ("Дата рождения: 14.03.1990", "14.03.1990"), ('"dob": "1979-08-22"', "1979-08-22"),
    ("data de nascimento: 5 de julho de 1988", "5 de julho de 1988"), ("bday 3/4/90", "3/4/90"),
]  # fmt: skip


def test_one_date_of_birth_rule_for_every_language():
    """A date in any of the common shapes is a date of birth next to a birth word in any of the
    languages, and only there (changelogs, invoices, word problems keep their dates)."""
    from adaflash.governance.pii_dates import dates_of_birth
    from adaflash.governance.pii_rules import second_pass

    for text, date in DOB_WRITTEN:
        hits: list = []
        dates_of_birth(text, hits)
        assert [text[h.start : h.end] for h in hits] == [date], text
        assert [h.entity for h in second_pass(text).hits if h.entity == "DATE_OF_BIRTH"] == ["DATE_OF_BIRTH"]
    for text in ("Release 2024-05-17 shipped", "invoice dated 14/03/1990", "Sep 12, 2020: fixed the build"):
        hits = []
        dates_of_birth(text, hits)
        assert hits == [], text


def test_a_lone_given_name_is_kept_only_where_something_makes_it_someones(scrubber):
    """A word problem's or an instruction's lone first name identifies nobody and is left as the
    target wrote it (with its numbers); the same name after an introduction, a greeting, a label,
    a title or a sign-off, or in a record with other personal data, is replaced, and so is a
    full name anywhere. Function words a tagger takes in ("If Darryl", "When Nathan") are no name."""
    left = [
        "Darryl has twice the books Lamont has. If Darryl has 20 books, how many do they have?",
        "When Nathan is cold, he adds an extra blanket. Each warms him by 3 degrees.",
        "Thomas is very healthy, but he goes to the hospital every day. Why could that be?",
        "Ashley had a birthday party and invited 20 friends. How many came?",
        "It's Yvette's turn to treat her three friends to ice cream sundaes at $7.50 each.",
        "Uncle Joe drove 120 miles at 40 mph. How long did it take?",
        "On a highway, the total number of vehicles passing is 300. How many are trucks?",
        "There are 122 windows total. If 5 rooms have 4 windows, how many rooms are left?",
    ]
    for text, r in zip(left, scrubber.scrub(left), strict=True):
        assert r.text == text and not r.unsure, (text, r.spans)
    replaced = [
        ("My name is Natalia, how many clips should I sell?", ["Natalia"]),
        ("Hi Oluwaseun, the invoice for 48 items is attached.", ["Oluwaseun"]),
        ("Thanks for the help!\nBest,\nIngrid", ["Ingrid"]),
        ('{"first_name": "Ngozi", "age": 41}', ["Ngozi"]),
        ("Can you draft a note to my colleague Oluwaseun about the 3 delays?", ["Oluwaseun"]),
        ("Thomas is very healthy. Reach him at t.kowal@gmail.com, 12 Elm St.", ["Thomas"]),
        ("Natalia Kowalczyk sold 48 clips to her friends.", ["Natalia", "Kowalczyk"]),
    ]
    results = scrubber.scrub([t for t, _ in replaced])
    for (text, gone), r in zip(replaced, results, strict=True):
        assert all(g not in r.text for g in gone), (text, r.text)
        assert re.findall(r"\d+", r.text.split("@")[0]) == re.findall(r"\d+", text.split("@")[0])
    # One record: a full name in the prompt makes its lone first name in the answer someone's too.
    prompt, output = scrubber.scrub(
        ["Please write to Marta Wiśniewska about the 3 refunds.", "Sure. Dear Marta, ..."], groups=[0, 0]
    )
    assert "Marta" not in prompt.text + output.text
