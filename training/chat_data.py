"""Synthetic chat conversations in the demo model's chat template.

The answers come from the real text sources (fortunes as quotes and jokes, the first paragraph of Python
standard-library docstrings) or are computed (counting, small sums, repeating a sentence), so a tiny model
can learn the turn structure and give answers that are right. `render_chat` renders the same Jinja
template that ships in the tokenizer, so training text and `apply_chat_template` agree byte for byte.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import random

import jinja2

from recipe import BOS_TOKEN, CHAT_TEMPLATE_FILE

IDENTITY = "I am the hybridmoe demo model: a small DeepSeek-V3-style mixture-of-experts trained on fortune cookies and the Python documentation."
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a small demo model. Answer briefly.", "You answer questions about Python.")
FORTUNE_TOPICS = {
    "computers": "computers", "science": "science", "literature": "literature", "love": "love", "work": "work",
    "food": "food", "pets": "pets", "kids": "children", "wisdom": "wisdom", "startrek": "Star Trek",
    "law": "the law", "medicine": "medicine", "education": "education", "sports": "sports", "linux": "Linux",
    "songs-poems": "poetry", "riddles": "riddles", "people": "people", "platitudes": "life",
}
DOC_MODULES = ("builtins", "math", "os", "os.path", "random", "json", "re", "string", "itertools", "functools",
               "collections", "statistics", "time", "shutil", "textwrap", "heapq", "bisect", "operator", "copy",
               "fractions", "decimal", "datetime", "pathlib", "glob", "fnmatch", "base64", "hashlib", "zlib",
               "gzip", "csv", "html", "secrets", "uuid", "struct", "array", "enum", "dataclasses", "typing", "io",
               "difflib", "calendar", "cmath", "tempfile", "pprint", "reprlib", "keyword", "sys")
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The exact text the shipped chat template produces for `messages`."""
    return _template().render(messages=messages, bos_token=BOS_TOKEN, add_generation_prompt=add_generation_prompt)


_TEMPLATE: jinja2.Template | None = None


def _template() -> jinja2.Template:
    global _TEMPLATE
    if _TEMPLATE is None:
        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATE = env.from_string(CHAT_TEMPLATE_FILE.read_text())
    return _TEMPLATE


def python_docstrings() -> list[tuple[str, str]]:
    """[(qualified name, first docstring paragraph)] for public functions/classes of common stdlib modules."""
    pairs = []
    for module_name in DOC_MODULES:
        module = builtins if module_name == "builtins" else importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            paragraphs = [p for p in doc.split("\n\n") if p.strip() and "(" not in p.split("\n")[0][:len(name) + 1]]
            if not paragraphs:
                continue
            first = " ".join(paragraphs[0].split())
            if 20 <= len(first) <= 300:
                qualified = name if module_name == "builtins" else f"{module_name}.{name}"
                pairs.append((qualified, first))
    return pairs


def make_chats(fortunes: dict[str, list[str]], docstrings: list[tuple[str, str]], count: int,
               rng: random.Random) -> list[list[dict[str, str]]]:
    """`count` conversations of 1-3 exchanges, some with a system prompt."""
    short = {cat: [f for f in texts if len(f) <= 400] for cat, texts in fortunes.items()}
    topics = [cat for cat in FORTUNE_TOPICS if short.get(cat)]
    sentences = [s.strip() for texts in short.values() for t in texts for s in t.split("\n")
                 if 15 <= len(s.strip()) <= 90 and not s.strip().startswith("--")]
    makers = [
        (0.30, lambda: _fortune_exchange(short, topics, rng)),
        (0.25, lambda: _docstring_exchange(docstrings, rng)),
        (0.10, lambda: _identity_exchange(rng)),
        (0.10, lambda: _counting_exchange(rng)),
        (0.10, lambda: _sum_exchange(rng)),
        (0.15, lambda: _repeat_exchange(sentences, rng)),
    ]
    weights = [w for w, _ in makers]
    chats = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
            user, assistant = rng.choices(makers, weights)[0][1]()
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        chats.append(messages)
    return chats


def _fortune_exchange(short, topics, rng):
    if rng.random() < 0.4:
        ask = rng.choice(("Tell me a fortune.", "Give me a fortune cookie.", "Say something wise.",
                          "Tell me something funny.", "Give me a quote.", "Cheer me up."))
        text = rng.choice(short[rng.choice(topics)])
    else:
        category = rng.choice(topics)
        topic = FORTUNE_TOPICS[category]
        ask = rng.choice((f"Tell me something about {topic}.", f"Give me a quote about {topic}.",
                          f"Do you know a joke about {topic}?", f"What do people say about {topic}?"))
        text = rng.choice(short[category])
    return ask, text


def _docstring_exchange(docstrings, rng):
    name, doc = rng.choice(docstrings)
    ask = rng.choice((f"What does {name} do in Python?", f"Explain {name}.", f"What is {name}?",
                      f"In Python, what is {name} for?"))
    return ask, f"{name}: {doc}"


def _identity_exchange(rng):
    ask = rng.choice(("Hello!", "Hi.", "Who are you?", "What are you?", "What can you do?", "Hey there."))
    if ask in ("Hello!", "Hi.", "Hey there."):
        return ask, rng.choice(("Hello! How can I help you?", "Hi! Ask me for a fortune or about Python.",
                                "Hello! I can tell you a fortune or explain a Python function."))
    if ask == "What can you do?":
        return ask, "I can tell fortunes, quote famous people, explain Python functions, count and add small numbers."
    return ask, IDENTITY


def _counting_exchange(rng):
    start = rng.randint(0, 20)
    stop = start + rng.randint(2, 9)
    ask = rng.choice((f"Count from {start} to {stop}.", f"Please count from {start} to {stop}."))
    return ask, ", ".join(str(n) for n in range(start, stop + 1)) + "."


def _sum_exchange(rng):
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    if rng.random() < 0.5:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    return f"What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?", f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {a + b}."


def _repeat_exchange(sentences, rng):
    sentence = rng.choice(sentences)
    return rng.choice(("Repeat after me: ", "Say this back to me: ")) + sentence, sentence
