"""GGUF checkpoints: our conversion against transformers' GGUF loader, the tokenizer a file
describes, every quant type we claim, and bad files refused in one line naming the file and field.

The files are tiny random models written by tests/helpers/gguf_checkpoints.py with gguf's own
writer (Llama with permuted Q/K as llama.cpp writes it, and Qwen2 with biases), so a second
family and the quant types are covered without a download.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from tokenizers import Tokenizer as HFTokenizer

from common.model.embedded import ensure_embedded_model
from common.model.gguf_convert import dequantize_tensor, ensure_converted, unpermute_rows
from common.model.gguf_file import GGUFError, open_reader
from common.model.loader import load_model
from common.model.sources import check_model_spec, resolve_model
from common.model.tokenizer import Tokenizer
from helpers.gguf_checkpoints import add_tensor, llama_cpp_permute, write_gguf
from helpers.paged_cache import PagedCache

ROOT = Path(__file__).resolve().parents[3]
CASES = [("llama", "Q4_1"), ("llama", "Q8_0"), ("qwen2", "Q8_0"), ("qwen2", "Q4_0")]
TEXTS = ["Hello, world!", "def f(x):\n    return x ** 2  # 12345", "  two  spaces\tand a tab",
         "<|im_start|>user\nhi<|im_end|>", "naïve café — ünïcödé"]


def hf_from_gguf(file: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                              dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def converted(request, tmp_path_factory):
    arch, qtype = request.param
    tmp = tmp_path_factory.mktemp(f"{arch}-{qtype}")
    file = write_gguf(tmp / f"tiny-{arch}.{qtype}.gguf", arch, qtype, seed=len(qtype))
    return file, ensure_converted(file, tmp / "cache")


def test_logits_equal_transformers_loading_the_same_gguf(converted) -> None:
    """Prefill, then decode token by token: our logits are transformers' (fp32), top-5 logprobs within 1e-3."""
    file, directory = converted
    ours, _ = load_model(directory)
    hf = hf_from_gguf(file)
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = PagedCache(ours)
    seq = cache.new_seq(ids)
    cache.step([(seq, 24)])
    for _ in range(16):
        cache.step([(seq, 1)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = torch.stack(seq.outputs)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    ref_lp, got_lp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    top = ref_lp.topk(5, dim=-1)
    assert torch.equal(got_lp.topk(5, dim=-1).indices, top.indices)
    assert (got_lp.gather(-1, top.indices) - top.values).abs().max().item() <= 1e-3


def test_converted_directory_holds_what_the_metadata_says(converted) -> None:
    file, directory = converted
    tok = Tokenizer.from_dir(directory)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert (tok.bos_token, tok.eos_token, tok.eos_token_ids) == ("<s>", "</s>", [1])
    assert "lm_head.weight" in load_file(directory / "model.safetensors")  # untied in these files


def test_byte_level_tokenizer_equals_the_one_it_was_written_from(tmp_path) -> None:
    """The embedded tokenizer's vocab and merges in a GGUF come back as the same tokenizer."""
    file = write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    ours = Tokenizer.from_dir(ensure_converted(file, tmp_path / "cache"))
    original = HFTokenizer.from_file(str(ensure_embedded_model() / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == original.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [3]  # a control token stays whole
    assert ours.decode([3, 100]) == original.decode([100])  # ... and is hidden when decoding


@pytest.mark.parametrize("pre", ["qwen2", "smollm", "llama-bpe"])
def test_pre_tokenizer_splits_like_transformers(tmp_path, pre) -> None:
    file = write_gguf(tmp_path / "m.gguf", "qwen2", "Q8_0", pre=pre)
    ours = Tokenizer.from_dir(ensure_converted(file, tmp_path / "cache"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    # transformers splits smollm's text as GPT-2 does; llama.cpp (and we) split every digit apart first
    texts = [t for t in TEXTS if pre != "smollm" or not any(c.isdigit() for c in t)]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False), text
    if pre == "smollm":
        digits = [ours.encode(d, add_special_tokens=False) for d in "2025"]
        assert ours.encode("2025", add_special_tokens=False) == [i for ids in digits for i in ids]


def one_tensor_back(file: Path, values: np.ndarray, kind: str) -> np.ndarray:
    """``values`` (raw blocks when uint8) written as the only tensor of a GGUF, read back by our dequantization."""
    writer = gguf.GGUFWriter(str(file), "llama")
    add_tensor(writer, "t", values, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantize_tensor(file, open_reader(file).tensors[0])


# Where each K-quant block keeps its fp16 scale(s): random bytes elsewhere, sane scales there.
SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                 "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,)}


@pytest.mark.parametrize("kind", sorted(SCALE_OFFSETS))
def test_dequantization_equals_transformers_kernels(tmp_path, kind) -> None:
    """gguf's numpy kernels (ours) against transformers' torch kernels on the same random blocks."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    rows, blocks = 4, max(1, 512 // block)
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scales = rng.uniform(0.001, 0.05, (rows, blocks)).astype(np.float16)
        data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    data = data.reshape(rows, blocks * size)
    ours = one_tensor_back(tmp_path / "t.gguf", data, kind)
    expected = hf_dequantize(torch.from_numpy(data.copy()).flatten(), int(qtype)).reshape(rows, -1).numpy()
    assert ours.shape == (rows, blocks * block)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q5_0", "Q5_1"])
def test_other_types_round_trip(tmp_path, kind) -> None:
    values = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    ours = one_tensor_back(tmp_path / "t.gguf", values, kind).reshape(4, 64)
    tolerance = {"F16": 1e-3, "BF16": 1e-2, "Q5_0": 0.15, "Q5_1": 0.15}[kind]
    assert np.abs(ours.astype(np.float32) - values).max() <= tolerance


def test_unpermute_undoes_llama_cpp_permutation() -> None:
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


# ---- bad files: one ValueError naming the file and the field (the command line makes it exit 2)
def _bad(tmp_path: Path, how: str) -> Path:
    file = tmp_path / f"{how}.gguf"
    if how == "magic":
        file.write_bytes(b"GGML" + bytes(100))
    elif how == "truncated":
        whole = write_gguf(tmp_path / "whole.gguf", "llama", "Q8_0").read_bytes()
        file.write_bytes(whole[: len(whole) - 1000])
    elif how == "architecture":
        write_gguf(file, "qwen2", "Q8_0")
        data = file.read_bytes().replace(b"qwen2", b"bert2", 1)  # general.architecture's value
        file.write_bytes(data)
    elif how == "type":
        def iq4(name, array, kind):
            if name == "blk.0.ffn_up.weight":
                blocks = np.random.default_rng(0).integers(0, 256, (array.shape[0], 2 * 18), dtype=np.uint8)
                return name, blocks, "IQ4_NL"
            return name, array, kind
        write_gguf(file, "llama", "Q8_0", tensor_hook=iq4)
    elif how == "shape":
        def wide(name, array, kind):
            return (name, np.zeros((48, 64), np.float32), "F32") if name == "blk.1.attn_k.weight" else (
                name, array, kind)
        write_gguf(file, "llama", "Q8_0", tensor_hook=wide)
    return file


@pytest.mark.parametrize(("how", "field"), [
    ("magic", "magic: not a GGUF file"),
    ("truncated", "the file is truncated"),
    ("architecture", "general.architecture: 'bert2' is not supported"),
    ("type", "tensor blk.0.ffn_up.weight: type IQ4_NL is not supported"),
    ("shape", "tensor blk.1.attn_k.weight: shape (48, 64) does not match the config (expected (32, 64))"),
])
def test_a_bad_file_is_refused_naming_the_file_and_field(tmp_path, how, field) -> None:
    file = _bad(tmp_path, how)
    with pytest.raises(GGUFError) as caught:
        check_model_spec(str(file))
    message = str(caught.value)
    assert message.startswith(f"{file}: ") and field in message and "\n" not in message


def test_serve_with_a_bad_gguf_is_one_line_and_exit_2(tmp_path) -> None:
    file = _bad(tmp_path, "shape")
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--model", str(file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"pdserve serve: error: --model: {file}: tensor blk.1.attn_k.weight: shape")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_directory_holding_one_gguf_is_that_gguf(tmp_path) -> None:
    file = write_gguf(tmp_path / "only.gguf", "qwen2", "Q8_0")
    directory, name = resolve_model(str(tmp_path), tmp_path / "cache")
    assert name == "only" and directory == ensure_converted(file, tmp_path / "cache" / "models")
    write_gguf(tmp_path / "second.gguf", "qwen2", "Q8_0")
    with pytest.raises(ValueError, match="2 .gguf files"):
        check_model_spec(str(tmp_path))


def test_two_processes_converting_at_once_convert_once(tmp_path) -> None:
    file = write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_converted(file, tmp_path / "cache")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [results[0].name]
    write_gguf(file, "llama", "Q8_0", seed=5)  # a changed file is converted again
    assert ensure_converted(file, tmp_path / "cache") != results[0]
