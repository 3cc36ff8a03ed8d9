"""Text in, text out: a checkpoint's ``tokenizer.json`` (issue 10, item 6).

Tokenizers here are built with the ``tokenizers`` library itself (a WordLevel
one over a few words) inside copies of a tiny random checkpoint; the shipped
``builtin:tiny-trained`` has the byte-level one from ``byte_level_tokenizer``.
Generation runs ``--mode reference`` with a few new tokens, so each test is quick.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import nextn_graph.cli.commands as cli
from nextn_graph.checkpoint import load_checkpoint, random_models, resolve_checkpoint, \
    save_checkpoint
from nextn_graph.cli import main
from nextn_graph.errors import CheckpointError
from nextn_graph.model import load_config
from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.checkpoint.tokenizer import TOKENIZER_FILE, byte_level_tokenizer, load_tokenizer, \
               write_tokenizer

WORDS = {"<unk>": 2, "the": 10, "cat": 11, "sat": 12, "on": 13, "mat": 14, "dog": 200}
# Every other id of the tiny model's 256 gets a filler word, so any output decodes to words.
ALL_WORDS = {**{f"w{i}": i for i in range(256) if i not in WORDS.values()}, **WORDS}
SENTENCE = "the cat sat on the mat"


def word_tokenizer(vocab: dict[str, int] = ALL_WORDS) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """A tiny random checkpoint (vocab 256) with no tokenizer.json."""
    return save_checkpoint(random_models(preset_config("tiny"), seed=0),
                           tmp_path_factory.mktemp("tok") / "bare")


def with_tokenizer(bare: Path, dest: Path, content: Tokenizer | str) -> Path:
    """A copy of ``bare`` with a tokenizer.json: a built tokenizer, or raw file text."""
    shutil.copytree(bare, dest)
    if isinstance(content, str):
        (dest / TOKENIZER_FILE).write_text(content)
    else:
        write_tokenizer(content, dest)
    return dest


@pytest.fixture(scope="module")
def worded(bare, tmp_path_factory) -> Path:
    return with_tokenizer(bare, tmp_path_factory.mktemp("tok") / "worded", word_tokenizer())


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run_json(capsys, ckpt: Path, *given: str, new: int = 6) -> list[dict]:
    rc = main(["generate", "--checkpoint", str(ckpt), *given, "--max-new-tokens", str(new),
               "--mode", "reference", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)["requests"]


def _error(capsys, argv: list[str]) -> str:
    """Exit 2 with one 'nextn-graph: error:' line on stderr, no traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nextn-graph: error: "), err
    return lines[0]


# -- generate with text -------------------------------------------------------------------

def test_text_prompt_equals_its_encoded_ids(worded, tmp_path, capsys):
    """A {"text": ...} line generates exactly what its encoded ids do; the JSON output
    carries the ids it used, prompt_text for the text line only, and text on both."""
    ids = word_tokenizer().encode(SENTENCE).ids
    assert ids == [10, 11, 12, 13, 10, 14]
    as_text = _run_json(capsys, worded, "--prompts",
                        str(_jsonl(tmp_path / "t.jsonl", [{"text": SENTENCE}])))
    as_ids = _run_json(capsys, worded, "--prompts",
                       str(_jsonl(tmp_path / "i.jsonl", [{"input_ids": ids}])))
    assert as_text[0]["input_ids"] == as_ids[0]["input_ids"] == ids
    assert as_text[0]["output_ids"] == as_ids[0]["output_ids"]
    assert as_text[0]["prompt_text"] == SENTENCE and "prompt_text" not in as_ids[0]
    names = {i: word for word, i in ALL_WORDS.items()}
    want = " ".join(names[i] for i in as_text[0]["output_ids"])  # WordLevel joins with spaces
    assert as_text[0]["text"] == as_ids[0]["text"] == want


def test_prompt_option_equals_prompts_file(worded, tmp_path, capsys):
    """--prompt TEXT (repeated) gives the requests a JSONL of text lines gives, in order."""
    texts = [SENTENCE, "dog sat", "cat"]
    by_option = _run_json(capsys, worded, *[a for t in texts for a in ("--prompt", t)])
    by_file = _run_json(capsys, worded, "--prompts",
                        str(_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in texts])))
    assert by_option == by_file
    assert [r["prompt_text"] for r in by_option] == texts


