"""OpenAI's JSON objects, built from the core's responses: whole completions, the chunks of
a stream, and errors (``openai_errors``) naming the request's fields (one
:class:`Formatter` per request).

Streaming: no chunk has empty text (a token that ends inside a UTF-8 character is held, with
its logprobs, until the character is complete) unless it carries a finish reason.
``stream_options.include_usage`` adds a last chunk with the usage (``"usage": null`` on the
others); with vLLM's ``continuous_usage_stats`` as well, every chunk carries the usage so far
(prompt tokens, the tokens of the chunk's choice so far, their total), as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, cast

from pagedserve.v1 import common_pb2, generation_pb2
from services.gateway.api.openai.errors import HttpError
from services.gateway.core.generation import FINISH_NAMES, GenerationCore, GenerationError
from services.gateway.text.reasoning_parsers import ReasoningParser
from services.gateway.text.tool_parsers import ToolCallParser, ToolCalls

if TYPE_CHECKING:
    from services.gateway.api.openai.protocol import ChatCompletionRequest


class Formatter:
    """Turns the core's per-sample responses into OpenAI objects (one request)."""

    def __init__(
        self,
        core: GenerationCore,
        kind: str,
        include_usage: bool,
        logprobs: bool,
        continuous_usage: bool = False,
    ) -> None:
        self.core = core
        self.kind = kind
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # usage on every chunk (needs include_usage)
        self.logprobs = logprobs
        prefix = "cmpl" if kind == "completions" else "chatcmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "text_completion" if kind == "completions" else "chat.completion"
        # Per prompt (a completions request may carry several), known once tokenized.
        self.prompt_ids: dict[int, list[int]] = {}
        self.echo = False  # completions: the prompt's text (and log-probabilities) first
        self.prompt_only = False  # completions, max_tokens 0 with echo: the prompt alone
        self.choices_per_prompt = 1  # n: choice i belongs to prompt i // n
        self._offsets: dict[int, int] = {}  # completions logprobs: text offset per choice
        self._usage: dict[int, common_pb2.Usage] = {}
        self._tokens: dict[int, int] = {}  # streamed tokens per choice
        # Logprobs of tokens whose text is not out yet (they end inside a UTF-8 character).
        self._held_logprobs: dict[int, list[common_pb2.TokenLogprob]] = {}
        # Chat with tools: each reply is tool calls (its text is held until it is complete).
        self.tool_calls: ToolCalls | None = None
        self._held_text: dict[int, list[str]] = {}
        # Chat with tool_choice auto: the calls the model chose are read by this parser; the
        # text goes out as it comes until a call may begin (per choice: text so far, sent).
        self.auto_tools: ToolCallParser | None = None
        self.tool_names: frozenset[str] = frozenset()  # the functions the request declares
        self.parallel_tool_calls = True  # false: at most one call
        self._reply_text: dict[int, str] = {}
        self._sent: dict[int, int] = {}
        # Chat with a reasoning parser: each reply's reasoning apart from its answer (per
        # choice: the reply so far, and the reasoning and answer characters sent).
        self.reasoning: ReasoningParser | None = None
        self._thinking: dict[int, tuple[str, int, int]] = {}
        # Request fields by the internal names they were translated into (errors name them).
        self.field_names: dict[str, str] = {}

    def for_chat(
        self,
        body: ChatCompletionRequest,
        gen: generation_pb2.GenerateRequest,
        calls: ToolCalls | None,
        auto_tools: ToolCallParser | None,
        reasoning: ReasoningParser | None,
    ) -> None:
        """Format the replies of the chat request ``body`` (the chat route's, or a request
        translated into one), built as ``gen``, whose reply must be ``calls`` if any;
        ``auto_tools`` / ``reasoning``: the gateway's parsers."""
        self.tool_calls = calls
        self.auto_tools = auto_tools if body.auto_tool_choice() else None
        self.tool_names = frozenset(body.tool_names())
        self.parallel_tool_calls = body.parallel_tool_calls
        # (A constrained output is all answer: the grammar leaves no room to think.)
        if not gen.sampling_params.HasField("structured_outputs"):
            self.reasoning = reasoning

    def error(self, exc: GenerationError) -> HttpError:
        """The core's error, naming the request's own fields."""
        return HttpError.of(exc, self.field_names)

    def set_prompt(self, ids: list[int], prompt: int = 0) -> None:
        self.prompt_ids[prompt] = list(ids)

    # -- non-streaming --

    async def collect(self, responses: AsyncIterator[generation_pb2.GenerateResponse]) -> Any:
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list[common_pb2.TokenLogprob]] = {}
        finish: dict[int, str] = {}
        prompt_logprobs: dict[int, list[common_pb2.TokenLogprob]] = {}  # per prompt
        async for r in responses:
            if r.prompt_logprobs:
                prompt_logprobs[r.index // self.choices_per_prompt] = list(r.prompt_logprobs)
            texts.setdefault(r.index, []).append(r.text)
            logprobs.setdefault(r.index, []).extend(r.logprobs)
            if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                finish[r.index] = FINISH_NAMES.get(r.finish_reason, "stop")
                self._usage[r.index] = r.usage
        choices = []
        for i in sorted(texts):
            text = "".join(texts[i])
            if self.prompt_only:  # the one token computed is not part of the reply
                text, logprobs[i] = "", []
                self._usage[i] = common_pb2.Usage(
                    prompt_tokens=self._usage[i].prompt_tokens,
                    cached_prompt_tokens=self._usage[i].cached_prompt_tokens,
                )
            lp = self._logprobs(logprobs[i], 0, i) if self.logprobs else None
            if self.echo:
                prompt = i // self.choices_per_prompt
                text, lp = self._echo(prompt, prompt_logprobs.get(prompt, []), text, lp)
            if self.kind == "completions":
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish.get(i)}
            else:
                message, reason = self._reply(text, finish.get(i))
                choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": reason}
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.core.model_name,
            "choices": choices,
            "usage": self._usage_body(),
        }

    def _reply(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message and finish reason: with a reasoning parser, the reasoning
        apart (``reasoning_content``); then the answer (:meth:`_answer`)."""
        if self.reasoning is None:
            return self._answer(text, finish)
        thought, text = self.reasoning.split(text, finished=True)
        message, finish = self._answer(text, finish)
        return {**message, "reasoning_content": thought or None}, finish

    def _answer(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat answer's message and finish reason: its text, or, with tools, the calls
        it makes (OpenAI's finish reason: ``tool_calls`` for ``required`` and ``auto``,
        ``stop`` for a named function) and, with ``auto``, the text before them; an output
        cut short stays text."""
        content: str | None = None
        calls = self.tool_calls.parse(text) if self.tool_calls and finish == "stop" else None
        if self.auto_tools is not None and finish == "stop":
            parsed = self.auto_tools.parse(text, self.tool_names)
            content, calls = parsed.content, parsed.calls or None
            if calls and not self.parallel_tool_calls:
                calls = calls[:1]
        if calls is None:
            return {"role": "assistant", "content": text}, finish
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for name, arguments in calls
            ],
        }
        named = self.tool_calls is not None and self.tool_calls.name is not None
        return message, "stop" if named else "tool_calls"

    def _echo(
        self,
        prompt: int,
        prompt_logprobs: list[common_pb2.TokenLogprob],
        text: str,
        lp: dict[str, Any] | None,
    ) -> tuple[str, dict[str, Any] | None]:
        """A completions choice with its prompt first (``echo``): the prompt's text, and with
        ``logprobs`` its tokens' log-probabilities (None for the first token, which nothing
        predicts), as vLLM and OpenAI give them; the completion's offsets follow on."""
        decode = self.core.tokenizer.decode
        ids = self.prompt_ids.get(prompt, [])
        prompt_text = cast(str, decode(ids, skip_special_tokens=True))
        if lp is None:
            return prompt_text + text, None
        tokens = [cast(str, decode([t])) for t in ids]
        offsets, offset = [], 0
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        tops = [
            {cast(str, decode([t.token_id])): t.logprob for t in x.top_logprobs}
            for x in prompt_logprobs
        ]
        echoed = {
            "tokens": tokens + lp["tokens"],
            "token_logprobs": [None, *(x.logprob for x in prompt_logprobs), *lp["token_logprobs"]],
            "top_logprobs": [None, *tops, *lp["top_logprobs"]],
            "text_offset": offsets + [o + offset for o in lp["text_offset"]],
        }
        return prompt_text + text, echoed

    # -- streaming --

    async def events(
        self,
        first: generation_pb2.GenerateResponse | None,
        responses: AsyncIterator[generation_pb2.GenerateResponse],
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events, ``[DONE]`` last; an error mid-stream is an error event. The
        caller owns (and closes) ``responses``."""
        try:
            async for chunk in self.chunks(first, responses):
                yield sse(chunk)
        except GenerationError as exc:
            yield sse(self.error(exc).body())
        yield b"data: [DONE]\n\n"

    async def chunks(
        self,
        first: generation_pb2.GenerateResponse | None,
        responses: AsyncIterator[generation_pb2.GenerateResponse],
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The stream's chunk objects (the usage chunk last, with ``include_usage``); an
        error mid-stream is raised. The caller owns (and closes) ``responses``."""
        started: set[int] = set()
        pending = [first] if first is not None else []
        while True:
            for r in pending:
                for chunk in self._chunks(r, started):
                    yield chunk
            try:
                pending = [await anext(responses)]
            except StopAsyncIteration:
                break
        if self.include_usage:
            yield self._chunk([], usage=self._usage_body())

    def _chunks(self, r: generation_pb2.GenerateResponse, started: set[int]) -> list[dict]:
        """The chunks for one response: none when it has no text yet (its tokens end inside
        a UTF-8 character; their logprobs wait for the text) and does not finish."""
        final = r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        if final:
            self._usage[r.index] = r.usage
        tokens_before = self._tokens.get(r.index, 0)
        self._tokens[r.index] = tokens = tokens_before + len(r.token_ids)
        held = self._held_logprobs.setdefault(r.index, [])
        held.extend(r.logprobs)
        if not r.text and not final:
            return [self._role_chunk(r.index, tokens_before)] if self._start(r, started) else []
        finish = FINISH_NAMES.get(r.finish_reason, "stop") if final else None
        offset = self._offsets.get(r.index, 0)
        lp = self._logprobs(held, offset, r.index) if self.logprobs else None
        has_logprobs, unsent = bool(held), list(held)
        held.clear()
        self._offsets[r.index] = offset + len(r.text)
        usage = self._usage_so_far(r.index, tokens)
        if self.kind == "completions":
            choice = {"index": r.index, "text": r.text, "logprobs": lp, "finish_reason": finish}
            return [self._chunk([choice], usage)]
        out = [self._role_chunk(r.index, tokens_before)] if self._start(r, started) else []
        text = r.text
        if self.reasoning is not None:
            thought, text = self._reasoning_delta(r.index, text, final)
            if thought:  # (the logprobs go with the first delta of this response)
                choice = {"index": r.index, "delta": {"reasoning_content": thought}}
                out.append(self._chunk([{**choice, "logprobs": lp, "finish_reason": None}], usage))
                lp, has_logprobs = None, False
        if self.auto_tools is not None:
            delta_ = self._auto_delta(r.index, text, finish)
            if delta_ is None and not final:  # the text held: its logprobs wait with it
                self._held_logprobs[r.index].extend(unsent if has_logprobs else ())
            elif delta_ is not None or has_logprobs:
                sent, finish = delta_ or ({"content": ""}, finish)
                choice = {"index": r.index, "delta": sent, "logprobs": lp}
                out.append(self._chunk([{**choice, "finish_reason": None}], usage))
        elif self.tool_calls is not None:  # the calls go out whole, once complete
            self._held_text.setdefault(r.index, []).append(text)
            if not final:
                self._held_logprobs[r.index].extend(unsent if has_logprobs else ())
                return out
            message, finish = self._answer("".join(self._held_text.pop(r.index)), finish)
            if message["content"] is None:
                delta: dict[str, Any] = {"tool_calls": _call_deltas(message)}
            else:
                delta = {"content": message["content"]}
            out.append(
                self._chunk(
                    [{"index": r.index, "delta": delta, "logprobs": lp, "finish_reason": None}],
                    usage,
                )
            )
        elif text or has_logprobs:
            delta = {"content": text}
            out.append(
                self._chunk(
                    [{"index": r.index, "delta": delta, "logprobs": lp, "finish_reason": None}],
                    usage,
                )
            )
        if final:
            out.append(
                self._chunk(
                    [{"index": r.index, "delta": {}, "logprobs": None, "finish_reason": finish}],
                    usage,
                )
            )
        return out

    def _auto_delta(
        self, index: int, text: str, finish: str | None
    ) -> tuple[dict[str, Any], str | None] | None:
        """With ``tool_choice`` auto, the delta for a choice's new ``text`` (None: nothing to
        send yet) and its finish reason: text up to where a call may begin goes out at once;
        the rest is held, and once the reply is finished sent as the calls it parses into,
        or as text if it does not."""
        assert self.auto_tools is not None
        so_far = self._reply_text[index] = self._reply_text.get(index, "") + text
        sent = self._sent.get(index, 0)
        end = max(self.auto_tools.content_end(so_far, sent), sent)
        if finish is None:
            self._sent[index] = end
            return ({"content": so_far[sent:end]}, None) if end > sent else None
        del self._reply_text[index]
        self._sent.pop(index, None)
        message, finish = self._answer(so_far, finish)
        if "tool_calls" not in message:
            return ({"content": so_far[sent:]}, finish) if len(so_far) > sent else None
        before = so_far[sent:end]  # text before the calls not sent yet (it came last)
        calls = _call_deltas(message)
        return {**({"content": before} if before.strip() else {}), "tool_calls": calls}, finish

    def _reasoning_delta(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """A choice's new reasoning and new answer text, once ``text`` is added to it."""
        assert self.reasoning is not None
        so_far, thought_sent, answer_sent = self._thinking.get(index, ("", 0, 0))
        so_far += text
        thought, answer = self.reasoning.split(so_far, finished=final)
        if final:
            self._thinking.pop(index, None)
        else:
            self._thinking[index] = (so_far, len(thought), len(answer))
        return thought[thought_sent:], answer[answer_sent:]

    def _start(self, r: generation_pb2.GenerateResponse, started: set[int]) -> bool:
        """Whether ``r`` is the first of a chat choice (which opens with the role)."""
        if self.kind != "chat" or r.index in started:
            return False
        started.add(r.index)
        return True

    def _role_chunk(self, index: int, tokens: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._chunk([choice], self._usage_so_far(index, tokens))

    def _usage_so_far(self, index: int, completion_tokens: int) -> dict[str, Any] | None:
        """A chunk's usage with ``continuous_usage_stats`` (as vLLM: the prompt of the chunk's
        choice, and that choice's tokens so far); None otherwise."""
        if not self.continuous_usage:
            return None
        prompt = len(self.prompt_ids.get(index // self.choices_per_prompt, ()))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completions" else "chat.completion.chunk"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.core.model_name,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage
        return chunk

    # -- shared --

    def _usage_body(self) -> dict[str, Any]:
        """Every prompt counted once (its choices share it), every choice's tokens."""
        first: dict[int, common_pb2.Usage] = {}  # prompt -> the usage of one of its choices
        for index, usage in sorted(self._usage.items()):
            first.setdefault(index // self.choices_per_prompt, usage)
        prompt = sum(u.prompt_tokens for u in first.values())
        cached = sum(u.cached_prompt_tokens for u in first.values())
        completion = sum(u.completion_tokens for u in self._usage.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(
        self, logprobs: list[common_pb2.TokenLogprob], offset: int, index: int
    ) -> dict[str, Any] | None:
        tokenizer = self.core.tokenizer

        def decode(ids: list[int]) -> str:
            return cast(str, tokenizer.decode(ids))

        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": (t := decode([lp.token_id])),
                        "logprob": lp.logprob,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {
                                "token": (a := decode([top.token_id])),
                                "logprob": top.logprob,
                                "bytes": list(a.encode()),
                            }
                            for top in lp.top_logprobs
                        ],
                    }
                    for lp in logprobs
                ]
            }
        tokens = [decode([lp.token_id]) for lp in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {decode([top.token_id]): top.logprob for top in lp.top_logprobs} for lp in logprobs
            ],
            "text_offset": offsets,
        }


def _call_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A reply's tool calls as one streamed delta sends them (each with its index)."""
    return [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]


def sse(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
