"""What `bench serve` sends: a seeded mix of long single prompts and multi-turn chats under shared system prompts.

Two ways to pace it (`WorkloadSpec`): N concurrent users (closed loop: each user sends its next request when its
last one has finished) or Poisson arrivals at a given rate (open loop: arrivals do not wait for replies).

- Long prompts go to /v1/completions as plain text of about `long_tokens` tokens, each different (no shared
  prefix), so each is a full prefill.
- Chats go to /v1/chat/completions. A user's conversation grows turn by turn: its earlier turns and the server's
  replies are sent again with the next user turn, and every user's conversation starts with one of
  `system_prompts` system prompts shared across users, so a server with prefix caching reuses both the shared
  system prompt and a conversation's own history. After `turns` turns the user starts a new conversation.

Sizes are in tokens, turned into text at `chars_per_token` characters a token (4 by default, the usual figure for
English under large BPE vocabularies) because the load generator talks HTTP and does not know the server's
tokenizer; the server's `usage.prompt_tokens` in each record says what a prompt really was. The text is common
English words (WORDS), most of them one token each even in the demo model's 4,096-token vocabulary, which makes
about 4.3 characters a token of it: the demo model's prompts come out about 6% shorter than asked.

Every random choice comes from seeded RNGs: in closed loop each user has its own, so the kind and text of a user's
n-th request do not depend on timing (how many requests each user gets to send does); in open loop the arrival
times and each arrival's kind and text come in arrival order, and only which idle conversation a chat arrival
continues depends on the timing.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
KINDS = ("long", "chat")

# The demo model was trained on fortune cookies and the Python documentation; any words would do for timing.
WORDS = tuple("""
you will find a new friend soon the future holds great promise luck is on your side today a journey begins with
one step patience brings rewards your hard work will pay off an old friend will return trust your instincts good
things come to those who wait the function returns a list of values each item in the sequence is checked the
module provides a simple interface for reading files and writing data an exception is raised when the key is not
found the default value is used if no argument is given the class defines methods for the object the loop runs
until the condition is false use the keyword to pass options strings are immutable in python dictionaries map keys
to values the iterator yields the next element when called small steps lead to big changes the best is yet to come
""".split())


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload: how it is paced, bounded and mixed. Exactly one of `concurrency` and `rate` is set."""

    concurrency: int | None = 4  # closed loop: this many users, each with one request in flight at most
    rate: float | None = None  # open loop: Poisson arrivals, requests per second
    num_requests: int = 50  # no more requests are sent after this many
    duration_s: float = 600.0  # none are sent after this long, and those in flight are cancelled then
    long_fraction: float = 0.2  # the fraction of requests that are long prompts; the rest are chat turns
    long_tokens: int = 1024
    system_prompts: int = 1  # distinct system prompts, user u shares number u % system_prompts
    system_tokens: int = 256
    turn_tokens: int = 64  # each user turn of a chat
    turns: int = 4  # turns of a conversation before its user starts a new one
    max_tokens: int = 64  # output tokens a request asks for at most
    temperature: float = 0.0
    chars_per_token: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a workload needs exactly one of concurrency (users) and rate (requests/s)")
        paced = {"concurrency": self.concurrency} if self.rate is None else {"rate": self.rate}
        positive = dict(**paced, num_requests=self.num_requests,
                        duration_s=self.duration_s, long_tokens=self.long_tokens,
                        system_prompts=self.system_prompts, system_tokens=self.system_tokens,
                        turn_tokens=self.turn_tokens, turns=self.turns, max_tokens=self.max_tokens,
                        chars_per_token=self.chars_per_token)
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RequestPlan:
    """One request to send: its endpoint and JSON body (without `model` and the streaming fields)."""

    kind: str  # "long" or "chat"
    endpoint: str
    body: dict
    user: int
    turn: int  # a chat's turn in its conversation, from 1; 0 for a long prompt


