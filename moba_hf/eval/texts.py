"""Long texts for haystacks and perplexity: a text file, a directory of them, a `datasets` dataset, or a
generated offline default (deterministic, varied prose-like sentences; no downloads)."""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import re
from pathlib import Path

logger = logging.getLogger("moba_hf")

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")

_SUBJECTS = [
    "The old lighthouse keeper",
    "A young engineer",
    "The village council",
    "Our neighbour's daughter",
    "The travelling musician",
    "A quiet librarian",
    "The harbour master",
    "Every summer visitor",
    "The baker on the corner",
    "A retired sea captain",
    "The school's new teacher",
    "The river ferryman",
    "A curious botanist",
    "The night watchman",
    "The town's only doctor",
    "A wandering painter",
]
_VERBS = [
    "remembered",
    "repaired",
    "described",
    "carried",
    "painted",
    "counted",
    "studied",
    "forgot",
    "borrowed",
    "measured",
    "explained",
    "collected",
    "discovered",
    "planted",
    "sold",
    "wrote about",
]
_OBJECTS = [
    "the broken clock in the square",
    "a basket of winter apples",
    "the map of the northern hills",
    "the letters from the mainland",
    "a lantern with green glass",
    "the recipe for barley bread",
    "the names of the fishing boats",
    "a small wooden boat",
    "the stones along the old wall",
    "the songs of the harvest festival",
    "the rainfall of the last decade",
    "a box of faded photographs",
    "the path through the pine forest",
    "the bells of the chapel",
    "a ledger of forgotten debts",
]
_TAILS = [
    "before the first snow arrived",
    "while the tide was going out",
    "on a grey afternoon in March",
    "long after the market had closed",
    "with more patience than anyone expected",
    "in the week of the storm",
    "as the swallows returned",
    "without telling anyone why",
    "under the light of a paper lamp",
    "while the bread was still warm",
    "just as the ferry left",
    "during the long dry summer",
]
_ASIDES = [
    "Nobody in the valley could say how long this had been going on.",
    "The weather that year was mild, and the roads stayed open until December.",
    "Some said it was a habit inherited from a grandfather who had sailed far to the south.",
    "The children made up a rhyme about it, which they sang on the way to school.",
    "It was the kind of detail that visitors rarely noticed and locals never mentioned.",
    "In the evenings the square filled with people talking about small things.",
]


def generated_text(n_words: int, seed: int = 0) -> str:
    """About `n_words` words of varied, prose-like filler, deterministic in `seed`."""
    rng = random.Random(f"haystack:{seed}")
    sentences: list[str] = []
    words = 0
    while words < n_words:
        if rng.random() < 0.15:
            sentence = rng.choice(_ASIDES)
        else:
            sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        sentences.append(sentence)
        words += sentence.count(" ") + 1
        if rng.random() < 0.12:
            sentences.append("\n\n")
    return " ".join(sentences).replace(" \n\n ", "\n\n")


def load_texts(
    source: str | Path | None = None,
    *,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    column: str = "text",
    max_docs: int | None = None,
    default_words: int = 40_000,
) -> list[str]:
    """Documents from a text file, a directory (its text files, sorted, recursively), a `datasets` dataset
    (`datasets.load_dataset(dataset, dataset_config, split=split)[column]`), or the generated default."""
    if source is not None and dataset is not None:
        raise ValueError(f"give a text source or a dataset, not both: got source={source!r}, dataset={dataset!r}")
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"max_docs must be >= 1 or None, got {max_docs}")
    if dataset is not None:
        import datasets

        data = datasets.load_dataset(dataset, dataset_config, split=split, streaming=max_docs is not None)
        if max_docs is not None:
            data = data.take(max_docs)
        docs = []
        for row in data:
            if column not in row:
                raise ValueError(f"dataset {dataset!r} has no column {column!r}; columns: {sorted(row)}")
            docs.append(str(row[column]))
        return docs
    if source is None:
        return [generated_text(default_words)]
    path = Path(source)
    if path.is_file():
        docs = [path.read_text(errors="replace")]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"directory {path} has no text files (suffixes {', '.join(TEXT_SUFFIXES)})")
        docs = [p.read_text(errors="replace") for p in files]
    else:
        raise FileNotFoundError(f"text source not found: {path} (give a file, a directory or --dataset NAME)")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"text source {path} holds no text")
    return docs[:max_docs] if max_docs else docs


