import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sglang_hspec.training.data import (
    build_dataset,
    code_records,
    in_heldout,
    load_examples,
    load_examples_cached,
    patterned_examples,
    read_jsonl,
    tokenize_conversation,
)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["hello there, how are you?", "fine thanks and you", "write some python code: def f(x): return x"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "and you?"},
        {"role": "assistant", "content": "def f(x): return x"}]


def test_loss_mask_covers_exactly_the_assistant_turns(chat_tokenizer):
    ids, mask = tokenize_conversation(chat_tokenizer, CONV, max_length=4096)
    assert len(ids) == len(mask)
    assert chat_tokenizer.decode(ids) == chat_tokenizer.apply_chat_template(CONV, tokenize=False)
    masked = chat_tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "fine thanks<|im_end|>\ndef f(x): return x<|im_end|>\n"
    # the two masked runs are contiguous: one per assistant turn
    runs = sum(1 for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
    assert runs == 2
    short_ids, short_mask = tokenize_conversation(chat_tokenizer, CONV, max_length=10)
    assert short_ids == ids[:10] and short_mask == mask[:10]


def test_build_dedups_and_splits_by_id(tmp_path):
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(200)]
    recs.append({"id": "dup-content", "conversations": [{"role": "user", "content": "q1 "},
                                                        {"role": "assistant", "content": " a"}]})
    recs.append(dict(recs[0]))  # same id
    recs.append({"id": "no-answer", "conversations": [{"role": "user", "content": "hi"}]})
    recs.append({"id": "eval", "conversations": [{"role": "user", "content": "What is  2+2?"},
                                                 {"role": "assistant", "content": "4"}]})
    stats = build_dataset(records=recs, out_dir=tmp_path, heldout_fraction=0.1, exclude_texts={"what is 2+2?"})
    assert (stats.read, stats.duplicates, stats.unusable, stats.contaminated) == (204, 2, 1, 1)
    train = [r["id"] for r in read_jsonl(tmp_path / "train.jsonl")]
    held = [r["id"] for r in read_jsonl(tmp_path / "heldout.jsonl")]
    assert stats.train + stats.heldout == 200 == len(train) + len(held)
    assert not set(train) & set(held)
    assert held == [f"r{i}" for i in range(200) if in_heldout(f"r{i}", 0.1)]
    assert 5 <= len(held) <= 40  # ~10% of 200
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "conversations"} and first["conversations"][0]["role"] == "user"


def test_code_records_are_chat_pairs_of_bounded_size():
    recs = list(code_records(limit=5, max_chars=1500))
    assert len(recs) == 5
    for r in recs:
        assert [m["role"] for m in r["conversations"]] == ["user", "assistant"]
        assert 0 < len(r["conversations"][1]["content"]) <= 1500


def test_pretokenized_and_patterned_examples():
    ex = patterned_examples(num_sequences=3, seq_len=20, vocab_low=3, vocab_high=30, motif_len=4, num_motifs=5,
                            prompt_len=2, seed=0)
    assert [len(e["input_ids"]) for e in ex] == [20] * 3 and ex[0]["loss_mask"][:3] == [0, 0, 1]
    # within a motif the next token is a function of the current one
    nxt = {}
    for e in ex:
        for a, b in zip(e["input_ids"], e["input_ids"][1:]):
            nxt.setdefault(a, set()).add(b)
    assert sum(len(v) == 1 for v in nxt.values()) >= 10
    out = load_examples(ex + [{"id": "empty", "input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}], tokenizer=None,
                        max_length=12)
    assert len(out) == 3 and all(len(e["input_ids"]) == 12 for e in out)
    with pytest.raises(ValueError, match="need the target's tokenizer"):
        load_examples([{"id": "c", "conversations": CONV}], tokenizer=None, max_length=10)


def test_tokenized_examples_cache_returns_the_same_examples_and_follows_the_file(chat_tokenizer, tmp_path,
                                                                                   monkeypatch):
    """The cache gives back exactly what tokenizing gives, is read (not re-tokenized) the second time,
    and a changed file or max_length, or a damaged entry, tokenizes afresh."""
    import sglang_hspec.training.data as data

    path = tmp_path / "train.jsonl"
    convs = [CONV, CONV[:3], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine you"}]]
    path.write_text("".join(json.dumps({"id": f"c{i}", "conversations": c}) + "\n" for i, c in enumerate(convs)))
    cache = tmp_path / "cache"
    full = load_examples(read_jsonl(path), tokenizer=chat_tokenizer, max_length=4096)
    cut = max(len(e["input_ids"]) for e in full) - 6
    want = load_examples(read_jsonl(path), tokenizer=chat_tokenizer, max_length=cut)
    assert len(want) == 3 and max(len(e["input_ids"]) for e in want) == cut
    assert load_examples_cached(path, tokenizer=chat_tokenizer, max_length=cut, cache_dir=cache) == want
    (entry,) = cache.glob("train-*.pt")

    calls = []
    real = data.tokenize_conversation
    monkeypatch.setattr(data, "tokenize_conversation", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert load_examples_cached(path, tokenizer=chat_tokenizer, max_length=cut, cache_dir=cache) == want
    assert calls == [1]  # only the tokenizer fingerprint's probe: the examples came from the cache
    assert load_examples_cached(path, tokenizer=chat_tokenizer, max_length=4096, cache_dir=cache) == full
    assert len(list(cache.glob("train-*.pt"))) == 2
    entry.write_bytes(b"damaged")
    calls.clear()
    assert load_examples_cached(path, tokenizer=chat_tokenizer, max_length=cut, cache_dir=cache) == want
    assert len(calls) > 1  # rebuilt
    with path.open("a") as f:
        f.write(json.dumps({"id": "c9", "conversations": CONV[1:3]}) + "\n")
    again = load_examples_cached(path, tokenizer=chat_tokenizer, max_length=cut, cache_dir=cache)
    assert [e["id"] for e in again] == ["c0", "c1", "c2", "c9"]
