"""Tokenizer round trips, chat templates, and streaming detokenization on the embedded model's tokenizer."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from common.engine.async_engine import AsyncLLMEngine
from common.engine.sampling_params import SamplingParams
from common.engine.text_stream import TextStream
from common.model.config import ModelFilesError
from common.model.detokenizer import IncrementalDetokenizer
from common.model.embedded import ensure_embedded_model
from common.model.tokenizer import ChatTemplateError, Tokenizer

TEXTS = ["def hello():\n    return 1", "héllo wörld ✓ 日本語 🙂", "  leading spaces and\ttabs\n\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_special_tokens_and_vocab(tok):
    assert tok.vocab_size == 2048
    assert tok.eos_token_ids == [1, 3]  # </s>, then generation_config's <|im_end|>
    assert tok.decode([0, 2, 3], skip_special_tokens=False) == "<s><|im_start|><|im_end|>"
    assert tok.decode([0, 2, 3]) == ""


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    assert tok.encode(text, add_special_tokens=False).count(2) == 3  # <|im_start|> is one token


def test_chat_template_errors(model_dir, tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "a"}])
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelFilesError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def stream(tok, ids, prompt=None, chunk=1):
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_deltas_hold_back_partial_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, rest = stream(tok, ids, prompt=tok.encode("Say:"))
    assert "".join(deltas) == text and rest == ""
    assert not any(d.endswith("\ufffd") for d in deltas)


def test_detokenizer_matches_full_decode_on_random_ids(tok):
    rng = random.Random(0)
    for trial in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        deltas, rest = stream(tok, ids, prompt=[rng.randrange(tok.vocab_size) for _ in range(8)], chunk=1 + trial % 3)
        assert "".join(deltas) + rest == tok.decode(ids), ids


def test_detokenizer_decodes_a_small_window(tok):
    ids = tok.encode("word " * 300, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.add([i])
        assert len(detok.token_ids) - detok.prefix_offset <= 4


def test_detokenizer_text_depends_on_the_ids_not_on_their_grouping(tok):
    """The text out after each group is the text one-at-a-time adds give at that point: a group
    ending inside a multi-byte character still returns the complete text before it."""
    ids = tok.encode("abc 日本語 🙂 done", add_special_tokens=False)
    one_by_one = IncrementalDetokenizer(tok)
    after = [""]
    for i in ids:
        after.append(after[-1] + one_by_one.add([i]))
    rng = random.Random(1)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randrange(0, 4)))
        detok, text = IncrementalDetokenizer(tok), ""
        for start, end in zip([0, *cuts], [*cuts, len(ids)]):
            text += detok.add(ids[start:end])
            assert text == after[end], (cuts, end)


def test_replayed_ids_ending_inside_a_character_are_not_shown_again(tok):
    """A migrated request's node replays the ids the client has (common/serving/resume.py); when the
    last of them is half a character, the next token's text follows on, nothing is repeated."""
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode("hello 日本語 world", add_special_tokens=False)
    partial = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    original = TextStream(tok, prompt, [])
    client = "".join(original.add([i], False)[0] for i in ids[:partial])
    assert client and not client.endswith("\ufffd")
    params = SamplingParams(max_tokens=8, resumed_tokens=partial)
    resumed = AsyncLLMEngine._text_stream(SimpleNamespace(tokenizer=tok), prompt + ids[:partial], params)
    rest = "".join(resumed.add([i], i == ids[-1])[0] for i in ids[partial:])
    assert client + rest == tok.decode(ids)
