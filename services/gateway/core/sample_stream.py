"""Turning one sample's token updates into public responses: incremental detokenization,
stop strings, finish reasons and usage."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import common_pb2, executor_pb2, generation_pb2
from services.gateway.core.validation import TextOptions
from services.gateway.text.detokenizer import IncrementalDetokenizer
from services.gateway.text.stop_strings import StopStringMatcher


@dataclass
class SampleStream:
    """State of sample ``index`` of one request. ``done`` once its final message is built."""

    request_id: str
    index: int
    tokenizer: PreTrainedTokenizerBase
    prompt_token_ids: list[int]
    options: TextOptions
    cached_prompt_tokens: int | None = None  # as the first executor that served it said
    done: bool = False
    # Every token sent so far: a sample resumed on another executor carries on from them.
    token_ids: list[int] = field(default_factory=list)
    detok: IncrementalDetokenizer = field(init=False)
    matcher: StopStringMatcher | None = field(init=False)

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(
            self.tokenizer,
            self.prompt_token_ids,
            skip_special_tokens=self.options.skip_special_tokens,
        )
        self.matcher = (
            StopStringMatcher(self.options.stop, self.options.include_stop_str_in_output)
            if self.options.stop
            else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def process(
        self, update: executor_pb2.SequenceUpdate
    ) -> tuple[generation_pb2.GenerateResponse | None, bool]:
        """The response for ``update`` (None if there is nothing to say yet), and whether a
        stop string ended this sample (the executor must then be told to stop it)."""
        if self.done:
            return None, False
        tokens = list(update.token_ids)
        self.token_ids.extend(tokens)
        if update.HasField("usage") and self.cached_prompt_tokens is None:
            # (a resumed sample's executor counts its recomputed output tokens too)
            self.cached_prompt_tokens = update.usage.cached_prompt_tokens
        final = update.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        stop_token = update.stop_token_id if update.HasField("stop_token_id") else None
        # An EOS / stop token ends the text; its own text is never part of the output.
        text_tokens = tokens[:-1] if stop_token is not None and tokens else tokens
        delta = self.detok.push(text_tokens) if text_tokens else ""
        if final:
            delta += self.detok.flush()
        matched: str | None = None
        if self.matcher is not None:
            delta, matched = self.matcher.feed(delta)
            if matched is None and final:
                delta += self.matcher.flush()
        resp = generation_pb2.GenerateResponse(
            request_id=self.request_id, index=self.index, text=delta, token_ids=tokens
        )
        if self.options.logprobs:
            resp.logprobs.extend(self._logprobs(update.logprobs))
        if update.prompt_logprobs:
            resp.prompt_logprobs.extend(self._logprobs(update.prompt_logprobs))
        if matched is not None:
            resp.finish_reason = common_pb2.FINISH_REASON_STOP
            resp.stop_string = matched
            self._finish(resp)
            return resp, True
        if final:
            resp.finish_reason = update.finish_reason
            if stop_token is not None:
                resp.stop_token_id = stop_token
            self._finish(resp)
            return resp, False
        if not delta and not tokens:
            return None, False
        return resp, False

    def _finish(self, resp: generation_pb2.GenerateResponse) -> None:
        self.done = True
        resp.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=len(self.prompt_token_ids),
                completion_tokens=self.num_tokens,
                cached_prompt_tokens=min(
                    self.cached_prompt_tokens or 0, len(self.prompt_token_ids)
                ),
            )
        )

    def _logprobs(
        self, logprobs: Iterable[common_pb2.TokenLogprob]
    ) -> list[common_pb2.TokenLogprob]:
        out = []
        for lp in logprobs:
            ids = [lp.token_id, *(t.token_id for t in lp.top_logprobs)]
            names = self.tokenizer.convert_ids_to_tokens(ids)
            out.append(
                common_pb2.TokenLogprob(
                    token_id=lp.token_id,
                    logprob=lp.logprob,
                    token=names[0] or "",
                    top_logprobs=[
                        common_pb2.TopLogprob(
                            token_id=t.token_id, logprob=t.logprob, token=name or ""
                        )
                        for t, name in zip(lp.top_logprobs, names[1:], strict=True)
                    ],
                )
            )
        return out