def test_mixed_lines_and_plain_output_print_text(worded, tmp_path, capsys):
    """Text and id lines mix in one file; without --json each request line shows its
    output ids and its decoded text."""
    path = _jsonl(tmp_path / "p.jsonl", [{"text": "cat sat"}, {"input_ids": [14, 200]}])
    rc = main(["generate", "--checkpoint", str(worded), "--prompts", str(path),
               "--max-new-tokens", "4", "--mode", "reference"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 3
    requests = _run_json(capsys, worded, "--prompts", str(path), new=4)
    for i, req in enumerate(requests):
        assert lines[i] == f"request {i}: {req['output_ids']}  text: {json.dumps(req['text'])}"


def test_id_prompts_without_tokenizer_print_no_text(bare, tmp_path, capsys):
    """A checkpoint with no tokenizer.json: id prompts work as before, no text keys."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7]}])
    req = _run_json(capsys, bare, "--prompts", str(path), new=3)[0]
    assert set(req) == {"input_ids", "output_ids"}


# -- the shipped byte-level tokenizer --------------------------------------------------------

def test_builtin_tiny_trained_round_trips_ascii():
    """builtin:tiny-trained ships a tokenizer: ASCII text encodes to its byte values (no
    BOS added) and decodes back; <bos>/<eos> sit at config.json's ids and drop out of text."""
    root = resolve_checkpoint("builtin:tiny-trained")
    cfg = load_config(root)
    tok = load_tokenizer(root, cfg.vocab_size)
    assert tok is not None
    text = string.printable  # letters, digits, punctuation, whitespace
    ids = tok.encode(text, "test")
    assert ids == list(text.encode("ascii"))
    assert tok.decode(ids) == text
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    assert (vocab["<bos>"], vocab["<eos>"]) == (cfg.bos_token_id, cfg.eos_token_id)
    assert tok.decode([cfg.bos_token_id, *ids, cfg.eos_token_id]) == text
    assert tok.encode("wörld ✓", "test") == list("wörld ✓".encode())


def test_shipped_tokenizer_is_the_builders():
    """The shipped file is what byte_level_tokenizer builds (regenerable), over ids 0..255."""
    shipped = Tokenizer.from_file(str(resolve_checkpoint("builtin:tiny-trained") / TOKENIZER_FILE))
    assert shipped.to_str() == byte_level_tokenizer().to_str()
    assert sorted(shipped.get_vocab(with_added_tokens=True).values()) == list(range(256))


def test_decode_never_raises_on_model_ids(bare, tmp_path):
    """Every id of the model's vocabulary decodes: cut UTF-8 becomes U+FFFD (byte level),
    ids a tokenizer lacks are skipped (WordLevel)."""
    byte = load_tokenizer(resolve_checkpoint("builtin:tiny-trained"), 256)
    assert all(isinstance(byte.decode([i]), str) for i in range(256))
    assert byte.decode([ord("a"), 0xE2, 0x9C, ord("b")]) == "a\ufffdb"  # "✓" cut short
    few = with_tokenizer(bare, tmp_path / "few", word_tokenizer(WORDS))
    words = load_tokenizer(few, 256)
    assert words.decode(list(range(256))) == "<unk> the cat sat on mat dog"
    assert words.decode([3, 4, 255]) == ""


def test_trained_preset_writes_tokenizer(tmp_path, monkeypatch, capsys):
    """make-checkpoint --preset tiny-trained writes the byte-level tokenizer.json beside the
    weights, and writes over its own output again; --preset tiny writes none. Training
    takes minutes, so the trained models are swapped for random ones here; the
    tokenizer step is what is under test."""
    monkeypatch.setattr(cli, "make_trained",
                        lambda seed: random_models(preset_config("tiny"), seed))
    out = tmp_path / "trained"
    for _ in range(2):  # the second replaces the first, its tokenizer.json included
        assert main(["make-checkpoint", "--preset", "tiny-trained", "--out", str(out)]) == 0
    capsys.readouterr()
    written = Tokenizer.from_file(str(out / TOKENIZER_FILE))
    assert written.to_str() == byte_level_tokenizer().to_str()
    load_checkpoint(out)  # the weights load with the tokenizer beside them
    req = _run_json(capsys, out, "--prompt", "abc", new=2)[0]
    assert req["input_ids"] == [97, 98, 99] and isinstance(req["text"], str)
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "t")]) == 0
    assert not (tmp_path / "t" / TOKENIZER_FILE).exists()


