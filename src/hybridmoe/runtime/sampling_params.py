"""`SamplingParams`: how one request picks its next tokens and when it stops (plain Python, no torch).

Field names and meanings follow vLLM / the OpenAI API:
  temperature         0 means greedy (argmax); otherwise logits are divided by it before sampling.
  top_k               keep the k most likely tokens (ties with the k-th are kept); 0 or -1 turns it off.
  top_p               nucleus: keep the smallest set of most likely tokens whose probability sums to >= top_p.
  min_p               keep tokens whose probability is >= min_p * (probability of the most likely token).
  repetition_penalty  Hugging Face semantics: for every distinct id already in the prompt or output, a
                      positive logit is divided by it and a negative one multiplied; 1.0 turns it off.
  presence_penalty    OpenAI semantics, over the output only: subtracted from the logit of every id generated
                      at least once; in [-2, 2], 0 turns it off.
  frequency_penalty   OpenAI semantics, over the output only: subtracted once per time an id was generated.
  logit_bias          OpenAI semantics: {token id: bias in [-100, 100]} added to those ids' logits before anything
                      else the sampler does (as vLLM applies it: before the penalties); -100 all but bans a token,
                      100 all but forces it. None or {} turns it off.
  seed                per-request random seed: the same seed gives the same tokens whatever else is batched.
  stop                strings that end generation (the text is cut before the stop string).
  stop_token_ids      token ids that end generation (in addition to EOS).
  max_tokens          the most tokens generated (finish reason "length").
  min_tokens          EOS and stop_token_ids cannot be sampled before this many tokens (stop strings still stop).
  ignore_eos          keep generating past EOS (stop_token_ids still stop).
  skip_special_tokens leave special tokens out of the output text.
  logprobs            None: off; k >= 0: each generated token's log-probability and the k most likely ones.
  prompt_logprobs     None: off; k >= 0: the same for every prompt token after the first (such a request
                      computes its whole prompt: the prefix cache holds KV, not logits).
Log-probabilities are the model's own (log-softmax of the raw logits, before penalties and temperature), as
vLLM reports them by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

# Below this a temperature counts as 0 (greedy): dividing by it would only turn sampling into argmax
# with extra float overflow risk. Same threshold as vLLM's _SAMPLING_EPS.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs
MAX_LOGIT_BIAS = 100  # the OpenAI API's bound on a logit_bias value


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1.0 means off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2] (0 means off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 means off)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "must be a bool")
        for stop_string in self.stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise bad("stop", "must hold only non-empty strings")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise bad("stop_token_ids", "must hold only integers >= 0")
        for token_id, bias in (self.logit_bias or {}).items():
            if not _is_int(token_id) or token_id < 0:
                raise bad("logit_bias", "must have token ids (integers >= 0) as keys")
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must have biases in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}] as values")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0); top-k/top-p/min-p and seed then do nothing."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
