"""Person names in non-Latin scripts (issue 33): Cyrillic, Greek, Arabic/Persian, Hebrew,
Devanagari, Han, Kana, Hangul, Thai, and (found missing by a probe) Bengali, Tamil, Gujarati, Odia,
Sinhala, Georgian, Armenian, Gurmukhi, Telugu, Kannada and Malayalam.

The English spaCy model finds none of them, and no multilingual NER pipeline installs from the
package registry with its weights (spaCy's `xx_ent_wiki_sm` ships only as a GitHub release,
GLiNER downloads its weights from a model hub at run time), so names are found by rules:
  - a cue in the name's language or in English ("Меня зовут", "我叫", "اسمي", "मेरा नाम",
    "Με λένε", "私の名前は", "제 이름은", "קוראים לי", "my name is", "Regards,") followed by a
    name-shaped span of one script: up to three words in a spaced script, up to four Han /
    five Kana characters or three Hangul syllables in an unspaced one;
  - without a cue, two or three words of one spaced script that are all in faker's name lists
    for its locales ("Самсон Бирюков").
`script_of` tells the surrogate generator which faker locale keeps a name in its script.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from adaflash.governance.pii_spans import Hit

# script -> (letters of one name word, faker locales for surrogates)
SCRIPTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cyrillic": ("\u0400-\u04ff", ("ru_RU", "uk_UA", "bg_BG")),
    "greek": ("\u0370-\u03ff\u1f00-\u1fff", ("el_GR",)),
    "arabic": ("\u0600-\u06ff\u0750-\u077f", ("ar_AA", "fa_IR")),
    "hebrew": ("\u0590-\u05ff", ("he_IL",)),
    "devanagari": ("\u0900-\u0963\u0966-\u097f", ("hi_IN", "ne_NP")),  # not the danda "।"
    "thai": ("\u0e00-\u0e7f", ("th_TH",)),
    "han": ("\u4e00-\u9fff\u3400-\u4dbf", ("zh_CN", "zh_TW")),
    "kana": ("\u3040-\u30ff\u4e00-\u9fff", ("ja_JP",)),
    "hangul": ("\uac00-\ud7af", ("ko_KR",)),
    "bengali": ("\u0980-\u09ff", ("bn_BD",)),
    "tamil": ("\u0b80-\u0bff", ("ta_IN",)),
    "gujarati": ("\u0a80-\u0aff", ("gu_IN",)),
    "odia": ("\u0b00-\u0b7f", ("or_IN",)),
    "sinhala": ("\u0d80-\u0dff", ("si_LK",)),
    "georgian": ("\u10a0-\u10ff", ("ka_GE",)),
    "armenian": ("\u0531-\u0587", ("hy_AM",)),  # letters only, not the full stop "։"
    # No faker locale writes these: a surrogate is a Devanagari name (another script, nothing leaks).
    "gurmukhi": ("\u0a00-\u0a7f", ("hi_IN",)),
    "telugu": ("\u0c00-\u0c7f", ("hi_IN",)),
    "kannada": ("\u0c80-\u0cff", ("hi_IN",)),
    "malayalam": ("\u0d00-\u0d7f", ("hi_IN",)),
}
_UNSPACED = {"han": 4, "kana": 5, "hangul": 3, "thai": 0}

# Strong cues introduce a name; weak ones ("I am", "我是", "私は") as often introduce anything else,
# so a name after them must be in the name lists (or start with a CJK surname, or end in a
# name particle such as です / 입니다).
_STRONG = (
    r"[Mm]y name is|[Mm]y name's|[Nn]ame\s*:|[Cc]ontact\s*:|[Ss]igned,?|[Rr]egards,|[Ss]incerely,|[Dd]ear|"
    r"[Mm]r\.?|[Mm]rs\.?|[Mm]s\.?|[Dd]r\.?|"
    r"Меня зовут|Мене звати|Моё имя|Мое имя|Моє ім'я|С уважением,|З повагою,|"
    r"Ονομάζομαι|Με λένε|Το όνομά μου είναι|Με εκτίμηση,|"
    r"اسمي|مع تحياتي،|نام من|با احترام،|קוראים לי|שמי|בברכה,|मेरा नाम|मेरो नाम|भवदीय,|"
    r"我叫|我的名字是|我的名字叫|名字[：:]|姓名[：:]|联系人[：:]|聯絡人[：:]|联络人[：:]|"
    r"私の名前は|名前[：:]|氏名[：:]|제 이름은|이름[：:]|성함[：:]|ฉันชื่อ|ผมชื่อ|"
    r"আমার নাম|என் பெயர்|எனது பெயர்|મારું નામ|મારુ નામ|ମୋ ନାମ|ମୋର ନାମ|මගේ නම|ჩემი სახელია|მე მქვია|"
    r"Իմ անունը|Ինձ անվանում են|ਮੇਰਾ ਨਾਮ|నా పేరు|ನನ್ನ ಹೆಸರು|എന്റെ പേര്"
)
_WEAK = (
    r"I am|I'm|[Tt]his is|[Tt]ell|[Aa]sk|[Ff]orward(?: this)? to|[Ww]ith|[Aa]nd|Передайте(?:, будь ласка,)?|"
    r"Я —|أنا|من|אני|मैं|我是|私は|わたしは|저는|나는|ชื่อ"
)
_CUE = re.compile(r"(?:^|(?<=[\s\"'(\[{,.;:!?，。：、]))(?:(" + _STRONG + r")|" + _WEAK + r")[ \t]*")
# Particles and endings that follow a name in an unspaced script: not part of the name.
_TAIL = re.compile(
    r"(?:です|と申します|と言います|といいます|でございます|입니다|이에요|예요|이라고|라고|님|씨|さん|様|先生|这|這)"
)


def script_of(value: str) -> str | None:
    """The non-Latin script of a name, or None for Latin / mixed text."""
    for name, (letters, _) in SCRIPTS.items():
        if name == "kana":
            if re.search(r"[\u3040-\u30ff]", value):
                return "kana"
            continue
        if re.search(f"[{letters}]", value):
            return name
    return None


def _letters(script: str) -> str:
    return SCRIPTS[script][0]


def _name_after(text: str, pos: int) -> tuple[int, int] | None:
    """The name-shaped span starting at `pos`, or None."""
    head = text[pos : pos + 60]
    script = script_of(head[:1]) if head else None
    if script is None:
        return None
    if script in ("han", "kana") and re.match(r"[\u3040-\u30ff]", head):
        return None  # hiragana right after a cue is grammar ("私は" + "東京に..."), not a name
    letters = _letters(script)
    if script == "han":  # a Japanese name may end in kana ("伊藤さゆり"): read on to the particle
        m = re.match(f"[{_letters('kana')}]{{2,9}}", head)
        tail = _TAIL.search(m.group(0)) if m else None
        if tail and re.search(r"[\u3040-\u30ff]", m.group(0)[: tail.start()]) and 2 <= tail.start() <= 6:
            return pos, pos + tail.start()
    if script in _UNSPACED and _UNSPACED[script]:
        m = re.match(f"[{letters}]{{2,{_UNSPACED[script] + 2}}}", head)
        if not m:
            return None
        run = m.group(0)
        tail = _TAIL.search(run)
        run = run[: tail.start()] if tail else run
        run = run[: _UNSPACED[script]]
        return (pos, pos + len(run)) if len(run) >= 2 else None
    word = f"[{letters}][{letters}\u200c\u200d'’\\-]{{0,30}}"
    m = re.match(f"{word}(?:[ \t]{word}){{0,2}}", head)
    if not m:
        return None
    words = m.group(0).split()
    if script in ("cyrillic", "greek", "armenian"):  # cased scripts: a name word is capitalised
        while words and not words[-1][0].isupper():
            words = words[:-1]
        if not words or not words[0][0].isupper():
            return None
    while len(words) > 1 and words[-1] in _FUNCTION_WORDS:
        words = words[:-1]
    return pos, pos + len(" ".join(words))


# Words of the spaced scripts that end a sentence rather than a name ("नाम X है", "نام من X است").
_FUNCTION_WORDS = {
    "है", "हो", "हूँ", "हुँ", "است", "هستم", "هو", "هي", "и", "і", "та", "και", "ו", "છે", "է", "আছে", "ହେଉଛି",
    "ଅଟେ", "ਹੈ", "ആണ്", "ಆಗಿದೆ",
}  # fmt: skip


@lru_cache(maxsize=1)
def _lexicon() -> frozenset[str]:
    from adaflash.governance.pii_names import name_lexicon

    first, last = name_lexicon()
    return frozenset(w for w in first | last if not w.isascii())


_SPACED_RUN = {
    s: re.compile(
        f"(?<![{SCRIPTS[s][0]}])[{SCRIPTS[s][0]}]{{2,30}}"
        f"(?:[ \t][{SCRIPTS[s][0]}]{{2,30}}){{1,2}}(?![{SCRIPTS[s][0]}])"
    )
    for s in ("cyrillic", "greek", "arabic", "hebrew", "devanagari")
}


# A name before a self-introduction in Japanese: "小川京助と申します".
_POST_CUE = re.compile(
    r"(?<![\u3040-\u30ff\u4e00-\u9fff])([\u4e00-\u9fff][\u3040-\u30ff\u4e00-\u9fff]{1,5}?)"
    r"(?:と申します|と言います|といいます|でございます|と申す)"
)


def script_names(text: str, hits: list[Hit]) -> None:
    if text.isascii():
        return
    for m in _POST_CUE.finditer(text):
        hits.append(Hit(m.start(1), m.end(1), "PERSON"))
    lex = _lexicon()
    for m in _CUE.finditer(text):
        span = _name_after(text, m.end())
        if span and (m.group(1) or _plausible(text, span, lex)):
            hits.append(Hit(span[0], span[1], "PERSON"))
    for rx in _SPACED_RUN.values():
        for m in rx.finditer(text):
            words = m.group(0).split()
            known = sum(unicodedata.normalize("NFC", w) in lex for w in words)
            if known >= 2 or known == len(words):
                hits.append(Hit(m.start(), m.end(), "PERSON"))


@lru_cache(maxsize=1)
def _cjk_surnames() -> frozenset[str]:
    from importlib import import_module

    out: set[str] = set()
    for loc in ("zh_CN", "zh_TW", "ja_JP", "ko_KR"):
        prov = import_module(f"faker.providers.person.{loc}").Provider
        names = prov.last_names
        out.update(names.keys() if isinstance(names, dict) else names)
    return frozenset(out)


def _plausible(text: str, span: tuple[int, int], lex: frozenset[str]) -> bool:
    value = text[span[0] : span[1]]
    if " " in value or script_of(value) not in _UNSPACED:
        return any(unicodedata.normalize("NFC", w) in lex for w in value.split())
    if _TAIL.match(text, span[1]):
        return True
    return any(value.startswith(s) for s in _cjk_surnames())


def non_latin_name(value: str) -> bool:
    return script_of(value) is not None
