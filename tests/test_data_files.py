"""Data files: every layout from jsonl and parquet fixtures written here, malformed files, epoch order."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qarl_cli.data.base import Problem
from qarl_cli.data.files import LAYOUTS, DataError, detect_layout, epoch_order, load_problems

# layout -> (records as the public datasets have them, (prompt, answer, level) expected of each)
CASES = {
    "gsm8k": (
        [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "He has 3+4=<<3+4=7>>7.\n#### 7"},
         {"question": "How many cents in $12.34?", "answer": "100*12.34=1234\n####  1,234 "}],
        [("Tom has 3 apples and buys 4. How many?", "7", 0), ("How many cents in $12.34?", "1234", 0)],
    ),
    "math": (
        [{"problem": "Compute $\\frac12+\\frac14$.", "solution": "So $\\boxed{\\frac{3}{4}}$.",
          "level": "Level 2", "type": "Algebra"},
         {"problem": "Find $\\cos 30^\\circ$.", "solution": "First \\boxed{1}, no: \\boxed{\\frac{\\sqrt{3}}{2}}",
          "level": "Level ?", "type": "Precalculus"},
         {"problem": "What is 2+3?", "solution": "It is $5$.", "answer": "5", "subject": "Prealgebra",
          "level": 1, "unique_id": "test/prealgebra/1.json"}],
        [("Compute $\\frac12+\\frac14$.", "\\frac{3}{4}", 2), ("Find $\\cos 30^\\circ$.", "\\frac{\\sqrt{3}}{2}", 0),
         ("What is 2+3?", "5", 1)],
    ),
    "aime": (
        [{"problem": "Find the remainder.", "answer": 204, "url": "https://example.org/1"},
         {"ID": "2024-II-4", "Problem": "Find $m+n$.", "Solution": "...", "Answer": "033"}],
        [("Find the remainder.", "204", 0), ("Find $m+n$.", "033", 0)],
    ),
    "dapo": (
        [{"data_source": "math_dapo", "ability": "MATH",
          "prompt": [{"role": "user", "content": "Solve: 6*7. Answer: $Answer"}],
          "reward_model": {"ground_truth": "42", "style": "rule-math"}, "extra_info": {"index": "a1"}},
         {"data_source": "math_dapo", "ability": "MATH",
          "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Halve 1."}],
          "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule-math"}, "extra_info": {"index": "a2"}}],
        [("Solve: 6*7. Answer: $Answer", "42", 0), ("Halve 1.", "\\frac{1}{2}", 0)],
    ),
    "openr1": (
        [{"problem": "Sum 1..4.", "solution": "10", "answer": "10", "problem_type": "Algebra",
          "question_type": "math-word-problem", "source": "olympiads", "uuid": "u1"},
         {"problem": "Square 0.5.", "solution": "0.25", "answer": "\\frac14", "problem_type": "Algebra",
          "question_type": "math-word-problem", "source": "cn_contest", "uuid": "u2"}],
        [("Sum 1..4.", "10", 0), ("Square 0.5.", "\\frac14", 0)],
    ),
}


def _write(path, records):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_detected_and_named(tmp_path, layout, suffix):
    records, expected = CASES[layout]
    if suffix == ".parquet":  # a parquet table has one schema: keep the rows shaped like the first
        keep = [i for i, r in enumerate(records) if r.keys() == records[0].keys()]
        records, expected = [records[i] for i in keep], [expected[i] for i in keep]
    path = _write(tmp_path / f"{layout}_train{suffix}", records)
    want = [Problem(prompt=p, answer=a, source=f"{layout}_train", level=lv) for p, a, lv in expected]
    assert load_problems(path) == want
    assert load_problems(path, layout=layout) == want
    assert {p.source for p in load_problems(path, source="mine")} == {"mine"}


@pytest.mark.parametrize("record, layout", [
    ({"question": "q", "answer": "a #### 1"}, "gsm8k"),
    ({"problem": "p", "solution": "\\boxed{1}"}, "math"),
    ({"problem": "p", "answer": "1", "level": "Level 1"}, "math"),
    ({"problem": "p", "answer": "1", "url": "u"}, "aime"),
    ({"prompt": [], "reward_model": {}}, "dapo"),
    ({"problem": "p", "answer": "1", "uuid": "u"}, "openr1"),
    ({"messages": [], "answer": "1"}, "openr1"),
])
def test_detect_layout(record, layout):
    assert detect_layout(record) == layout


def test_openr1_chat_messages_and_answer(tmp_path):
    path = _write(tmp_path / "r1.jsonl", [{"messages": [{"role": "user", "content": "P?"},
                                                        {"role": "assistant", "content": "\\boxed{5}"}],
                                           "answer": 5.0}])
    assert load_problems(path) == [Problem(prompt="P?", answer="5", source="r1")]


GOOD = json.dumps({"question": "q", "answer": "x #### 1"})


@pytest.mark.parametrize("name, content, message", [
    ("a.jsonl", f"{GOOD}\n\n" + json.dumps({"question": "q", "answer": "no marker"}),
     "a.jsonl, line 3: field 'answer': no '#### <final answer>' in it (layout gsm8k)"),
    ("b.jsonl", f"{GOOD}\n{{\"question\": \"q\",\n", "b.jsonl, line 2: invalid JSON: "),
    ("c.jsonl", "[1, 2]\n", "c.jsonl, line 1: expected a JSON object, got list"),
    ("d.jsonl", f"{GOOD}\n" + json.dumps({"question": " ", "answer": "#### 2"}),
     "d.jsonl, line 2: field 'question': empty (layout gsm8k)"),
    ("e.jsonl", json.dumps({"problem": "p", "solution": "no box"}),
     "e.jsonl, line 1: field 'solution': no \\boxed{...} answer in it (layout math)"),
    ("f.jsonl", json.dumps({"prompt": "p", "reward_model": {"style": "rule"}}),
     "f.jsonl, line 1: field 'reward_model.ground_truth': missing (layout dapo)"),
    ("g.jsonl", json.dumps({"prompt": [{"role": "system", "content": "s"}], "reward_model": {"ground_truth": "1"}}),
     "g.jsonl, line 1: field 'prompt': no user message with text content (layout dapo)"),
    ("h.jsonl", json.dumps({"foo": 1}), "h.jsonl, line 1: no known layout has the fields ['foo']"),
    ("i.jsonl", json.dumps({"problem": "p", "answer": [1, 2], "url": "u"}),
     "i.jsonl, line 1: field 'answer': expected text, got list (layout aime)"),
    ("j.jsonl", "\n\n", "j.jsonl: no records"),
    ("k.csv", "question,answer\n", "k.csv: unsupported file type '.csv'; expected .jsonl, .ndjson or .parquet"),
    ("l.parquet", "PAR1 not really", "l.parquet: not a readable parquet file: "),
])
def test_malformed_files(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as err:
        load_problems(str(path))
    assert str(err.value).startswith(f"{path}{message[len(name):]}")
    assert "\n" not in str(err.value)


def test_malformed_parquet_row(tmp_path):
    path = _write(tmp_path / "m.parquet", [{"problem": "p1", "answer": "1"}, {"problem": "p2", "answer": None}])
    with pytest.raises(DataError, match=r"m\.parquet, row 2: field 'answer': missing \(layout aime\)$"):
        load_problems(path)


def test_parquet_with_unknown_columns_names_the_columns_it_has(tmp_path):
    """Only the known columns are read: a file with none of them was reported as "has the fields []"."""
    path = _write(tmp_path / "w.parquet", [{"Query": "1+1", "Target": "2"}])
    with pytest.raises(DataError, match=r"w\.parquet: no known layout has the columns \['Query', 'Target'\]"):
        load_problems(path)


def test_named_layout_that_does_not_fit(tmp_path):
    path = _write(tmp_path / "n.jsonl", CASES["math"][0])
    with pytest.raises(DataError, match=r"n\.jsonl, line 1: field 'question': missing \(layout gsm8k\)$"):
        load_problems(path, layout="gsm8k")


def test_unknown_layout_name_and_missing_file(tmp_path):
    with pytest.raises(DataError, match="layout 'gsm9k' is unknown; expected auto or one of gsm8k, math, aime, "
                                        "dapo, openr1$"):
        load_problems(_write(tmp_path / "o.jsonl", [{"question": "q", "answer": "#### 1"}]), layout="gsm9k")
    with pytest.raises(DataError, match="nowhere.jsonl: no such file$"):
        load_problems(str(tmp_path / "nowhere.jsonl"))


def test_epoch_order_is_a_seeded_permutation():
    first = epoch_order(100, seed=3, epoch=0)
    assert sorted(first) == list(range(100))
    assert first != list(range(100))
    assert epoch_order(100, seed=3, epoch=0) == first
    assert epoch_order(100, seed=3, epoch=1) != first
    assert epoch_order(100, seed=4, epoch=0) != first
    assert epoch_order(0, seed=3, epoch=0) == []


def test_epoch_order_is_the_same_in_another_process():
    """A resumed run is a new process, possibly with another hash seed: the order must not depend on it."""
    code = "from qarl_cli.data.files import epoch_order; print(epoch_order(50, 7, 2))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == epoch_order(50, 7, 2)


def test_a_byte_that_is_not_utf8_is_reported_with_its_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    first = "\ufeff" + json.dumps({"question": "q", "answer": "#### 1"}) + "\n"  # a byte-order mark is fine
    bad = '{"question": "Caf\xe9 bill?", "answer": "#### 2"}\n'.encode("latin1")  # é at column 18
    path.write_bytes(first.encode() + b"\n" + bad)
    with pytest.raises(DataError) as err:
        load_problems(str(path))
    assert str(err.value).startswith(f"{path}, line 3: not UTF-8 text (byte 0xe9 at column 18)")
    path.write_bytes(first.encode())
    assert load_problems(str(path)) == [Problem(prompt="q", answer="1", source="latin1")]


def test_each_problem_knows_its_file_and_line(tmp_path):
    jsonl = _write(tmp_path / "a.jsonl", CASES["gsm8k"][0])
    jsonl_text = open(jsonl).read()
    open(jsonl, "w").write("\n" + jsonl_text)  # a blank first line: the records are on lines 2 and 3
    assert [p.origin for p in load_problems(jsonl)] == [f"{jsonl}, line 2", f"{jsonl}, line 3"]
    parquet = _write(tmp_path / "b.parquet", CASES["aime"][0][:1] * 2)
    assert [p.origin for p in load_problems(parquet)] == [f"{parquet}, row 1", f"{parquet}, row 2"]
    from qarl_cli.data.arith import make

    assert make("1+2", 1).origin == ""  # generated


def test_the_held_out_split_must_leave_problems_on_both_sides(tmp_path):
    from qarl_cli.config.data import ArithDataConfig, FileDataConfig
    from qarl_cli.config.errors import ConfigError
    from qarl_cli.data.splits import load_splits

    records = [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(5)]
    path = _write(tmp_path / "five.jsonl", records)
    every = load_problems(path, source="file")  # load_splits names them by the data option
    for size in (1, 2, 4):  # held out: `size` of them, the rest trained on, together the whole file
        source = load_splits(FileDataConfig(path=path, test_size=size), seed=0)
        assert len(source.test) == size and len(source.train) == 5 - size
        assert sorted(p.prompt for p in source.test + source.train) == sorted(p.prompt for p in every)
    with pytest.raises(ConfigError, match=f"^data.test_size=0: the test split of data.path={path} is empty"):
        load_splits(FileDataConfig(path=path, test_size=0), seed=0)
    for size in (5, 6, 500):
        with pytest.raises(ConfigError, match=f"^data.test_size={size}: data.path={path} has 5 problems, and "
                                              "holding out 5 for the test split leaves none to train on"):
            load_splits(FileDataConfig(path=path, test_size=size), seed=0)
        # qarl eval trains on nothing: a test_size covering the file evaluates all of it
        assert load_splits(FileDataConfig(path=path, test_size=size), seed=0, train=False).test == every
    with pytest.raises(ConfigError, match="^data.test_size=0: the test split of data=arith is empty"):
        load_splits(ArithDataConfig(test_size=0), seed=0)


def test_a_file_stream_resumes_at_any_position_across_epochs(tmp_path):
    """A resumed run restarts the stream at position step * prompts_per_step: from any position, the same problems
    as the uninterrupted stream, across epoch boundaries; epoch e visits the training problems in the order
    epoch_order(n, seed, e)."""
    from itertools import islice

    from qarl_cli.config.data import FileDataConfig
    from qarl_cli.data.splits import load_splits

    path = _write(tmp_path / "seven.jsonl", [{"problem": f"{i}*3?", "answer": str(3 * i)} for i in range(7)])
    cfg = FileDataConfig(path=path, test_size=2)
    source = load_splits(cfg, seed=3)
    held = {p.prompt for p in source.test}
    train = [p for p in load_problems(path, source="file") if p.prompt not in held]  # 5, in file order
    assert len(held) == 2 and len(train) == 5
    straight = list(islice(source.train_stream(), 17))  # 3 epochs and 2 problems
    expected = [train[i] for e in range(4) for i in epoch_order(5, 3, e)][:17]
    assert [p.prompt for p in straight] == [p.prompt for p in expected]
    assert [p.prompt for p in straight[:5]] != [p.prompt for p in straight[5:10]]  # reshuffled per epoch
    for start in (1, 4, 5, 6, 10, 12):
        resumed = list(islice(load_splits(cfg, seed=3).train_stream(start), 17 - start))
        assert [p.prompt for p in resumed] == [p.prompt for p in straight[start:]], start
