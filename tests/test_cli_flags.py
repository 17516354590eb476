"""`hspec generate / demo` answer a bad flag before loading anything: the flag, the problem, the fix.

Every case here fails in flag validation, so the target named (the embedded one) is never loaded."""

import pytest

from sglang_hspec.cli import main

PROMPT = ["--prompt", "hi"]


@pytest.fixture
def notjson(tmp_path):
    path = tmp_path / "notjson.json"
    path.write_text("this is not JSON\n")
    return str(path)


CASES = {  # id -> (argv after `generate --prompt hi`, the whole error line)
    "block-size-0-shipped": (["--drafter", "shipped", "--block-size", "0"],
                             "--block-size must be in 1..64 (draft tokens per step), got 0; drop it to use the drafter's own"),
    "block-size-0-ngram": (["--drafter", "ngram", "--block-size", "0"],
                           "--block-size must be in 1..64 (draft tokens per step), got 0; drop it to use the drafter's own"),
    "block-size-huge": (["--drafter", "ngram", "--block-size", "100000"],
                        "--block-size must be in 1..64 (draft tokens per step), got 100000; drop it to use the "
                        "drafter's own"),
    "target-tiny": (["--target", "tiny"], "--target tiny is a random test model without a tokenizer, so it cannot "
                                          "read a prompt: use --target embedded or a local Hugging Face model directory"),
    "block-size-none": (["--drafter", "none", "--block-size", "4"],
                        "--block-size has no effect with --drafter none (plain decoding proposes nothing); drop "
                        "--block-size or pick a drafter"),
    "stale-ngram": (["--drafter", "ngram", "--policy", "stale"],
                    "--policy stale plans verify lengths from a confidence head, which the ngram drafter has none "
                    "of: use --policy fixed, or an H-Spec / dspark drafter"),
    "sts-ngram": (["--drafter", "ngram", "--sts", "sts.json"],
                  "--sts calibrates a drafter's confidence head; the ngram drafter has none: drop --sts"),
    "temperature-negative": (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    "temperature-nan": (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    "top-p-0": (["--temperature", "1", "--top-p", "0"],
                "--top-p must be in (0, 1] (1 disables nucleus sampling), got 0.0"),
    "top-p-1.5": (["--temperature", "1", "--top-p", "1.5"],
                  "--top-p must be in (0, 1] (1 disables nucleus sampling), got 1.5"),
    "top-k-negative": (["--temperature", "1", "--top-k", "-1"], "--top-k must be >= 0 (0 disables it), got -1"),
    "top-p-greedy": (["--top-p", "0.9"], "--top-p 0.9 has no effect with --temperature 0 (greedy decoding): set "
                                         "--temperature > 0 to sample, or drop --top-p"),
    "top-k-greedy": (["--top-k", "5"], "--top-k 5 has no effect with --temperature 0 (greedy decoding): set "
                                       "--temperature > 0 to sample, or drop --top-k"),
    "max-new-tokens-0": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    "tree-huge": (["--tree", "65"], "--tree must be in 1..64 (verify rows per request, the anchor's included), got 65; "
                                    "0 (the default) verifies the chain"),
    "tree-negative": (["--tree", "-2"], "--tree must be in 1..64 (verify rows per request, the anchor's included), "
                                        "got -2; 0 (the default) verifies the chain"),
    "tree-none": (["--drafter", "none", "--tree", "16"],
                  "--tree has no effect with --drafter none (plain decoding drafts nothing); drop --tree or pick a "
                  "drafter"),
    "tree-auto": (["--tree", "16", "--policy", "auto"],
                  "--tree sizes each step's tree from the confidences itself: it takes --policy fixed, not --policy "
                  "auto; drop one of them"),
    "stop-empty": (["--stop", ""], "--stop '' is empty: it would end every output after its first token; give a "
                                   "non-empty stop string"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_rejects_bad_flag(case, capsys):
    extra, message = CASES[case]
    assert main(["generate", *PROMPT, *extra]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_fixed_policy_refuses_an_sps_table_instead_of_ignoring_it(notjson, capsys):
    assert main(["generate", *PROMPT, "--policy", "fixed", "--sps-table", notjson]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: the fixed policy verifies whole blocks and does not read an SPS table: drop --sps-table {notjson} "
        "or use --policy stale / --policy exact (or --tree ROWS, which sizes its trees by the table)")


def test_bad_sps_table_and_sts_files_fail_before_the_target_loads(notjson, tmp_path, capsys):
    assert main(["generate", *PROMPT, "--drafter", "shipped", "--policy", "stale", "--sps-table", notjson]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: SPS table {notjson} ") and "\n" == err[-1]
    missing = tmp_path / "sts.json"
    assert main(["generate", *PROMPT, "--drafter", "shipped", "--sts", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot read STS calibration {str(missing)!r}")


def test_demo_validates_flags_before_loading(capsys):
    assert main(["demo", "--limit", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --limit must be >= 1 (MT-Bench questions to run), got 0"
    assert main(["demo", "--drafter", "ngram", "--block-size", "0"]) == 2
    assert "--block-size must be in 1..64" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--sps-table", "--sts"])
def test_a_directory_for_a_json_flag_is_named_as_such(flag, tmp_path, capsys):
    args = ["--drafter", "shipped", "--policy", "stale"] if flag == "--sps-table" else ["--drafter", "shipped"]
    assert main(["generate", *PROMPT, *args, flag, str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {flag} {tmp_path} is a directory; pass the JSON file itself"


def test_prompt_file_that_is_a_directory_or_not_text(tmp_path):
    with pytest.raises(SystemExit) as err:
        main(["generate", "--prompt-file", str(tmp_path)])
    assert str(err.value) == (f"error: prompt file {tmp_path} is a directory; pass a text file (one prompt per line) "
                              "or a JSONL of {id, turns}")
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"ok\n\xff\xfe")
    with pytest.raises(SystemExit) as err:
        main(["generate", "--prompt-file", str(binary)])
    assert str(err.value) == f"error: prompt file {binary} is not UTF-8 text (byte 3); pass a text file, one prompt per line"


def test_demo_json_out_that_cannot_be_written_fails_before_the_run(tmp_path, capsys):
    """--json-out is written after every prompt ran: a path under a file (or a directory) is refused first,
    and nothing is created."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    before = sorted(tmp_path.rglob("*"))
    assert main(["demo", "--drafter", "ngram", "--json-out", str(blocker / "rows.json")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --json-out {blocker / 'rows.json'} cannot be written: {blocker} "
                                               "is a file, not a directory; pick another --json-out")
    assert main(["bench", "engine", "--json-out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --json-out {tmp_path} is a directory; give a file path such "
                                               f"as {tmp_path / 'out.json'}")
    assert sorted(tmp_path.rglob("*")) == before and blocker.read_text() == "x"
