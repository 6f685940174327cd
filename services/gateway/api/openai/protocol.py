"""OpenAI-compatible request bodies, and their translation into a ``GenerateRequest``.

Only shapes live here: every range rule is the gRPC front's (``validation``,
``services.common``), applied by the shared core to the translated request. Fields OpenAI
defines that this server cannot honour (``tool_choice: auto`` without a tool-call parser,
suffix, echo with stream) are refused by name rather than silently ignored. Unknown fields
are ignored, as vLLM does (clients send other servers' extras), but not silently:
``openai_api`` names them in the response's header and the log. vLLM's extra
sampling fields are accepted, ``structured_outputs`` among them, as is OpenAI's
``response_format`` (JSON schema or JSON object). A request field the gateway translates into
another (``response_format``'s schema into ``structured_outputs.json``) is remembered
(:meth:`_Sampling.field_names`), so that errors name the field the client sent.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from pagedserve.v1 import common_pb2, generation_pb2
from services.common.limits import FieldError
from services.gateway.api.openai.errors import json_type
from services.gateway.text.tool_parsers import ToolCallParser, ToolCalls, calls_schema

#: Prompts in one ``/v1/completions`` request (each is admitted as its own request).
MAX_PROMPTS_PER_REQUEST = 1024
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # (kept to be named: see ignored_fields)

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's and vLLM's extras)."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    # vLLM's older names for structured_outputs' json / regex / choice / grammar
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool | None = None  # vLLM's: beam search of width n
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    kv_retention_priority: int | None = None  # ours: keep this prefix cached longer (0..3)
    kv_pin_ttl_s: float | None = None  # ours: a session pin, seconds its blocks are kept
    # The request's name of a field the gateway translated into another (errors name it).
    _field_names: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def field_names(self) -> dict[str, str]:
        """Request fields by the internal names they were translated into (after the
        translation): ``{"structured_outputs.json": "response_format.json_schema.schema"}``."""
        return self._field_names

    def _refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "is only allowed with stream=true")

    def _sampling(self, logprobs: int | None) -> generation_pb2.SamplingParams:
        sp = generation_pb2.SamplingParams()
        for name in (
            "n",
            "max_tokens",
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "min_tokens",
            "ignore_eos",
            "repetition_penalty",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "use_beam_search",
            "length_penalty",
            "kv_retention_priority",
            "kv_pin_ttl_s",
        ):
            value = getattr(self, name)
            if value is not None:
                _set(sp, name, value)
        if self.seed is not None:
            _set(sp, "seed", self.seed)
        if self.stop is not None:
            sp.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.stop_token_ids:
            _set_repeated(sp.stop_token_ids, "stop_token_ids", self.stop_token_ids)
        if logprobs is not None:
            _set(sp, "logprobs", logprobs)
        for key, bias in (self.logit_bias or {}).items():
            digits = key.strip()  # (ASCII digits only: int() reads other scripts' too)
            plain = digits.isascii() and digits.isdigit() and len(digits) <= 10
            token = int(digits) if plain else -1
            if not 0 <= token < 2**32:
                raise FieldError(f"logit_bias[{key}]", "keys must be token ids in the vocabulary")
            if token in sp.logit_bias:
                raise FieldError(f"logit_bias[{key}]", f"names token {token} twice")
            sp.logit_bias[token] = bias
        if self.early_stopping is not None:
            es = self.early_stopping
            sp.early_stopping = str(es).lower() if isinstance(es, bool) else es
        self._structured(sp.structured_outputs)
        return sp

    def _structured(self, out: common_pb2.StructuredOutputs) -> None:
        """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` (one of them)."""
        guided = {
            k: v
            for k, v in (
                ("json", self.guided_json),
                ("regex", self.guided_regex),
                ("choice", self.guided_choice),
                ("grammar", self.guided_grammar),
            )
            if v is not None
        }
        if guided and self.structured_outputs:
            raise FieldError("structured_outputs", "give it or the guided_* fields, not both")
        rf, so = self.response_format, self.structured_outputs or guided
        if guided and not self.structured_outputs:
            self._field_names.update({f"structured_outputs.{k}": f"guided_{k}" for k in guided})
        if rf is not None and rf.get("type", "text") != "text":
            if so:
                raise FieldError("response_format", "give it or structured_outputs, not both")
            kind = rf.get("type")
            if kind == "json_object":
                out.json_object = True
                self._field_names["structured_outputs.json_object"] = "response_format"
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict):
                    raise FieldError("response_format.json_schema", "is required (an object)")
                field = "response_format.json_schema.schema"
                out.json = json.dumps(_schema(spec.get("schema"), field))
                self._field_names["structured_outputs.json"] = field
            else:
                raise FieldError("response_format.type", "must be text, json_object or json_schema")
        if not so:
            return
        given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise FieldError(
                "structured_outputs", f"give exactly one of {', '.join(_STRUCTURED_KEYS)}"
            )
        key = given[0]
        value = so[key]
        field = f"structured_outputs.{key}"
        if key == "json":
            out.json = value if isinstance(value, str) else json.dumps(value)
        elif key == "json_object":
            out.json_object = True
        elif key == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise FieldError(field, "must be a list of strings")
            out.choice.choices.extend(value)
        elif not isinstance(value, str):
            raise FieldError(field, "must be a string")
        else:
            setattr(out, key, value)

    def _request(self) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            request_id=self.request_id or "",
            priority=self.priority,
            cache_salt=self.cache_salt or "",
        )

    @property
    def prompt_only(self) -> bool:
        """``max_tokens: 0`` with ``echo`` (read before :meth:`to_generates` runs)."""
        return self.max_tokens == 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: vLLM's ``continuous_usage_stats``, which (as there)
        needs ``include_usage``."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_generates(self) -> list[generation_pb2.GenerateRequest]:
        """One request per prompt: ``prompt`` is a string, a list of token ids, or a batch of
        either (as lm-evaluation-harness sends with ``--batch_size``); the choices of prompt
        ``i`` get indexes ``i * n .. i * n + n - 1``, as in vLLM."""
        self._refuse_unsupported()
        if self.echo and self.stream:
            raise FieldError("echo", "is not supported with stream")
        if self.suffix:
            raise FieldError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise FieldError(
                "best_of", "must equal n (best-of is not supported; use_beam_search is)"
            )
        if self.max_tokens == 0:  # the prompt alone, scored (lm-evaluation-harness)
            if not self.echo:
                raise FieldError("max_tokens", "0 is only allowed with echo")
            self.max_tokens = 1  # one token is computed, then dropped from the reply
        prompt = self.prompt
        if not prompt:
            raise FieldError("prompt", "is empty")
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            prompts: list[Any] = [prompt]
            names = ["prompt"]
        else:
            prompts = list(prompt)
            names = [f"prompt[{i}]" for i in range(len(prompts))]
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise FieldError("prompt", f"{len(prompts)} prompts; at most {MAX_PROMPTS_PER_REQUEST}")
        sampling = self._sampling(self.logprobs)
        if self.echo and self.logprobs is not None:  # the prompt's own log-probabilities
            _set(sampling, "prompt_logprobs", self.logprobs)
        requests = []
        for i, (one, name) in enumerate(zip(prompts, names, strict=True)):
            req = self._request()
            if self.request_id and len(prompts) > 1:
                req.request_id = f"{self.request_id}-{i}"
            if not one:
                raise FieldError(name, "is empty")
            if isinstance(one, str):
                req.prompt = one
            elif isinstance(one, list) and all(isinstance(t, int) for t in one):
                _set_repeated(req.prompt_token_ids.ids, name, one)
            else:
                raise FieldError(name, "must be a string or a list of token ids")
            req.sampling_params.CopyFrom(sampling)
            requests.append(req)
        return requests


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    def add_to(self, messages: Any, index: int) -> None:
        """Append this message to a ``ChatMessages.messages`` (repeated ChatMessage)."""
        m = messages.add(role=self.role, content=_text(self.content, index))
        m.tool_call_id = self.tool_call_id or ""
        m.name = self.name or ""
        for j, call in enumerate(self.tool_calls or ()):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise FieldError(f"messages[{index}].tool_calls[{j}].function", "must have a name")
            arguments = fn.get("arguments", "{}")
            if not isinstance(arguments, str):  # (OpenAI sends a string; some clients do not)
                arguments = json.dumps(arguments)
            m.tool_calls.add(id=str(call.get("id") or ""), name=fn["name"], arguments=arguments)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # false: at most one call

    def tool_names(self) -> list[str]:
        """The names of the functions the request declares (unchecked: :meth:`tool_calls`
        refuses a malformed one)."""
        return [
            fn["name"]
            for tool in self.tools or ()
            if isinstance(fn := tool.get("function"), dict) and isinstance(fn.get("name"), str)
        ]

    def auto_tool_choice(self) -> bool:
        """Whether the model chooses between text and calls (``tool_choice`` ``auto``, OpenAI's
        default with tools)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def tool_calls(self, auto: ToolCallParser | None = None) -> ToolCalls | None:
        """The tool calls the reply must be (``tool_choice`` ``required`` or a named
        function), or None (no tools, ``none``, or ``auto``). ``auto`` needs the gateway's
        tool-call parser (``auto``), which reads the calls the model chose to make. A call
        required of no tools is refused, as OpenAI does."""
        choice = self.tool_choice
        fn = choice.get("function") if isinstance(choice, dict) else None
        named = isinstance(fn, dict) and choice.get("type", "function") == "function"
        if choice not in (None, "auto", "none", "required") and not named:
            raise FieldError(
                "tool_choice",
                'must be "auto", "required", "none" or '
                '{"type": "function", "function": {"name": ...}}',
            )
        if not self.tools:
            if choice == "required" or named:
                what = '"required"' if choice == "required" else "a named function"
                raise FieldError("tool_choice", f"{what} needs tools, and the request has none")
            return None
        if choice == "none":
            return None
        names: list[str] = []
        params: list[dict[str, Any]] = []
        for i, tool in enumerate(self.tools):
            fn_i = tool.get("function") if tool.get("type", "function") == "function" else None
            name_i = fn_i.get("name") if isinstance(fn_i, dict) else None
            if not isinstance(fn_i, dict) or not isinstance(name_i, str) or not name_i:
                raise FieldError(f"tools[{i}]", "must be a function with a name")
            field = f"tools[{i}].function.parameters"
            names.append(name_i)
            params.append(_schema(fn_i.get("parameters", {"type": "object"}), field))
        if self.auto_tool_choice():
            if auto is None:
                raise FieldError(
                    "tool_choice",
                    '"auto" (the default with tools) needs the server started with '
                    "--enable-auto-tool-choice and the --tool-call-parser of the model's "
                    "family (hermes: Qwen2.5, Qwen3, Hermes; llama3_json: Llama 3.1+); or give "
                    '"required", "none" or a named function',
                )
            return None
        if choice == "required":
            schema = calls_schema(names, params, self.parallel_tool_calls)
            one = "tools[0].function.parameters" if len(names) == 1 else "tools"
            return ToolCalls(None, schema, one)
        assert isinstance(fn, dict)
        name = fn.get("name")
        if name not in names:
            raise FieldError("tool_choice.function.name", f"no tool is named {name!r}")
        i = names.index(name)
        return ToolCalls(name, params[i], f"tools[{i}].function.parameters")

    def to_generate(self, auto: ToolCallParser | None = None) -> generation_pb2.GenerateRequest:
        """The request; ``auto``: the gateway's tool-call parser, if it has one."""
        self._refuse_unsupported()
        calls = self.tool_calls(auto)
        if calls is not None:
            if self.response_format or self.structured_outputs:
                raise FieldError("tool_choice", "cannot be combined with structured outputs")
            self.structured_outputs = {"json": calls.schema}
            self._field_names["structured_outputs.json"] = calls.field
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs=true")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        req = self._request()
        for i, m in enumerate(self.messages):
            m.add_to(req.messages.messages, i)
        req.messages.add_generation_prompt = self.add_generation_prompt
        if calls is not None or self.auto_tool_choice():  # the template shows the model its tools
            req.messages.tools.extend(json.dumps(t) for t in self.tools or ())
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        req.sampling_params.CopyFrom(self._sampling(logprobs))
        return req


class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages (with the tools a chat shows)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def to_tokenize(self) -> generation_pb2.TokenizeRequest:
        req = generation_pb2.TokenizeRequest()
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        if self.prompt is not None:
            if self.tools:
                raise FieldError("tools", "go with messages, not a prompt")
            req.text = self.prompt
            req.add_special_tokens = self.add_special_tokens
        else:
            assert self.messages is not None
            for i, m in enumerate(self.messages):
                m.add_to(req.messages.messages, i)
            req.messages.add_generation_prompt = self.add_generation_prompt
            req.messages.tools.extend(json.dumps(t) for t in self.tools or ())
        return req


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)

    def to_detokenize(self) -> generation_pb2.DetokenizeRequest:
        req = generation_pb2.DetokenizeRequest()
        _set_repeated(req.token_ids, "tokens", self.tokens)
        return req


def _schema(value: Any, field: str) -> Any:
    """A JSON schema given as ``field``: an object (or true / false)."""
    if value is None:
        raise FieldError(field, "is required")
    if not isinstance(value, dict | bool):
        hint = " (give the schema itself, not its JSON text)" if isinstance(value, str) else ""
        raise FieldError(field, f"must be a JSON schema object, not {json_type(value)}{hint}")
    return value


def _text(content: str | list[ContentPart] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise FieldError(
                f"messages[{index}].content[{j}]", f"only text parts are supported, got {part.type}"
            )
        parts.append(part.text)
    return "".join(parts)


def _set(msg: Any, name: str, value: Any) -> None:
    """Set a proto field, turning a value the field cannot hold (negative into unsigned,
    beyond 32 / 64 bits) into a FieldError naming it."""
    try:
        setattr(msg, name, value)
    except (ValueError, TypeError) as exc:
        raise FieldError(name, f"out of range: {value!r}") from exc


def _set_repeated(field: Any, name: str, values: list[int]) -> None:
    try:
        field.extend(values)
    except (ValueError, TypeError) as exc:
        raise FieldError(name, "token ids must be integers in [0, 2^32)") from exc
