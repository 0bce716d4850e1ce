"""The request bodies of the OpenAI-compatible API (pydantic v2): chat completions, completions, and vLLM's tokenize
and detokenize, with OpenAI's field names and vLLM's extra sampling fields.

Types and ranges are checked here (a violation is a 400 naming the field); unknown fields are ignored, as OpenAI's
and vLLM's servers do, while known fields this server cannot honour are refused by name (`unsupported`).
Responses are plain dicts built by the handlers (chat.py, completions.py): cheaper than models per stream chunk.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridmoe.runtime.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

MAX_CHOICES = 128  # n: each choice is a request of its own


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """The sampling fields chat and completions share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) of the first field set to something this server does not do (its 400 names it)."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is not supported without stream: true"  # as OpenAI
        return None

    def token_bias(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with token ids as ints; ValueError (a 400 naming logit_bias) for a key that is not a token id
        in [0, vocab_size) or a bias outside [-100, 100]."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise ValueError(f"logit_bias: the key {key!r} is not a token id") from None
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias: the token id {token_id} is not in [0, {vocab_size})")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # also NaN
                raise ValueError(f"logit_bias: the bias {value} of token {token_id} is not in "
                                 f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
            bias[token_id] = value
        return bias

    def sampling_params(self, max_tokens: int, num_logprobs: int | None, prompt_logprobs: int | None = None,
                        choice: int = 0, logit_bias: dict[int, float] | None = None) -> SamplingParams:
        """The SamplingParams of choice number `choice` (a given seed is offset per choice, so the n choices
        differ and each is reproducible). Defaults are OpenAI's (temperature 1, top_p 1)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, logit_bias=logit_bias,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop, stop_token_ids=self.stop_token_ids, max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens), ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, logprobs=num_logprobs, prompt_logprobs=prompt_logprobs,
        )


class ContentPart(BaseModel):
    """A part of a message's content. Only text parts are served; other types (image_url, input_audio, file) are
    read so that the handler can refuse them by name."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def unsupported_part(self) -> tuple[int, str] | None:
        """(index, message) of the first content part this server cannot serve, else None."""
        for i, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type != "text":
                return i, (f"content parts of type {part.type!r} are not supported: this server serves a text-only "
                           "model; send text parts or a string")
            if part.text is None:
                return i, "a text content part needs its text"
        return None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        for i, message in enumerate(self.messages):
            part = message.unsupported_part()
            if part is not None:
                return f"messages[{i}].content[{part[0]}]", f"messages[{i}].content[{part[0]}]: {part[1]}"
        if self.tools:
            return "tools", "tools (function calling) is not supported by this server; send the request without tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", (f"tool_choice {self.tool_choice!r} is not supported by this server: it has no tool "
                                   "calling (only none or auto, which mean the same without tools)")
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", (f"response_format of type {self.response_format.get('type')!r} is not "
                                       "supported by this server (no structured output); only 'text'")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs is not supported without logprobs: true"  # as OpenAI
        return super().unsupported()

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name), else max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(SamplingFields):
    prompt: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # OpenAI's default; 0 only with echo (score the prompt)
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported by this server (no fill-in-the-middle)"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported by this server with a value other than n"
        if self.max_tokens == 0 and not self.echo:  # 0 tokens only makes sense when the prompt is echoed (and scored)
            return "max_tokens", "max_tokens 0 is not supported without echo: true"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (each a string or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
