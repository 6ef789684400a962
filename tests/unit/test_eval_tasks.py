"""A user's multiple-choice JSONL: its items, and a bad line as one line of error naming its number and field."""

import pytest

from llama.eval.items import Item, TaskError
from llama.eval.tasks import load_task

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
    ('{"context": "x", "choices": ["a", "b"], "label": 0', r"bad.jsonl:3: not JSON \(Expecting ',' delimiter\)$"),
    ('{"context": "x", "choices": ["a", "b"]}', r"bad.jsonl:3: field 'label' is missing$"),
    ('{"context": "x", "choices": ["a", "b"], "label": 2}',
     r"bad.jsonl:3: field 'label' must be an index from 0 to 1 \(got 2\)$"),
    ('{"context": "x", "choices": ["a", "b"], "label": true}', r"bad.jsonl:3: field 'label' must be .* \(got True\)$"),
    ('{"context": "", "choices": ["a", "b"], "label": 0}',
     r"bad.jsonl:3: field 'context' must be a non-empty string \(got ''\)$"),
    ('{"context": "x", "choices": ["a"], "label": 0}',
     r"bad.jsonl:3: field 'choices' must be a list of two or more non-empty strings \(got \['a'\]\)$"),
    ('{"context": "x", "choices": ["a", 7], "label": 0}', r"bad.jsonl:3: field 'choices' must be a list of two or more"),
    ('["x", ["a", "b"], 0]', r"bad.jsonl:3: expected a JSON object with the field 'context', got \['x', \['a', 'b'\], 0\]$"),
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
    with pytest.raises(TaskError, match=r"^--task arc: neither a task \(hellaswag, arc_easy, .*, mmlu, suite\) nor a "
                                        "JSONL file of multiple-choice items$"):
        load_task("arc")
    (tmp_path / "latin1.jsonl").write_bytes(b"\xc7a\n")
    with pytest.raises(TaskError, match="cannot read"):
        load_task(str(tmp_path / "latin1.jsonl"))
