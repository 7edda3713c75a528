"""The byte tokenizer as a standard transformers tokenizer: ``tokenizer.json`` and its config files.

Its ids and chat template equal ``ByteTokenizer``'s, so a trained checkpoint loads with ``AutoTokenizer`` and
behaves as a preset's tokenizer does. It is a byte-level BPE with no merges: every byte is a token of its own.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from minifaas.model.tokenizer import ByteTokenizer

RESERVED = tuple(f"<|reserved_{i}|>" for i in range(ByteTokenizer.vocab_size - 256 - len(ByteTokenizer.SPECIALS)))

# ByteTokenizer.chat, as a template: bos, then "<|im_start|>role\ncontent<|im_end|>\n" per message
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_characters() -> list[str]:
    """The printable character the byte-level pre-tokenizer maps each byte to: a byte that prints as itself keeps
    its code point, the others take code points from 256 up, in byte order (GPT-2's mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_byte_tokenizer(directory: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and the special tokens."""
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(byte_characters())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*ByteTokenizer.SPECIALS, *RESERVED])
    bos, eos, pad, *_ = ByteTokenizer.SPECIALS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, chat_template=CHAT_TEMPLATE
    )
    if len(fast) != ByteTokenizer.vocab_size:
        raise RuntimeError(f"byte tokenizer has {len(fast)} ids, expected {ByteTokenizer.vocab_size}")
    fast.save_pretrained(str(directory))