# modules whose docstrings make the offline long text (the sweep's perplexity text, the prose-needle haystack)
STDLIB_MODULES = tuple(
    (
        "argparse collections functools inspect json logging pathlib re typing unittest email http.client "
        "asyncio subprocess threading decimal textwrap"
    ).split()
)

_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|[$%]|[-=*~^]{3,})|^\s{2,}\S")
_PROSE_SENTENCE = re.compile(r"^[A-Z][A-Za-z0-9 ,;:'\"()/\-]+[a-z)][.!?]$")


def stdlib_docstrings() -> list[str]:
    """The docstrings of STDLIB_MODULES, their classes and functions (ships with Python: no download)."""
    import importlib
    import inspect

    parts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for _, obj in inspect.getmembers(module):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == module.__name__:
                parts.append(inspect.getdoc(obj) or "")
    return [p for p in parts if p]


def reference_manual() -> list[str]:
    """The sections of the Python reference manual that pydoc ships (`pydoc_data.topics`; no download)."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Distinct plain-English sentences of Python's reference manual and `stdlib_docstrings()`: paragraphs
    without code lines, split at sentence ends, kept when 6 to 40 words of letters, digits and light
    punctuation. The text depends on the Python version; `prose_digest()` names it."""
    seen: dict[str, None] = {}
    for doc in [*reference_manual(), *stdlib_docstrings()]:
        for paragraph in doc.split("\n\n"):
            if any(_CODE_LINE.match(line) for line in paragraph.splitlines()):
                continue
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.replace("*", "").split())):
                if 6 <= sentence.count(" ") + 1 <= 40 and _PROSE_SENTENCE.match(sentence):
                    seen.setdefault(sentence)
    return tuple(seen)


def prose_digest() -> str:
    return hashlib.sha1("\n".join(prose_sentences()).encode()).hexdigest()[:16]


# modules whose source makes the offline code haystack (ships with Python: no download)
CODE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "heapq", "string", "calendar", "difflib", "csv", "tokenize")


@functools.lru_cache(maxsize=1)
def code_lines() -> tuple[str, ...]:
    """Source lines of CODE_MODULES, blank lines and lines over 100 characters left out, indentation kept. The
    text depends on the Python version; `code_digest()` names it."""
    import importlib
    import inspect

    lines = []
    for name in CODE_MODULES:
        for line in inspect.getsource(importlib.import_module(name)).splitlines():
            if line.strip() and len(line) <= 100:
                lines.append(line.rstrip())
    return tuple(lines)


def code_digest() -> str:
    return hashlib.sha1("\n".join(code_lines()).encode()).hexdigest()[:16]


_ITEM_COLOURS = ("red", "green", "blue", "grey", "white", "black", "yellow", "brown", "orange", "purple")
_ITEM_THINGS = (
    "umbrella",
    "kettle",
    "notebook",
    "scarf",
    "lamp",
    "basket",
    "teapot",
    "ladder",
    "blanket",
    "bucket",
    "hammer",
    "candle",
    "mirror",
    "pillow",
    "shovel",
    "suitcase",
    "bicycle bell",
    "flower vase",
)
_ITEM_PLACES = (
    "top shelf",
    "garden shed",
    "attic",
    "cellar",
    "hall cupboard",
    "kitchen drawer",
    "garage",
    "spare room",
    "back porch",
    "wardrobe",
    "under the stairs",
    "bathroom cabinet",
)
_ITEM_STATES = ("clean", "dusty", "new", "broken", "borrowed", "packed", "on loan", "missing a handle", "wrapped")


