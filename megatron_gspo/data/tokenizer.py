"""Tokenizers: the built-in synthetic ones, a byte-level one, and loading a Hugging Face
directory.

Both built-in tokenizers are made in code from a ``tokenizers`` model and wrapped in
``transformers.PreTrainedTokenizerFast``, so every Hugging Face code path (``apply_chat_template``,
``save_pretrained``, ``AutoTokenizer.from_pretrained``) works on them without a hub download.

Synthetic vocabulary (15 tokens, ids fixed so that a digit's id is the digit itself)::

    0..9   "0".."9"
    10     <pad>
    11     <bos>
    12     <eos>
    13     <sep>     ends a prompt of the synthetic tasks
    14     <unk>

The tool task (``multiply``, :mod:`megatron_gspo.envs.multiply`) adds six tokens::

    15     *
    16     <call>      a tool call starts
    17     </call>     a tool call ends (and with it the model's turn)
    18     <result>    the tool's output starts
    19     </result>   the tool's output ends
    20     <error>     the tool failed
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from megatron_gspo.config import ConfigError, DataConfig, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DIGIT_TOKENS = tuple(str(digit) for digit in range(10))
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, SEP_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<sep>", "<unk>"
SYNTHETIC_VOCAB: dict[str, int] = {
    **{token: digit for digit, token in enumerate(DIGIT_TOKENS)},
    PAD_TOKEN: 10,
    BOS_TOKEN: 11,
    EOS_TOKEN: 12,
    SEP_TOKEN: 13,
    UNK_TOKEN: 14,
}
TOOL_TOKENS: dict[str, int] = {
    "*": 15,
    "<call>": 16,
    "</call>": 17,
    "<result>": 18,
    "</result>": 19,
    "<error>": 20,
}
TOOL_TASKS = ("multiply",)
"""Synthetic tasks whose prompts and tools use :data:`TOOL_TOKENS`."""
SEP_TOKEN_ID = SYNTHETIC_VOCAB[SEP_TOKEN]
EOS_TOKEN_ID = SYNTHETIC_VOCAB[EOS_TOKEN]
PAD_TOKEN_ID = SYNTHETIC_VOCAB[PAD_TOKEN]

# Renders the user turns verbatim: the synthetic prompts are already in the model's format, and the
# template only exists so that chat-template code paths can run on this tokenizer.
SYNTHETIC_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% endif %}{% endfor %}"
)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, the format of the Qwen family.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML with tools in the Qwen 2.5 / Hermes form: the tools' JSON schemas in a system message,
# an assistant's calls as <tool_call> JSON blocks (what rollout/tool_calls.py's "hermes" format
# parses back), tool results as <tool_response> blocks in a user turn.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\n</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls', []) %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + "
    "(call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_synthetic_tokenizer(with_tool_tokens: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of the synthetic digit tasks: one token per character, ids as in the module
    docstring. Text is split into single characters; ``<pad>``/``<bos>``/``<eos>``/``<sep>`` are
    special tokens; any other character becomes ``<unk>``. ``decode`` concatenates without spaces.
    ``with_tool_tokens`` adds the tool task's six tokens (21 in all)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**SYNTHETIC_VOCAB, **(TOOL_TOKENS if with_tool_tokens else {})}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tags = [token for token in TOOL_TOKENS if token.startswith("<")] if with_tool_tokens else []
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        sep_token=SEP_TOKEN,
        unk_token=UNK_TOKEN,
        **({"additional_special_tokens": tags} if tags else {}),
    )
    tokenizer.chat_template = SYNTHETIC_CHAT_TEMPLATE
    _check_ids(tokenizer, vocab)
    return tokenizer


def build_byte_tokenizer(chat_template: Optional[str] = CHATML_TEMPLATE) -> PreTrainedTokenizerBase:
    """A byte-level tokenizer for arbitrary text with no merges: one token per UTF-8 byte (ids
    0..255, GPT-2's byte-to-character alphabet) plus ``<|endoftext|>`` (256, eos and pad),
    ``<|im_start|>`` (257) and ``<|im_end|>`` (258). 259 tokens; lossless on any text.

    For tests and examples with text datasets and a tiny random model (``model.vocab_size`` >= 259).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_character)
    vocab = {character: index for index, character in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = chat_template
    _check_ids(tokenizer, {"<|endoftext|>": 256, IM_START: 257, IM_END: 258})
    return tokenizer


def _byte_of_character(character: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68 bytes
    to the code points 256, 257, ... in byte order."""
    code = ord(character)
    if code < 256:
        return code
    unprintable = [b for b in range(256) if not _gpt2_printable(b)]
    return unprintable[code - 256]


def _gpt2_printable(byte: int) -> bool:
    return ord("!") <= byte <= ord("~") or ord("¡") <= byte <= ord("¬") or ord("®") <= byte <= 255


def _check_ids(tokenizer: PreTrainedTokenizerBase, expected: dict[str, int]) -> None:
    # The synthetic task, its reward and saved checkpoints depend on these exact ids.
    for token, token_id in expected.items():
        actual = tokenizer.convert_tokens_to_ids(token)
        if actual != token_id:
            raise RuntimeError(f"tokenizer gave {token!r} id {actual}, expected {token_id}")


def build_tokenizer(data: DataConfig, model: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer for a run: the synthetic one when ``data.train_path`` is null, otherwise the
    Hugging Face tokenizer in ``data.tokenizer_path`` (or ``model.hf_path``). Checks that every token
    id fits in ``model.vocab_size``."""
    tokenizer, source = load_tokenizer(data, model)
    logger.info("tokenizer: %s, %d tokens", source, len(tokenizer))
    return tokenizer


def load_tokenizer(data: DataConfig, model: ModelConfig) -> tuple[PreTrainedTokenizerBase, str]:
    """:func:`build_tokenizer` without the log line (the start-up checks call it too), and where
    the tokenizer came from."""
    if data.train_path is None:
        if data.tokenizer_path is not None:
            raise ConfigError(
                "data.tokenizer_path",
                f"{data.tokenizer_path!r} given with the synthetic task {data.task!r}",
                "the synthetic tasks use their own 15-token tokenizer, whose ids the task and its "
                "reward depend on",
                "remove data.tokenizer_path, or set data.train_path to a prompt file",
            )
        tokenizer = build_synthetic_tokenizer(with_tool_tokens=data.task in TOOL_TASKS)
        source = f"built-in synthetic tokenizer ({data.task})"
    else:
        path = data.tokenizer_path or model.hf_path
        if path is None:
            raise ConfigError(
                "data.tokenizer_path",
                "no tokenizer for the prompt file",
                f"data.train_path={data.train_path!r} holds text that must be tokenized",
                "set data.tokenizer_path (or model.hf_path) to a Hugging Face model directory",
            )
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise ConfigError(
                "data.tokenizer_path",
                f"cannot load a tokenizer from {path!r}: {error}",
                "a tokenizer directory needs tokenizer.json or tokenizer_config.json",
                "point data.tokenizer_path at a Hugging Face model directory",
            ) from error
        source = path
    if len(tokenizer) > model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{model.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens ({source})",
            "every token id needs a row in the embedding",
            f"set model.vocab_size >= {len(tokenizer)}",
        )
    return tokenizer, source
