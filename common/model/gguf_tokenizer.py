"""A GGUF file's tokenizer as a ``tokenizers`` tokenizer (``tokenizer.json``) and its config.

A GGUF stores the vocabulary, the merges, each token's type and the special ids as metadata
(``tokenizer.ggml.*``), under llama.cpp's names. ``tokenizer.ggml.model`` says which kind:
``gpt2`` is a byte-level BPE, built here from vocab + merges; the pre-tokenizer (how text is
split before the merges) comes from ``tokenizer.ggml.pre``, llama.cpp's name for the split
rules the vocabulary was trained with. SentencePiece vocabularies (``llama``) and unknown
split rules are refused in one line, as llama.cpp refuses a pre-tokenizer it does not know.
Tokens of type control become special added tokens (never split, hidden when decoding), and
user-defined ones plain added tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from common.model.gguf_file import GGUFError, GGUFModel

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_GPT2 = None  # ByteLevel's own regex (GPT-2's split)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = "digits"  # each digit alone, then GPT-2's split (StarCoder's vocabulary and its heirs)

# tokenizer.ggml.pre -> the split, as llama.cpp's llama-vocab.cpp groups them.
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
_IGNORE_MERGES = (_LLAMA3,)  # Llama 3's tokenizer takes a whole word found in the vocab before merging


def build_tokenizer(model: GGUFModel) -> tuple[Tokenizer, dict[str, Any]]:
    """(the tokenizer, tokenizer_config.json) of ``model``; GGUFError when pdserve cannot build it."""
    path = model.path
    kind = model.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model: {kind!r} tokenizers are not supported "
                        f"(pdserve builds 'gpt2', byte-level BPE)")
    pre = model.field("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: tokenizer.ggml.pre: {pre!r} is not a pre-tokenizer pdserve knows "
                        f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens: list[str] = list(model.field("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(model.field("tokenizer.ggml.merges") or [])
    if not tokens or not merges:
        raise GGUFError(f"{path}: tokenizer.ggml.{'tokens' if not tokens else 'merges'}: missing")
    types = list(model.field("tokenizer.ggml.token_type") or [1] * len(tokens))
    split = PRE_TOKENIZERS[pre]
    bpe = models.BPE(vocab={token: i for i, token in enumerate(tokens)},
                     merges=[_merge(path, m) for m in merges], ignore_merges=split in _IGNORE_MERGES)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(split)
    if split == _QWEN2:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tokenizer, _tokenizer_config(model, tokens)


def _merge(path: Any, merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise GGUFError(f"{path}: tokenizer.ggml.merges: {merge!r} is not two tokens separated by a space")
    return left, right


def _pre_tokenizer(split: str | None) -> pre_tokenizers.PreTokenizer:
    if split is _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _tokenizer_config(model: GGUFModel, tokens: list[str]) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = model.field(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(model.field("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(model.field("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": model.config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    template = model.field("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def stop_token_ids(model: GGUFModel) -> list[int]:
    """The ids that end generation: eos, and the end-of-turn / end-of-message tokens llama.cpp also stops on."""
    ids = [model.field(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return list(dict.fromkeys(int(i) for i in ids if isinstance(i, int)))