# -- errors name what is wrong ---------------------------------------------------------------

def test_text_prompt_without_tokenizer_names_line(bare, tmp_path, capsys):
    """A text prompt on a checkpoint with no tokenizer.json: the line (or --prompt) named."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5]}, {"text": "hi"}])
    line = _error(capsys, ["generate", "--checkpoint", str(bare), "--prompts", str(path),
                           "--max-new-tokens", "2"])
    assert f"{path}:2: a text prompt, but the checkpoint {bare} has no tokenizer.json" in line
    line = _error(capsys, ["generate", "--checkpoint", str(bare), "--prompt", "hi",
                           "--max-new-tokens", "2"])
    assert "--prompt #1: a text prompt" in line and "no tokenizer.json" in line


@pytest.mark.parametrize("content, needles", [
    (word_tokenizer({**WORDS, "big": 300}), ["'big' has id 300", "[0, 256)", "vocab_size"]),
    ("{not json", ["not a tokenizers tokenizer.json", "key must be a string"]),
    ('{"version": "1.0"}', ["not a tokenizers tokenizer.json", "Model missing"]),
    ("[1, 2]", ["not a tokenizers tokenizer.json"]),
], ids=["id_past_vocab", "malformed_json", "no_model", "not_an_object"])
def test_bad_tokenizer_is_checkpoint_error(bare, tmp_path, capsys, content, needles):
    """A tokenizer.json with ids >= vocab_size, or one that is not a tokenizer, is a
    CheckpointError naming the file, even for id prompts."""
    ckpt = with_tokenizer(bare, tmp_path / "ckpt", content)
    with pytest.raises(CheckpointError) as exc:
        load_tokenizer(ckpt, 256)
    assert str(exc.value).startswith(f"{ckpt / TOKENIZER_FILE}: ")
    for needle in needles:
        assert needle in str(exc.value)
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6]}])
    line = _error(capsys, ["generate", "--checkpoint", str(ckpt), "--prompts", str(path),
                           "--max-new-tokens", "2", "--mode", "reference"])
    assert str(ckpt / TOKENIZER_FILE) in line


def test_no_tokenizer_file_is_none(bare):
    """No tokenizer.json is not an error: prompts are token ids then."""
    assert load_tokenizer(bare, 256) is None


@pytest.mark.parametrize("row, needle", [
    ({"text": "cat", "input_ids": [5]}, ', not both'),
    ({"text": ["cat"]}, '"text" must be a string'),
    ({"text": ""}, "encodes to no tokens"),
    ({}, 'expected {"input_ids": [int, ...]} or {"text": "..."}'),
    ({"text": "cat", "stop_ids": [1]}, "unknown key 'stop_ids'"),
], ids=["both_keys", "text_not_string", "empty_text", "empty_object", "unknown_key"])
def test_bad_text_line_names_line(worded, tmp_path, capsys, row, needle):
    """A malformed line, text ones included, is refused naming FILE:LINE and the problem."""
    path = _jsonl(tmp_path / "p.jsonl", [{"text": "cat"}, row])
    line = _error(capsys, ["generate", "--checkpoint", str(worded), "--prompts", str(path),
                           "--max-new-tokens", "2", "--mode", "reference"])
    assert f"{path}:2: " in line and needle in line


@pytest.mark.parametrize("given, needle", [
    ([], "one of the arguments --prompts --prompt is required"),
    (["--prompts", "p.jsonl", "--prompt", "hi"],
     "argument --prompt: not allowed with argument --prompts"),
], ids=["neither", "both"])
def test_prompts_and_prompt_exactly_one(capsys, given, needle):
    """generate takes exactly one of --prompts FILE and --prompt TEXT; argparse refuses
    neither or both before any work, naming the options."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--checkpoint", "builtin:tiny-trained", *given,
              "--max-new-tokens", "2"])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
