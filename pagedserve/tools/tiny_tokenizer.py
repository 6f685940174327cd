"""A real, small byte-level BPE tokenizer for the tiny test checkpoints.

Trained with the ``tokenizers`` library on the English corpus below, deterministically (the
trainer breaks ties by pair, and the corpus and settings are fixed). Byte-level, so every
string, any UTF-8 included, round-trips. Special tokens: ``<s>`` (BOS, prepended by the
post-processor like Llama's tokenizer), ``</s>`` (EOS), ``<pad>``, and the chat role markers
used by :data:`CHAT_TEMPLATE`.

Each family's checkpoint carries a copy of its real chat template (:data:`FAMILY_TEMPLATES`,
reduced to string contents: no images or reasoning switches, tool calls in Qwen's alone), so
the gateway's chat path renders the conversation format of the model it serves; their markers
are plain text to this tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "FAMILY_TEMPLATES",
    "PAD",
    "ROLE_TOKENS",
    "build_tokenizer",
    "save_tokenizer",
]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 0.. in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Gemma 2/3: a system message is folded into the first user turn; "assistant" is "model".
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# Qwen2/Qwen3 (ChatML), with Qwen3's tools: their signatures in the system turn, an assistant
# turn's calls as <tool_call> blocks, tool results as <tool_response> blocks in a user turn.
_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if loop.first and message.content %}{{- '\n' }}{%- elif not loop.first %}"
    "{{- '\n' }}{%- endif %}"
    '{{- \'<tool_call>\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson if tool_call.arguments is not string "
    "else tool_call.arguments }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Phi-3 / Phi-4-mini.
_PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Mistral / Mixtral (v0.1 instruct): [INST] turns, a system message prefixed to the first.
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else -%}{{ message['content'] + eos_token }}{%- endif -%}"
    "{%- endfor -%}"
)
#: Tiny-model family (``make-tiny-model --arch``) -> the chat template its checkpoint carries.
FAMILY_TEMPLATES: dict[str, str] = {
    "llama": CHAT_TEMPLATE,
    "qwen2": _CHATML_TEMPLATE,
    "qwen3": _CHATML_TEMPLATE,
    "qwen3_moe": _CHATML_TEMPLATE,
    "mistral": _MISTRAL_TEMPLATE,
    "mixtral": _MISTRAL_TEMPLATE,
    "phi3": _PHI3_TEMPLATE,
    "gemma2": _GEMMA_TEMPLATE,
    "gemma3": _GEMMA_TEMPLATE,
    "gemma3_mm": _GEMMA_TEMPLATE,
}

DEFAULT_VOCAB_SIZE = 768

CORPUS = """\
The morning train left the station a little after seven. Most of the passengers were quiet,
reading the news or watching the fields roll past the window. A child near the back counted
the cows out loud, and nobody minded, because the numbers kept getting larger and sillier.
When the train reached the river, the sun came out from behind the clouds and the water
turned the color of polished silver.

A good cup of tea needs only three things: fresh water, a warm pot, and patience. Boil the
water, pour a little into the pot to warm it, and then add the leaves. Wait four or five
minutes before you pour. If you are in a hurry, the tea will be weak; if you forget it on
the table, it will be bitter. There is a lesson in that, though people rarely agree on
which one it is.

Computers store text as numbers. Each letter, digit, and symbol is given a code, and the
codes are written as bytes. Some characters need one byte and some need several, which is
why a careful program never cuts a string in the middle of a character. A tokenizer breaks
text into pieces that a language model can read. Common words become single tokens, while
rare words are split into smaller parts, and any unusual byte can still be represented.

The library on the hill opened at nine and closed at five. Its reading room had tall windows,
long wooden tables, and a clock that was always three minutes slow. Students came to study
history, mathematics, chemistry, and music. The librarian knew every shelf by heart and could
find a lost book faster than anyone could describe it.

In the spring the garden was full of small surprises. Tulips came up where no one remembered
planting them, a robin built a nest in the old kettle by the shed, and the apple tree, which
had not flowered for years, was suddenly covered in white and pink blossoms. My grandmother
said the garden was simply paying us back for a long winter of waiting.

How does a server answer many requests at once? It keeps a queue of work and a pool of
workers. Each worker takes the next task, finishes it, and returns for another. When the
queue grows, the server can add workers or ask clients to wait. A well designed system
measures its own speed, reports its errors clearly, and fails in ways that are easy to
understand and recover from.

She asked him what he wanted to be when he grew up. He thought about it for a long time and
then said that he wanted to be the person who paints the lines on the road, because those
people always seem to know exactly where they are going. She laughed, and then she admitted
that it was a better answer than most adults would give.

Numbers and dates appear everywhere: the meeting starts at 10:30, the report is due on
March 14, and the budget for the year is 2,450 dollars. The recipe serves 4 people and takes
45 minutes. Questions end with a question mark? Exclamations end with a bang! Lists use
commas, semicolons; and sometimes dashes - like this one.

The old sailor told stories about storms, islands, and strange lights over the sea. Some of
the stories were true, some were borrowed, and a few were invented on the spot. The children
did not care which were which. They sat on the dock until the sky went dark, listening to
the waves and the creak of the boats, and asking for just one more story before bed.

A user says: Hello! Can you help me write a short poem about the ocean? The assistant says:
Of course. The ocean hums a patient tune, it keeps the time for sun and moon. Is there
anything else I can help you with today? The user says: Thank you, that is lovely.

Café, naïve, façade, jalapeño, and crème brûlée are words that English borrowed from other
languages. Some writers keep the accents and some do not. Either way, the meaning stays
the same, and a careful reader will understand the sentence.
"""


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE tokenizer on :data:`CORPUS` (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tokenizer(
    tokenizer: Tokenizer,
    model_dir: str | Path,
    *,
    model_max_length: int,
    chat_template: str = CHAT_TEMPLATE,
) -> None:
    """Write the tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat
    template, ...) so that ``AutoTokenizer.from_pretrained(model_dir)`` loads it.
    """
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(model_dir))