def generated_rows(n_rows: int, seed: int = 0) -> list[str]:
    """`n_rows` lines of a household inventory, as bullet items and markdown table rows (no digits, so a number
    in the list stands out as the fact), deterministic in `seed`."""
    rng = random.Random(f"rows:{seed}")
    rows = []
    while len(rows) < n_rows:
        colour, thing = rng.choice(_ITEM_COLOURS), rng.choice(_ITEM_THINGS)
        place, state = rng.choice(_ITEM_PLACES), rng.choice(_ITEM_STATES)
        if rng.random() < 0.5:
            rows.append(f"- {colour} {thing}: {place}, {state}")
        else:
            rows.append(f"| {thing} | {colour} | {place} | {state} |")
    return rows


_LOG_LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN")
_LOG_SERVICES = ("scheduler", "mailer", "auth", "storage", "billing", "search", "gateway", "indexer", "cache")
_LOG_EVENTS = (
    "nightly backup finished for the archive volume",
    "user session refreshed",
    "queue drained, worker idle",
    "retrying upload after a slow response",
    "configuration reloaded from disk",
    "cache entry evicted",
    "health check passed",
    "report generated and sent to the owners",
    "connection pool resized",
    "stale lock released",
    "request served from the replica",
    "password reset mail queued",
    "disk usage above the soft limit",
    "slow query logged for review",
    "certificate still valid",
)


def generated_log(n_lines: int, seed: int = 0) -> list[str]:
    """`n_lines` lines of a service log ("[INFO] storage: cache entry evicted"; no digits, so a number in the
    log stands out as the fact), deterministic in `seed`."""
    rng = random.Random(f"log:{seed}")
    return [
        f"[{rng.choice(_LOG_LEVELS)}] {rng.choice(_LOG_SERVICES)}: {rng.choice(_LOG_EVENTS)}" for _ in range(n_lines)
    ]


_CHAT_PEOPLE = ("Ana", "Ben", "Chloe", "Dev", "Elena", "Femi")
_CHAT_LINES = (
    "did anyone water the plants on the balcony?",
    "I'll be a bit late, the bus is slow today",
    "the meeting moved to the small room",
    "can someone bring the charger back?",
    "lunch at the usual place?",
    "the printer on the second floor is jammed again",
    "I finished the slides, have a look when you can",
    "thanks, that helped a lot",
    "who has the key to the storage room?",
    "the coffee machine is fixed",
    "let's push the review to after lunch",
    "I left my umbrella by the door",
    "sounds good to me",
    "does the train still stop at the old station?",
    "the parcel arrived this morning",
)


def generated_chat(n_lines: int, seed: int = 0) -> list[str]:
    """`n_lines` messages of a group chat ("Ben: lunch at the usual place?"; no digits), deterministic in
    `seed`."""
    rng = random.Random(f"chat:{seed}")
    return [f"{rng.choice(_CHAT_PEOPLE)}: {rng.choice(_CHAT_LINES)}" for _ in range(n_lines)]


_MANUAL_ACTIONS = (
    "Press and hold the power button",
    "Open the side panel",
    "Unplug the charging cable",
    "Turn the dial slowly",
    "Clean the filter with warm water",
    "Close the lid firmly",
    "Check the indicator light",
    "Remove the cover",
    "Wait for the fan to stop",
    "Slide the tray back into place",
    "Tighten the screws by hand",
    "Reset the timer",
)
_MANUAL_PURPOSES = (
    "to avoid damage to the motor",
    "before you move the device",
    "so that the seal stays dry",
    "until the light turns green",
    "if the display stays dark",
    "when the device is cold",
    "after every use",
    "before the first start",
    "if you hear a rattling sound",
    "to keep the warranty valid",
)
_MANUAL_NOTES = (
    "Do not use sharp tools on the housing.",
    "Keep the device away from open flames.",
    "Children should not play with the device.",
    "Store the manual in a safe place.",
    "Contact the service centre if the problem persists.",
    "Use only the supplied accessories.",
)


def generated_manual(n_sentences: int, seed: int = 0) -> list[str]:
    """`n_sentences` sentences of an appliance manual ("Open the side panel before you move the device."; no
    digits), deterministic in `seed`."""
    rng = random.Random(f"manual:{seed}")
    return [
        rng.choice(_MANUAL_NOTES)
        if rng.random() < 0.2
        else f"{rng.choice(_MANUAL_ACTIONS)} {rng.choice(_MANUAL_PURPOSES)}."
        for _ in range(n_sentences)
    ]
