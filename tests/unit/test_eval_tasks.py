"""A user's multiple-choice JSONL: its items, and a bad line as one line of error naming its number."""

import pytest

from llama.eval.tasks import Item, TaskError, load_task

GOOD = '{"context": "Two plus two is", "choices": ["four", "five"], "label": 0}'


def test_a_users_jsonl_gives_its_items_and_skips_blank_lines(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text(GOOD + "\n\n" + '{"context": "One and one", "choices": ["three", "two", "eleven"], "label": 1}\n')
    task = load_task(str(path))
    assert task.name == "sums" and task.log_key == "eval"
    assert task.items == [Item("Two plus two is", ("four", "five"), 0),
                          Item("One and one", ("three", "two", "eleven"), 1)]
    assert load_task(str(path), limit=1).items == task.items[:1]


@pytest.mark.parametrize("line, message", [
    ('{"context": "x", "choices": ["a", "b"], "label": 0', r"bad.jsonl:3: not JSON \(Expecting ',' delimiter\)"),
    ('{"context": "x", "choices": ["a", "b"]}', r"bad.jsonl:3: expected \{\"context\": a non-empty string"),
    ('{"context": "x", "choices": ["a", "b"], "label": 2}', "bad.jsonl:3: expected"),
    ('{"context": "x", "choices": ["a", "b"], "label": true}', "bad.jsonl:3: expected"),
    ('{"context": "", "choices": ["a", "b"], "label": 0}', "bad.jsonl:3: expected"),
    ('{"context": "x", "choices": ["a"], "label": 0}', "bad.jsonl:3: expected"),
    ('{"context": "x", "choices": ["a", 7], "label": 0}', "bad.jsonl:3: expected"),
    ('["x", ["a", "b"], 0]', "bad.jsonl:3: expected"),
])
def test_a_bad_line_is_one_line_of_error_with_its_number(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n\n" + line + "\n" + GOOD + "\n")
    with pytest.raises(TaskError, match=message) as error:
        load_task(str(path))
    assert "\n" not in str(error.value)


def test_an_empty_file_or_an_unknown_task_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskError, match="holds no items"):
        load_task(str(tmp_path / "empty.jsonl"))
    with pytest.raises(TaskError, match="--task arc: neither hellaswag nor a JSONL file"):
        load_task("arc")
    (tmp_path / "latin1.jsonl").write_bytes(b"\xc7a\n")
    with pytest.raises(TaskError, match="cannot read"):
        load_task(str(tmp_path / "latin1.jsonl"))
