"""The OpenAI response shapes of one HTTP request's choices: the streamed chunks, the plain JSON
body, `usage`, our `adaflash` extension object, and the logprobs in OpenAI's two formats."""

from __future__ import annotations

import codecs
import time

from adaflash.serving.engine import Request
from adaflash.serving.request import TokenLogprob


class LogprobsFormat:
    """One choice's logprobs in OpenAI's shapes, built token by token (a stream sends each
    chunk's): chat `{"content": [{token, logprob, bytes, top_logprobs}]}` or the legacy
    completions `{tokens, token_logprobs, top_logprobs, text_offset}`. A token's text is its bytes
    when they are UTF-8, else OpenAI's `bytes:\\xNN` spelling (a piece of a multi-byte character;
    `bytes` has the raw values), so distinct tokens never share a key of `top_logprobs`;
    `text_offset` counts characters of the text the tokens decode to."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tok, self.chat = tokenizer, chat
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def _pieces(self, ids: list[int]) -> list[bytes]:
        try:
            return self.tok.token_bytes(ids)
        except NotImplementedError:  # not a byte-level vocabulary: each token's own decoding
            return [self.tok.decode([i]).encode() for i in ids]

    def _text(self, token: int, raw: bytes) -> str:
        if not raw:  # a special token (eos): no text of its own, so its name
            hf = getattr(self.tok, "tok", None)
            name = hf.convert_ids_to_tokens(token) if hf is not None else None
            return name if isinstance(name, str) else f"<|token_{token}|>"
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def format(self, entries: list[TokenLogprob]) -> dict | None:
        if not entries:
            return None
        ids = [e.token for e in entries]
        alt_ids = sorted({t for e in entries for t, _ in e.top} - set(ids))
        raw = dict(zip(ids + alt_ids, self._pieces(ids + alt_ids), strict=True))
        text = {t: self._text(t, b) for t, b in raw.items()}
        if self.chat:

            def entry(t: int, lp: float) -> dict:
                return {"token": text[t], "logprob": lp, "bytes": list(raw[t])}

            content = [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                       for e in entries]  # fmt: skip
            return {"content": content, "refusal": None}
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            alts = {text[t]: lp for t, lp in e.top}
            alts.setdefault(text[e.token], e.logprob)  # the chosen token is always listed, as OpenAI does
            out["tokens"].append(text[e.token])
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(self.offset)
            self.offset += len(self._utf8.decode(raw[e.token]))
        return out


def output_text(tokenizer, eos: set[int], req: Request) -> str:
    """The completion's text: eos tokens dropped, cut where a stop sequence begins."""
    text = tokenizer.decode([t for t in req.output_ids if t not in eos])
    return text[: req.stop_index] if req.stop_index is not None else text


def finish(req: Request) -> str:
    return req.finish_reason if req.finish_reason in ("stop", "error") else "length"


class Replies:
    """What the client is sent for the n engine requests (`reqs`, one per choice) of one
    completions or chat request: one id and creation time for all of them."""

    def __init__(self, reqs: list[Request], tokenizer, eos: set[int], model_name: str, chat: bool,
                 wants_logprobs: bool) -> None:  # fmt: skip
        self.reqs, self.tok, self.eos, self.model, self.chat = reqs, tokenizer, eos, model_name, chat
        self.wants_logprobs = wants_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + reqs[0].request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.formats = [LogprobsFormat(tokenizer, chat) for _ in reqs]

    def logprobs(self, i: int, entries: list[TokenLogprob]) -> dict | None:
        return self.formats[i].format(entries) if self.wants_logprobs else None

    def usage(self) -> dict:
        n = sum(len(r.output_ids) for r in self.reqs)
        p = len(self.reqs[0].prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def extras(self) -> dict:
        """The `adaflash` object: the first choice's method, drafter version, τ and verify length."""
        req = self.reqs[0]
        rounds = req.rounds
        return {
            "method": req.method,
            "drafter_version": req.drafter_version,
            "rounds": len(rounds),
            "tau": sum(r.accepted + 1 for r in rounds) / len(rounds) if rounds else None,
            "mean_verify_len": sum(r.verify_len for r in rounds) / len(rounds) if rounds else None,
        }

    def chunk(self, i: int, text: str, new: list[int], first: bool, done: bool, lps: list) -> dict:
        """One server-sent event's object: choice i's new text and token ids."""
        r = self.reqs[i]
        if self.chat:
            d: dict = {"content": text}
            if first:
                d["role"] = "assistant"
            choice = {"index": i, "delta": d, "logprobs": self.logprobs(i, lps)}
            choice["finish_reason"] = finish(r) if done else None
        else:
            choice = {
                "index": i,
                "text": text,
                "logprobs": self.logprobs(i, lps),
                "finish_reason": finish(r) if done else None,
            }
        choice["token_ids"] = new
        chunk = {
            "id": self.id,
            "object": self.object + (".chunk" if self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if done and r.error is not None:  # already streaming: the error rides on the chunk
            chunk["error"] = {
                "message": r.error,
                "type": "invalid_request_error" if r.error_kind == "invalid" else "server_error",
            }
        return chunk

    def body(self) -> dict:
        """The plain JSON response, once every choice has finished."""
        choices = []
        for i, r in enumerate(self.reqs):
            text = output_text(self.tok, self.eos, r)
            lps = self.logprobs(i, r.logprobs)
            if self.chat:
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lps,
                    "finish_reason": finish(r),
                }
            else:
                choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": finish(r)}
            choice["token_ids"] = r.output_ids
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "adaflash": self.extras(),
        }