def words_text(rng: random.Random, tokens: int, chars_per_token: float) -> str:
    """Random words of WORDS, as sentences, until the text has about `tokens` tokens (tokens * chars_per_token
    characters)."""
    target = max(1, round(tokens * chars_per_token))
    words: list[str] = []
    length = 0  # of " ".join(words)
    while length < target:
        word = rng.choice(WORDS)
        if not words or words[-1].endswith("."):
            word = word.capitalize()
        if len(words) % 12 == 11:
            word += "."
        length += len(word) + (1 if words else 0)
        words.append(word)
    return " ".join(words)


def system_prompt(index: int, spec: WorkloadSpec) -> str:
    """The shared system prompt number `index` (the same text in every run with the same seed)."""
    rng = random.Random(f"{spec.seed}:system:{index}")
    return f"You are assistant number {index}. " + words_text(rng, spec.system_tokens, spec.chars_per_token)


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Arrival times (s from the start) of a Poisson process at `rate` per second: the first at 0, then
    exponential gaps of mean 1 / rate."""
    times, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


class User:
    """One simulated user: its own RNG and its chat conversation (the system prompt it shares with other users,
    then alternating user turns and the server's replies)."""

    def __init__(self, index: int, spec: WorkloadSpec, system: str):
        self.index = index
        self.spec = spec
        self.system = system
        self.rng = random.Random(f"{spec.seed}:user:{index}")
        self.messages = [{"role": "system", "content": system}]

    @property
    def turn(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)

    def draw_kind(self) -> str:
        return "long" if self.rng.random() < self.spec.long_fraction else "chat"

    def next_request(self, kind: str, rng: random.Random | None = None) -> RequestPlan:
        """The user's next request of `kind`; its text comes from `rng` (default: the user's own)."""
        rng = rng or self.rng
        sampling = {"max_tokens": self.spec.max_tokens, "temperature": self.spec.temperature}
        if kind == "long":
            prompt = words_text(rng, self.spec.long_tokens, self.spec.chars_per_token)
            return RequestPlan("long", COMPLETIONS, {"prompt": prompt, **sampling}, self.index, 0)
        if kind != "chat":
            raise ValueError(f"unknown request kind {kind!r}; choose from {KINDS}")
        if self.turn >= self.spec.turns:
            self.messages = [{"role": "system", "content": self.system}]
        self.messages.append({"role": "user", "content": words_text(rng, self.spec.turn_tokens,
                                                                     self.spec.chars_per_token)})
        return RequestPlan("chat", CHAT, {"messages": [dict(m) for m in self.messages], **sampling},
                           self.index, self.turn)

    def finished(self, plan: RequestPlan, reply: str | None) -> None:
        """Append the server's reply to the conversation; a failed chat turn (reply None) is taken back, so the
        conversation still alternates user and assistant."""
        if plan.kind != "chat":
            return
        if reply is None:
            self.messages.pop()
        else:
            self.messages.append({"role": "assistant", "content": reply})


class Workload:
    """The users of a run (created as they are needed) and, in open loop, the arrivals' own RNG."""

    def __init__(self, spec: WorkloadSpec):
        self.spec = spec
        self.system_prompts = [system_prompt(k, spec) for k in range(spec.system_prompts)]
        self.users: list[User] = []
        self.arrival_rng = random.Random(f"{spec.seed}:arrivals")

    def new_user(self) -> User:
        index = len(self.users)
        user = User(index, self.spec, self.system_prompts[index % len(self.system_prompts)])
        self.users.append(user)
        return user

    def arrival_times(self) -> list[float]:
        """Open loop: the arrival time of every request the run may send."""
        return poisson_arrivals(self.spec.rate, self.spec.num_requests, self.arrival_rng)

    def draw_arrival_kind(self) -> str:
        """Open loop: the kind of the next arrival, drawn in arrival order."""
        return "long" if self.arrival_rng.random() < self.spec.long_fraction else "chat"
