"""The team's PII canary corpus (issue 13): kinds the synthetic traffic generator never plants.

Two parts, written by hand, with different phrasings and different values:
  - `TUNING`: what the scrubber's rules were developed against;
  - `HELDBACK` (in `tests/pii_canaries_heldback.py`): never looked at while tuning; only measured.
Each entry is `(kind, text)` or `(kind, text, extra_secrets)`. In `text`, `⟦...⟧` marks a secret
that must not survive governance, `⟪...⟫` a person name (the whole name and each part of it of
3+ letters must go: "Tomasz <PERSON>" is a leak). Checksummed IDs marked "valid" were generated
with python-stdnum; "bad" ones have a wrong check digit on purpose and only context gives them away.
Recall is record-level: a record counts as caught only if none of its secrets is left at rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_MARK = re.compile(r"⟦(.+?)⟧|⟪(.+?)⟫", re.DOTALL)


@dataclass(frozen=True)
class Canary:
    kind: str
    text: str  # markers removed
    secrets: tuple[str, ...]  # literal strings
    name_parts: tuple[str, ...] = field(default=())  # parts of person names (word-bounded)


def parse(entries) -> list[Canary]:
    out = []
    for e in entries:
        kind, raw, *extra = e
        secrets, parts = [], []
        for m in _MARK.finditer(raw):
            if m.group(1) is not None:
                secrets.append(m.group(1))
            else:
                name = m.group(2)
                secrets.append(name)
                parts += [p for p in re.split(r"[\s\-]+", name) if len(p.strip(".")) >= 3]
        text = _MARK.sub(lambda m: m.group(1) or m.group(2), raw)
        assert secrets, f"entry without a secret: {raw!r}"
        out.append(Canary(kind, text, tuple(secrets + list(extra[0] if extra else [])), tuple(parts)))
    return out


TUNING_ENTRIES = [
    # -- international phone numbers ---------------------------------------------------------------
    ("phone_intl", "Please ring me on ⟦+44 20 7946 0958⟧ after six."),
    ("phone_intl", "Meine Nummer ist ⟦+49 30 90182736⟧, call any time."),
    ("phone_intl", "WhatsApp: ⟦+91 98765 43210⟧ — send the invoice there."),
    ("phone_intl", "The Tokyo office is at ⟦+81 3-5412-7788⟧ if you need them."),
    ("phone_intl", "You can reach our agent at ⟦+55 11 91234-5678⟧ in São Paulo."),
    ("phone_intl", "tel. ⟦0033 1 42 68 53 00⟧ (Paris desk)"),
    # -- national-format phone numbers (no country code) -------------------------------------------
    ("phone_national", "Call my mobile, ⟦07700 900123⟧, if the courier is late."),
    ("phone_national", "Mon portable : ⟦06 12 34 56 78⟧."),
    ("phone_national", "Phone: ⟦030 2345 6789⟧ (Berlin)"),
    ("phone_national", "my cell is ⟦0412 345 678⟧ in Sydney"),
    ("phone_national", "Contact number ⟦(02) 9374 4000⟧, ask for reception."),
    # -- postcodes --------------------------------------------------------------------------------
    ("postcode", "My postcode is ⟦SW1A 2AA⟧, is that in your delivery zone?"),
    ("postcode", "Postal code: ⟦K1A 0B1⟧"),
    ("postcode", "I moved to postcode ⟦EC1A 1BB⟧ last week."),
    ("postcode", "Our zip code is ⟦94103-1742⟧; what is the sales tax?"),
    ("postcode", "PLZ ⟦80331⟧ München, bitte."),
    # -- IBANs, valid and with a bad check -----------------------------------------------------------
    ("iban", "Please refund to ⟦GB44 WFOQ 9664 2510 9720 67⟧."),
    ("iban", "Mon IBAN : ⟦FR29 8460 0938 8868 2241 4475 962⟧"),
    ("iban", "Account ⟦NL92KDCG4916341584⟧ is mine."),
    ("iban", "IBAN ⟦ES58 2421 1422 6209 4081 7715⟧ for the deposit"),
    ("iban", "transfer it to ⟦PL62 9569 9426 8266 0187 0545 3144⟧ please"),
    ("iban_bad_check", "My IBAN is ⟦DE12 5001 0517 0648 4898 90⟧ (typed from the card)."),
    ("iban_bad_check", "Wire to IBAN ⟦IT11 X054 2811 1010 0000 0123 456⟧."),
    # -- US SSN ---------------------------------------------------------------------------------------
    ("us_ssn", "Social security: ⟦536 22 8716⟧"),
    ("us_ssn", "my ssn is ⟦536228716⟧ and my wife's is ⟦412-73-9051⟧"),
    # -- national IDs of several countries (valid checksums) -----------------------------------------
    ("es_dni", "Mi DNI es ⟦47680360A⟧."),
    ("es_dni", "DNI number ⟦09679290Q⟧ for the booking"),
    ("br_cpf", "CPF ⟦201.144.060-22⟧ para a nota fiscal"),
    ("br_cpf", "my Brazilian tax id (CPF) is ⟦27925060832⟧"),
    ("nl_bsn", "BSN: ⟦422901209⟧"),
    ("nl_bsn", "My burgerservicenummer is ⟦406021521⟧."),
    ("pl_pesel", "PESEL ⟦84041249565⟧"),
    ("pl_pesel", "numer PESEL: ⟦83042530603⟧, please update the form"),
    ("de_idnr", "Steuer-ID ⟦78911245130⟧"),
    ("de_idnr", "my German tax ID is ⟦32708659663⟧"),
    ("in_aadhaar", "Aadhaar: ⟦9808 8719 8807⟧"),
    ("in_aadhaar", "my aadhaar number ⟦943347008542⟧ was rejected"),
    ("in_pan", "PAN card ⟦XHAPT8390Z⟧"),
    ("in_pan", "My PAN is ⟦RGKPP2718G⟧."),
    ("ca_sin", "SIN ⟦443-561-873⟧"),
    ("ca_sin", "social insurance number ⟦362 071 102⟧"),
    ("uk_nhs", "NHS number ⟦534 442 3578⟧"),
    ("uk_nino", "National Insurance number: ⟦QQ 12 34 56 C⟧"),
    ("uk_nino", "my NI number is ⟦AB123456D⟧"),
    ("fr_nir", "numéro de sécurité sociale ⟦279097584535565⟧"),
    ("it_cf", "Codice fiscale: ⟦LVVLSP68A16H501D⟧"),
    ("cn_ric", "身份证 ID card number ⟦11010519950410959X⟧"),
    ("se_pnr", "personnummer ⟦810114-7752⟧"),
    ("fi_hetu", "henkilötunnus ⟦110380-790M⟧"),
    ("za_id", "SA ID number ⟦9704185832084⟧"),
    ("dk_cpr", "CPR-nummer ⟦140580-1888⟧"),
    ("au_tfn", "tax file number ⟦736 545 942⟧"),
    # -- national IDs with a wrong check digit: context words must catch them ------------------------
    ("national_id_bad_check", "My ID number is ⟦4804124956⟧ — the clerk typed it wrong?"),
    ("national_id_bad_check", "passport no. ⟦X1234567⟧ expires next May"),
    ("national_id_bad_check", "Passport: ⟦C01X00T47⟧"),
    ("national_id_bad_check", "DNI ⟦47680360B⟧ (check letter may be off)"),
    ("national_id_bad_check", "driver's licence ⟦SMITH 710238 J99⟧"),
    ("national_id_bad_check", "employee id: ⟦EMP-0048213⟧, badge lost"),
    # -- e-mails, plain and obfuscated --------------------------------------------------------------
    ("email", "Write to ⟦ana.lucia+orders@correo.com.br⟧ with the receipt."),
    ("email", "cc: ⟦k.tanaka@mail.tokyo-u.ac.jp⟧"),
    ("email", "my address: ⟦o_adebayo99@yahoo.co.uk⟧"),
    ("email_obfuscated", "email me: ⟦john dot smith at gmail dot com⟧"),
    ("email_obfuscated", "contact ⟦jsmith [at] example [dot] org⟧ for access", ["jsmith"]),
    ("email_obfuscated", "⟦m.rossi(at)unibo(dot)it⟧ — write in Italian please"),
    ("email_obfuscated", "send it to ⟦priya AT raghunathan DOT in⟧", ["raghunathan"]),
    ("email_obfuscated", "reach me at ⟦wei.zhang {at} qq {dot} com⟧"),
    ("email_obfuscated", "⟦lars_eriksson @ telia . se⟧ is my work address"),
    # -- contact handles / URLs with a user part ---------------------------------------------------------
    ("contact_url", "my profile: https://www.linkedin.com/in/⟦tomasz-wisniewski-83a1b2⟧"),
    ("contact_url", "see https://github.com/⟦okonjo-ngozi⟧ for my repos"),
    ("contact_url", "ftp://⟦hkaur⟧:⟦Blue-Otter-77⟧@files.example.net/upload"),
    ("contact_url", "My Skype is ⟦live:siddharth.venkat_1⟧"),
    # -- names, many cultures, alone ------------------------------------------------------------
    ("name", "⟪Nguyễn Thị Minh Khai⟫ asked about the refund."),
    ("name", "Please forward this to ⟪Oluwaseun Adebayo⟫."),
    ("name", "⟪Siddharth Venkataraman⟫ and ⟪Aigerim Nurlanovna⟫ will join the call."),
    ("name", "The account belongs to ⟪Tomasz Wiśniewski⟫."),
    ("name", "⟪Mehmet Yılmaz⟫ reported the bug yesterday."),
    ("name", "Is ⟪Xochitl Huerta⟫ on the list?"),
    ("name", "I spoke with ⟪Bjørn Østergaard⟫ this morning."),
    ("name", "⟪Fatima Al-Zahrani⟫ approved the budget."),
    # -- names with titles ---------------------------------------------------------------------------------
    ("name_title", "Dr. ⟪Kwame Mensah⟫ will review your file."),
    ("name_title", "Prof. ⟪Ingrid Johansson⟫ teaches the course."),
    ("name_title", "Mrs ⟪Priya Raghunathan⟫ called twice."),
    ("name_title", "Herr ⟪Jürgen Schmidt⟫ ist nicht im Büro."),
    ("name_title", "Mme ⟪Élodie Marchand⟫ a répondu."),
    ("name_title", "Sr. ⟪Alejandro Gutiérrez⟫ firmó el contrato."),
    # -- names in code comments, docstrings and commit-style headers ------------------------------
    ("name_code_comment", "# Author: ⟪Tomasz Wiśniewski⟫\ndef parse(x):\n    return x.strip()"),
    ("name_code_comment", "// maintained by ⟪Keiko Tanaka⟫ — do not edit\nint main() { return 0; }"),
    ("name_code_comment", "x = load()  # ask ⟪Chidi Okeke⟫ before changing this"),
    (
        "name_docstring",
        'def area(r):\n    """Circle area.\n\n    Written by ⟪Olumide Bakare⟫, 2021.\n    """\n'
        "    return 3.14159 * r * r",
    ),
    ("name_docstring", '"""Utilities for the billing job.\n\nContact: ⟪Svetlana Kuznetsova⟫\n"""'),
    ("name_commit", "Signed-off-by: ⟪Ana Lúcia Ferreira⟫ <⟦ana.ferreira@unicamp.br⟧>"),
    ("name_commit", "Co-authored-by: ⟪Rahul Deshpande⟫ <⟦rahul.d@infosys.example⟧>"),
    (
        "name_commit",
        "commit 3f2a9c1\nAuthor: ⟪Magdalena Nowak⟫ <⟦mnowak@wp.pl⟧>\nDate:   Tue Mar 3 10:12:44 2025",
    ),
    ("name_commit", "Reviewed-by: ⟪Thandiwe Nkosi⟫"),
    # -- dates of birth ------------------------------------------------------------------------------
    ("dob", "DOB: ⟦14/03/1987⟧"),
    ("dob", "I was born on ⟦3 March 1987⟧ in Lagos."),
    ("dob", "date of birth ⟦1987-03-14⟧, please verify"),
    ("dob", "Geburtsdatum: ⟦07.11.1962⟧"),
    ("dob", "birthday ⟦June 5th, 1990⟧ — am I eligible?"),
    # -- credentials and API keys -------------------------------------------------------------------
    ("credential", "my password is ⟦Tr0ub4dor&3x⟧, why won't it log in?"),
    ("credential", "login: admin / passwd: ⟦hunter2-Blue!⟧"),
    ("credential", "DATABASE_URL=postgres://app:⟦S3cr3t!Pa55⟧@db.internal:5432/prod"),
    ("credential", "the wifi pass is ⟦correct-horse-battery⟧"),
    ("api_key", "OPENAI_API_KEY=⟦sk-proj-4fGh7KlmN9pQrS2tUvWxYz01AbCdEfGh⟧"),
    (
        "api_key",
        "aws_access_key_id = ⟦AKIAQ3EGRTW7JLMXPA2N⟧\n"
        "aws_secret_access_key = ⟦9dK2vLq8ZxW4pR7tY1uN3mB6cV5hJ0gF2sA8eD4k⟧",
    ),
    ("api_key", "token: ⟦ghp_8Hk2LmQ9vXcR4tYpB7nWz1sD3fG6jK0aE5uI⟧"),
    ("api_key", "slack bot ⟦xoxb-2847561038-9274610385-Qw7ErTyUiOpAsDfGhJkLzXcV⟧"),
    (
        "api_key",
        "headers = {'Authorization': "
        "'Bearer ⟦eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiI0MjEifQ.Xk3vR9pLm2QwZt7Yb1NcD8fH4jK6sA0eU5gV2iO⟧'}",
    ),
    ("api_key", "GOOGLE_MAPS_KEY='⟦AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY⟧'"),
    (
        "api_key",
        "-----BEGIN RSA PRIVATE KEY-----\n⟦MIIEpAIBAAKCAQEA7bq9Xk3vR9pLm2QwZt7Yb1NcD8fH4jK6sA0eU5gV2iO⟧\n"
        "-----END RSA PRIVATE KEY-----",
    ),
    # -- addresses ----------------------------------------------------------------------------------
    ("address", "Deliver to ⟦Hauptstraße 12, 10115 Berlin⟧."),
    ("address", "I live at ⟦221B Baker Street, London NW1 6XE⟧."),
    ("address", "Adresse : ⟦12 rue de la Paix, 75002 Paris⟧"),
    ("address", "ship to ⟦Calle Mayor 5, 28013 Madrid⟧"),
    ("address", "my flat is at ⟦Via Roma 10, 00184 Roma⟧"),
    ("address", "⟦4-2-8 Shibakoen, Minato-ku, Tokyo 105-0011⟧ is the office"),
    ("address", "Home: ⟦1428 Elm St Apt 3B⟧, Springfield"),
    # -- PII split across lines or JSON fields ------------------------------------------------------
    ("split_lines", "First name: ⟪Ngozi⟫\nLast name: ⟪Okonjo-Iweala⟫\nPlease confirm."),
    ("split_lines", "Card number:\n⟦4539 1488⟧\n⟦0343 6467⟧\nexpiry 04/27"),
    ("split_lines", "Name:\n⟪Dmitri Volkov⟫\nPhone:\n⟦+7 495 123-45-67⟧"),
    ("json_fields", '{"first_name": "⟪Ngozi⟫", "last_name": "⟪Okonkwo⟫", "phone": "⟦+234 803 123 4567⟧"}'),
    ("json_fields", '{"user": {"name": "⟪Hiroshi Yamamoto⟫", "email": "⟦h.yamamoto@softbank.example⟧"}}'),
    (
        "json_fields",
        '{"customer": "⟪Sofía Castillo⟫", "dob": "⟦1979-08-22⟧", "iban": "⟦ES19 0447 8088 9480 0257 0463⟧"}',
    ),
    ("json_fields", "name,phone\n⟪Aarav Mehta⟫,⟦+91 99876 54321⟧"),
    # -- PII inside code strings --------------------------------------------------------------------
    ("code_string", 'user = User(name="⟪Bartholomew Okafor⟫", email="⟦b.okafor@gtbank.example⟧")'),
    ("code_string", "conn = psycopg2.connect(host='10.0.0.5', user='etl', password='⟦Vx9#kq2LmZ⟧')"),
    ("code_string", 'assert lookup("⟦+33 6 12 34 56 78⟧") == "⟪Camille Lefèvre⟫"'),
    ("code_string", 'API_TOKEN = "⟦a8F3kL9qZ2xW7vB4nM1pR6tY0uC5hJ3e⟧"'),
    ("code_string", "send_sms(to='⟦+44 7911 123456⟧', body='Your code is 4821')"),
    # -- credit cards in unusual formats --------------------------------------------------------------
    ("credit_card", "Amex ⟦3714 496353 98431⟧, exp 09/26"),
    ("credit_card", "card: ⟦5500.0055.5555.5559⟧"),
    # -- IPv6 / MAC -------------------------------------------------------------------------------
    ("ip", "my home router is ⟦2a02:8071:2b84:4f00:1d4c:9e2f:a1b3:77c2⟧"),
    # -- hidden by invisible or lookalike characters (a probe's finds; pii_normalise) --------------
    ("hidden_chars", "Call me on ⟦+33\u202f6\u202f12\u202f34\u202f56\u202f78⟧ tonight"),
    ("hidden_chars", "my card is ⟦4539\u00a01488\u00a00343\u00a06467⟧"),
    ("hidden_chars", "card ⟦4539\u200b1488\u200b0343\u200b6467⟧ exp 04/27"),
    ("hidden_chars", "card number ⟦4539\u00ad1488\u00ad0343\u00ad6467⟧"),
    ("hidden_chars", "téléphone : ⟦０６１２３４５６７８⟧"),
    ("hidden_chars", '{"tool": "send_email", "args": {"to": "⟦camille.lefevre\\u0040orange.fr⟧"}}'),
    # -- dotted numbers that are not versions --------------------------------------------------------
    ("dotted_id", "mon portable: ⟦06.12.34.56.78⟧"),
    ("dotted_id", "AHV-Nummer ⟦756.1234.5678.97⟧"),
    ("dotted_id", "my RUT is ⟦12.345.678-5⟧"),
    # -- more national ids ---------------------------------------------------------------------------
    ("national_id_more", "TC kimlik no: ⟦10234567828⟧"),
    ("national_id_more", "CNP ⟦1870315412341⟧"),
    ("national_id_more", "ИНН ⟦7707083893⟧"),
    ("national_id_more", "マイナンバー ⟦123456789018⟧"),
    ("national_id_more", "PPS number ⟦1234567T⟧"),
    ("national_id_more", "CURP: ⟦BADD110313HCMLNS06⟧"),
    ("national_id_more", "his IC is ⟦S1234567D⟧"),
    # -- names in more scripts, and Latin names typed without capitals -------------------------------
    ("script_name_more", "আমার নাম ⟪রবীন্দ্রনাথ ঠাকুর⟫"),
    ("script_name_more", "என் பெயர் ⟪அருண் குமார்⟫"),
    ("script_name_more", "ჩემი სახელია ⟪გიორგი ბერიძე⟫"),
    ("script_name_more", "Իմ անունը ⟪Արամ Խաչատրյան⟫ է"),
    ("script_name_more", "મારું નામ ⟪રાજેશ પટેલ⟫ છે"),
    ("caseless_name", "hi, my name is ⟪john smith⟫ and I need help"),
    ("caseless_name", "MY NAME IS ⟪JOHN SMITH⟫"),
    ("caseless_name", "Regards,\n⟪maria gonzalez⟫"),
    # -- secrets behind prefixed keys and on command lines ----------------------------------------
    ("cli_secret", "MYSQL_ROOT_PASSWORD: ⟦Xk9#mQ2vLp7z⟧"),
    ("cli_secret", "curl -u admin:⟦S3cr3tP4ss⟧ https://api.example.com/v1"),
    ("cli_secret", "sshpass -p '⟦Tr0ub4dor&3⟧' ssh deploy@build01"),
    # -- addresses, dates and places in other shapes ----------------------------------------------
    ("street_numbered", "I live at ⟦350 5th Avenue⟧, New York"),
    ("street_numbered", "ship it to ⟦221 W 42nd St⟧, Apt 4"),
    ("dob_abbrev", "DOB: ⟦14-Mar-1987⟧"),
    ("gps_loose", "I'm at ⟦48.8584 2.2945⟧ right now"),
    ("gps_loose", "coordinates ⟦48.8584°N 2.2945°E⟧"),
    # -- this round's own probe: ids with a context word, webhooks, secrets typed as prose ----------
    ("national_id_more", "Mi RFC es ⟦GODE561231GR8⟧, para la factura."),
    ("national_id_more", "CNPJ do meu MEI: ⟦11.222.333/0001-81⟧"),
    ("national_id_more", "My HKID is ⟦A123456(3)⟧."),
    ("national_id_more", "the VIN on my car is ⟦1HGCM82633A004352⟧"),
    (
        "webhook",
        "post alerts to https://hooks.slack.com/services/⟦T04K2J9QH/B05LM8N2P/q8Zr3VxT1yKp7WmN4sLd2Ffa⟧",
    ),
    ("prose_secret", "my login is ⟦jsmith1984⟧ and my password ⟦hunter2⟧"),
    ("prose_secret", "the wifi password ⟦Blue42sky!⟧ is on the fridge"),
    ("dob_ordinal", "I was born on the ⟦3rd of July 1985⟧."),
]

TUNING = parse(TUNING_ENTRIES)
