"""The checkpoint's tokenizer: an optional ``tokenizer.json`` beside ``config.json``.

Read with the Hugging Face ``tokenizers`` library and checked once against the
model: every id it can produce must lie in the model's vocabulary. A checkpoint
without one is fine (prompts are token ids); a corrupt one, or one with ids past
``vocab_size``, is a ``CheckpointError`` naming the file.

Encoding adds special tokens only where the tokenizer's own post-processor does
(the tiny-trained model learnt raw id phrases, with no BOS in front); decoding
leaves special tokens (BOS, EOS) out of the text.

``byte_level_tokenizer`` builds the one shipped with ``builtin:tiny-trained``:
id 0 ``<bos>``, id 1 ``<eos>``, ids 2..255 the bytes 0x02..0xff (id = byte value,
so ASCII text reads as its own codes). Regenerate the shipped file with::

    .venv/bin/python -c "from pathlib import Path; from nextn_graph.checkpoint.tokenizer import \\
        byte_level_tokenizer, write_tokenizer; \\
        write_tokenizer(byte_level_tokenizer(), Path('nextn_graph/data/tiny-trained'))"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ..errors import CheckpointError, InputError, show_value
from ..textfile import read_text

TOKENIZER_FILE = "tokenizer.json"

# The byte-level tokenizer's special tokens, at the tiny config's bos/eos ids.
BYTE_SPECIALS = {"<bos>": 0, "<eos>": 1}
BYTE_VOCAB_SIZE = 256


@dataclass(frozen=True)
class CheckpointTokenizer:
    """A checkpoint's ``tokenizer.json``, already checked against the model's vocabulary."""

    path: Path
    tokenizer: Tokenizer

    def encode(self, text: str, where: str) -> list[int]:
        """Token ids of ``text``; ``where`` (the prompt's file:line, or a request's field)
        names it in errors, which say what is wrong with the text and never name this
        file (a server's client must not learn its paths). Special tokens only where the
        tokenizer's post-processor adds them."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # (JSON's \ud800 escape makes such a string)
            raise InputError(f"{where}: the text is not valid Unicode: character "
                             f"{exc.start} is a lone surrogate "
                             f"{ascii(text[exc.start])} (half of a UTF-16 pair)") from None
        if not text:
            raise InputError(f"{where}: the text is empty: it encodes to no tokens")
        try:
            ids = self.tokenizer.encode(text).ids
        except Exception as exc:  # the library raises bare Exception
            raise InputError(f"{where}: the tokenizer cannot encode the text "
                             f"({show_value(str(exc), 120)})") from None
        if not ids:
            raise InputError(f"{where}: text {show_value(text, 40)} encodes to no tokens "
                             f"(the tokenizer drops each of its characters)")
        return ids

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (``decode`` leaves them out)."""
        return frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items()
                         if t.special)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out. Never raises for an id in the
        model's vocabulary: ids the tokenizer lacks are skipped, and bytes that are
        not UTF-8 (a byte-level tokenizer cut mid-character) become U+FFFD."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)


def load_tokenizer(root: Path, vocab_size: int) -> CheckpointTokenizer | None:
    """``root/tokenizer.json`` checked against a model of ``vocab_size`` ids; None when
    the directory has none."""
    path = Path(root) / TOKENIZER_FILE
    if not path.exists():
        return None
    text = read_text(path, "tokenizer", CheckpointError)
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the library raises bare Exception for any bad file
        raise CheckpointError(f"{path}: not a tokenizers tokenizer.json "
                              f"({show_value(str(exc), 120)})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)  # token -> id
    if not vocab:
        raise CheckpointError(f"{path}: the tokenizer has an empty vocabulary")
    token, top = max(vocab.items(), key=lambda item: item[1])
    if top >= vocab_size:
        raise CheckpointError(f"{path}: token {show_value(token, 40)} has id {top}, outside "
                              f"the model's vocabulary [0, {vocab_size}) (config.json "
                              f"vocab_size)")
    return CheckpointTokenizer(path, tokenizer)


def _byte_chars() -> list[str]:
    """The byte-level alphabet in byte order: the printable character that stands for
    each byte 0..255 (GPT-2's mapping, what the ByteLevel pre-tokenizer emits)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # bytes that stand for themselves
    moved = [b for b in range(BYTE_VOCAB_SIZE) if b not in kept]
    chars = {b: chr(b) for b in kept}
    chars.update({b: chr(BYTE_VOCAB_SIZE + i) for i, b in enumerate(moved)})
    return [chars[b] for b in range(BYTE_VOCAB_SIZE)]


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level tokenizer over ids 0..255: ``<bos>`` 0, ``<eos>`` 1, byte b at id b
    for b >= 2. No merges and no post-processor (encoding adds no BOS). The bytes 0x00
    and 0x01 have no id (theirs are the special tokens) and are dropped on encoding."""
    vocab = dict(BYTE_SPECIALS)
    vocab.update({char: b for b, char in enumerate(_byte_chars()) if b >= len(BYTE_SPECIALS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # One "word" per text, split into bytes: with no merges each byte is one token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in BYTE_SPECIALS])
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, root: Path) -> Path:
    """``root/tokenizer.json``, pretty-printed (a diff of the shipped file stays readable)."""
    path = Path(root) / TOKENIZER_FILE
    try:
        path.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write the tokenizer "
                              f"({exc.strerror or exc})") from None
    return path
