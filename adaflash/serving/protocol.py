"""The OpenAI wire protocol as our server and the feedback gateway speak it: request bodies,
chat messages → prompt token ids (through the target's chat template), the fields we refuse
rather than ignore, and the OpenAI error object. No engine here: the gateway imports this
without loading torch's serving stack.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from adaflash.errors import InputError

# Integers are strict: JSON `true` is not the token id 1, nor a max_tokens of 1.
TOP_K_MAX = 2**31 - 1  # any k past the vocabulary means "no filter"; past int64 torch fails


class RequestBody(BaseModel):
    # Unknown OpenAI fields are accepted and ignored, except those in UNSUPPORTED_FIELDS: they
    # would change the output, so they are refused rather than silently dropped.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=TOP_K_MAX)] | None = None  # vLLM extension; 0/-1: off
    n: StrictInt | None = None
    stream: bool = False
    seed: StrictInt | None = None
    user: str | None = None
    stop: str | list[str] | None = None
    method: str | None = None
    domain: str | None = None


class CompletionBody(RequestBody):
    prompt: str | list[StrictInt] | list[str]
    # The legacy API: how many alternatives per token (0: the token's own logprob only); a
    # boolean, as chat clients send it, means 0 (true) or off (false).
    logprobs: bool | StrictInt | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None  # alternatives per token; needs logprobs: true


class ReloadBody(BaseModel):
    path: str = Field(max_length=4096)  # PATH_MAX: a longer one can only fail, inside the loader
    version: str | None = Field(default=None, max_length=256)


Body = TypeVar("Body", bound=BaseModel)


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one line naming the fields: `invalid request: top_k: ...; n: ...`."""
    msgs = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msgs.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "invalid request: " + "; ".join(msgs)


def parse_body(raw: bytes, kind: type[Body]) -> Body:
    """A request body as `kind`, or an InputError saying what is wrong with it."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, nesting past Python's stack
        raise InputError(f"invalid JSON body: {str(e)[:200]}") from None
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise InputError(validation_message(e.errors())) from None


ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # OpenAI's limit on stop sequences
_SURROGATE = re.compile("[\ud800-\udfff]")
# Fields the engine cannot honour: refused with a 400 rather than silently ignored. Each maps to
# the values that mean "off" (those are accepted).
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    # Tool use and its forcing: "none"/"auto" with no tools change nothing.
    "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
    # vLLM/SGLang sampling extensions the engine does not implement.
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "typical_p": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "truncate_prompt_tokens": (None,),
    # Structured output (vLLM's guided_* and structured_outputs, SGLang's regex/json_schema).
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
}
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class ModelNotFound(InputError):
    """The request names a model this server does not serve (OpenAI answers 404)."""


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: dict | None = None,
    code: str | None = None,
):
    """The OpenAI error object; the message is made encodable whatever the client sent."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    err = {"message": message, "type": kind, "param": None, "code": code}
    return JSONResponse({"error": err}, status_code=status, headers=headers)


# A tenant id or domain label (`user`, `domain`, `X-Tenant-Id`, `X-Domain`) keys the prefix and suffix
# caches and every feedback record: bounded, so a client cannot grow server memory or push a record
# past the broker's size limit with one, and printable, so it cannot forge lines in a log.
LABEL_MAX = 128


def check_label(value: str | None, name: str) -> None:
    if value is not None and (len(value) > LABEL_MAX or not value.isprintable()):
        raise InputError(f"{name} must be at most {LABEL_MAX} printable characters")


def check_text(value: Any, where: str = "request") -> None:
    """Every string in a parsed JSON value must be valid Unicode text (JSON lets a client send a
    lone surrogate such as "\\ud800", which no tokenizer can encode). Iterative: any depth."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise InputError(f"{where} contains a lone UTF-16 surrogate: not valid Unicode text")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)


def _message_text(m: ChatMessage, i: int) -> str:
    if m.role not in ROLES:
        raise InputError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
    content = m.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):  # OpenAI content parts: text only
        if part.get("type") != "text":
            raise InputError(f"messages[{i}].content[{j}]: only text content parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise InputError(f"messages[{i}].content[{j}].text must be a string")
        parts.append(text)
    return "".join(parts)


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Token ids of a conversation through the target's chat template (ours for `tiny`)."""
    msgs = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(messages)]
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and getattr(hf, "chat_template", None):
        try:
            text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's raise_exception(): the client's conversation
            raise InputError(f"the chat template rejected the conversation: {exc}") from None
        return tokenizer.encode(text)
    if len(msgs) == 1 and msgs[0]["role"] == "user":
        return tokenizer.chat_prompt(msgs[0]["content"])
    bos = [tokenizer.BOS] if hasattr(tokenizer, "BOS") else []
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
    return bos + tokenizer.encode(text)
