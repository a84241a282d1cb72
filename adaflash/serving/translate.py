"""Request translation: an OpenAI request body (bytes) and its headers become the engine's
`Request`s. The body's fields are checked and turned into `GenParams` before anything is encoded,
decoded or seeded; the prompt becomes token ids (a chat through the target's template); each of
the `n` choices becomes one `Request` with its own seed, tenant, consent and suffix-cache flag.

`ServerSettings` lives here because translation reads most of it (the model's name, `max_n`,
the default `max_tokens`); `server.py` re-exports it.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from adaflash.errors import InputError
from adaflash.serving.edge import EdgeLimits
from adaflash.serving.engine import Engine, GenParams, Request
from adaflash.serving.protocol import (
    MAX_STOP,
    UNSUPPORTED_FIELDS,
    ChatBody,
    CompletionBody,
    ModelNotFound,
    RequestBody,
    chat_prompt_ids,
    check_label,
    check_text,
    parse_body,
)
from adaflash.serving.request import MAX_LOGPROBS, SEED_MAX, SEED_MIN


@dataclass
class ServerSettings:
    model_name: str = "adaflash"
    admin_token: str | None = None  # None: the admin API answers 403
    default_max_tokens: int = 128
    max_n: int = 8  # choices per request (each takes a KV slot)
    edge: EdgeLimits = field(default_factory=EdgeLimits)  # body size, header/body/idle timeouts


@dataclass
class Prepared:
    """A generation request as parsed and checked off the event loop, ready for the engine."""

    body: RequestBody
    params: GenParams
    n: int
    ids: list[int]
    text: str


class Translator:
    """OpenAI bodies to what the engine takes, for one engine and one server's settings."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.tok = engine.target.tokenizer

    def prepare(self, raw: bytes, chat: bool) -> Prepared:
        """Bytes to a request the engine can take: JSON, the schema, the fields' checks, the
        prompt's token ids. CPU-bound (a body may hold millions of token ids or characters), so
        the server runs it on a worker thread: the event loop, and /health with it, never waits."""
        body = parse_body(raw, ChatBody if chat else CompletionBody)
        params, n = self.gen_params(body)
        ids = self.chat_prompt(body) if chat else self.completion_prompt(body.prompt)
        self.engine.check_length(len(ids), params.max_tokens)  # before decoding millions of ids
        # The feedback record's prompt_text must be decode(prompt ids) (schema invariant): for chat,
        # the templated conversation as the target saw it, not a re-rendering of the messages.
        return Prepared(body, params, n, ids, self.tok.decode(ids))

    def gen_params(self, body: RequestBody) -> tuple[GenParams, int]:
        """Validate the request's fields and build its sampling parameters — before anything is
        encoded, decoded or seeded."""
        settings = self.settings
        if body.model is not None and body.model != settings.model_name:
            raise ModelNotFound(
                f"The model {body.model!r} does not exist (this server serves {settings.model_name!r})"
            )
        check_text(body.model_dump(), "the request")
        check_label(body.user, "user")
        check_label(body.domain, "domain")
        _refuse_unsupported(body.model_extra or {})
        n = 1 if body.n is None else body.n
        if not 1 <= n <= settings.max_n:
            raise InputError(f"n must be between 1 and {settings.max_n}")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = settings.default_max_tokens
        if max_tokens < 1:
            raise InputError("max_tokens must be at least 1")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP or any(not s for s in stop):
            raise InputError(f"stop must be at most {MAX_STOP} non-empty strings")
        if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX:
            raise InputError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        params = GenParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            seed=body.seed,
            method=body.method,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            stop=stop,
            logprobs=requested_logprobs(body),
        )
        probe = Request([0], dataclasses.replace(params, max_tokens=1))
        self.engine.validate_params(probe)
        return params, n

    def completion_prompt(self, p) -> list[int]:
        if isinstance(p, list) and not p:
            raise InputError("empty prompt")
        if isinstance(p, list) and all(isinstance(x, int) for x in p):
            vocab = self.engine.target.config.vocab_size
            if any(x < 0 or x >= vocab for x in p):  # validated before anything decodes them
                raise InputError(f"prompt token ids must be in [0, {vocab})")
            return list(p)
        if isinstance(p, list):
            if len(p) != 1:
                raise InputError("batched prompts are not supported: send one prompt per request")
            p = p[0]
        return self.tok.encode(p)

    def chat_prompt(self, body: ChatBody) -> list[int]:
        return chat_prompt_ids(self.tok, body.messages)


def _refuse_unsupported(extra: dict) -> None:
    """Fields that would change the output and that the engine cannot honour: a 400, not ignored."""
    for name, off in UNSUPPORTED_FIELDS.items():
        if name in extra and extra[name] not in off:
            raise InputError(f"{name} is not supported by this server")
    fmt = extra.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise InputError("response_format is not supported: only plain text")


def requested_logprobs(body: RequestBody) -> int | None:
    """GenParams.logprobs from chat's `logprobs` + `top_logprobs` or completions' `logprobs`."""
    if isinstance(body, ChatBody):
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InputError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]")
        if not body.logprobs:
            if top:
                raise InputError("top_logprobs needs logprobs: true")
            return None
        return top or 0
    k = getattr(body, "logprobs", None)
    if isinstance(k, bool):
        k = 0 if k else None
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise InputError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]")
    return k


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: the request's, shifted by i (wrapping inside the allowed range)."""
    if seed is None:
        return None  # each choice draws its own random seed
    span = SEED_MAX - SEED_MIN + 1
    return (seed + i - SEED_MIN) % span + SEED_MIN


def _off(headers, name: str, default: str, offs: tuple[str, ...]) -> bool:
    return headers.get(name, default).strip().lower() in offs


def choice_request(p: Prepared, i: int, headers) -> Request:
    """The engine request for choice i of `p`, with the tenant and flags its headers carry."""
    body = p.body
    check_label(headers.get("x-tenant-id"), "X-Tenant-Id")
    check_label(headers.get("x-domain"), "X-Domain")
    params = dataclasses.replace(p.params, seed=choice_seed(p.params.seed, i))
    return Request(
        p.ids,
        params,
        request_id=uuid.uuid4().hex,
        prompt_text=p.text,
        tenant_id=headers.get("x-tenant-id") or body.user or "anonymous",
        consent=not _off(headers, "x-feedback-consent", "true", ("0", "false", "no")),
        domain=body.domain or headers.get("x-domain"),
        # `X-Suffix-Cache: off`: this request does not draft from its tenant's cache (an A/B of the
        # fast learner on live traffic; its own prompt and output still can).
        use_suffix_cache=not _off(headers, "x-suffix-cache", "on", ("0", "false", "no", "off")),
        # `X-Prefix-Cache: off`: prefill the whole prompt and keep none of it (A/B, or a prompt a
        # client wants held only while it is served).
        use_prefix_cache=not _off(headers, "x-prefix-cache", "on", ("0", "false", "no", "off")),
    )
