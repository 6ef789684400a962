"""The standard tasks' files and prompts, on the CPU.

On ../shared/evaldata (skipped where it is absent): each file is the one its README names (md5) and parses to its
documented item count, and each task's first item renders to lm-eval's exact requests. The expected strings below
follow the task YAMLs of lm_eval 0.4.13 quoted beside them (checked by hand, and for every item of every file by
`scripts/check_eval_lmeval.py --requests-only`, which builds them with lm-eval's own code).

Everywhere: a file of each original format gives the same items as the same rows of llm-foundry's format (or where
the formats differ, the difference the docs describe); a corrupt or truncated file is one error naming the file,
the line and the field; the results JSON's MMLU groups and the suite's summary add up."""

import hashlib
import json
import math
import tarfile
import zipfile

import pytest

from llama.eval.benchmarks import BENCHMARKS, MMLU_SUBJECTS
from llama.eval.items import LOGLIKELIHOOD, Item, Task, TaskError
from llama.eval.results import pooled_stderr, results_json
from llama.eval.scoring import ItemScore, metrics
from llama.eval.tasks import load_task, load_tasks, task_names
from tests.eval_files import EVALDATA, accept, needs_evaldata, write_jsonl

FILES = {  # ../shared/evaldata/README.md: file, items, md5
    "hellaswag": ("hellaswag_val_full.txt", 10_042, "930d8011242464e3bb7bc9be42914d3b"),
    "arc_easy": ("foundry/arc_easy.jsonl", 2_376, "6f5610e47e7a93bf0fbb50b9596e5998"),
    "arc_challenge": ("foundry/arc_challenge.jsonl", 1_172, "0534c4af8967d57e7b33637d957e744b"),
    "piqa": ("foundry/piqa.jsonl", 1_838, "9a7bdd20b48d6b913d1a9af736102f80"),
    "openbookqa": ("foundry/openbook_qa.jsonl", 500, "244a465318d14f5829ce33db938fefc1"),
    "copa": ("foundry/copa.jsonl", 100, "2fbd1a8c869d6eaa24e86a209f294b20"),
    "winogrande": ("foundry/winogrande.jsonl", 1_267, "186a2d6fafd1e60e1340df073a74d7a1"),
    "boolq": ("foundry/boolq.jsonl", 3_270, "3e8e3163014bc53de57f4d1ae672ad8e"),
    "lambada_openai": ("foundry/lambada_openai.jsonl", 5_153, "ba3e79f7592409600727f63b9e9ab4a5"),
    "mmlu": ("mmlu", 14_079, None),  # the early release: 285 dev rows, 14,079 test rows
}


@needs_evaldata
@pytest.mark.parametrize("name", list(FILES))
def test_each_file_parses_to_its_documented_item_count(name):
    path, count, md5 = FILES[name]
    if md5 is not None:
        assert hashlib.md5((EVALDATA / path).read_bytes()).hexdigest() == md5
    task = load_task(name, source=str(EVALDATA / path))
    assert len(task.items) == count and task.original == count
    assert task == load_task(name, source=str(EVALDATA))  # found in the folder too
    if name == "mmlu":
        assert [name for name, _ in task.parts] == [f"mmlu_{s}" for s in MMLU_SUBJECTS] and len(task.parts) == 57
        assert sum(n for _, n in task.parts) == count and dict(task.parts)["mmlu_abstract_algebra"] == 100
        assert task.num_fewshot == 5 and task.metrics == ("acc",)


def first_requests(name: str, item: int = 0) -> tuple[list[tuple[str, str]], int]:
    task = load_task(name, source=str(EVALDATA), limit=item + 1)
    return task.items[item].requests(), task.items[item].label


@needs_evaldata
def test_hellaswag_renders_the_files_context_with_each_ending():
    # hellaswag.yaml: doc_to_text: "{{query}}", doc_to_choice: "choices", doc_to_target: "{{label}}"; the target
    # delimiter " " (lm-eval's default) before each choice. llama.cpp's file keeps "he" where lm-eval's
    # process_docs writes ctx_b.capitalize(), "He" (docs/eval.md).
    context = "Roof shingle removal: A man is sitting on a roof. he"
    assert first_requests("hellaswag") == ([
        (context, " is using wrap to wrap a pair of skis."), (context, " is ripping level tiles off."),
        (context, " is holding a rubik's cube."), (context, " starts pulling up roofing on a roof.")], 3)


@needs_evaldata
@pytest.mark.parametrize("name, question, choices, label", [
    ("arc_easy", "Which statement best explains why photosynthesis is the foundation of most food webs?",
     ["Sunlight is the source of energy for nearly all ecosystems.", "Most ecosystems are found on land instead of in "
      "water.", "Carbon dioxide is more available than other gases.", "The producers in all ecosystems are plants."], 0),
    ("arc_challenge", "An astronomer observes that a planet rotates faster after a meteorite impact. Which is the most "
     "likely effect of this increase in rotation?", ["Planetary density will decrease.", "Planetary years will become "
     "longer.", "Planetary days will become shorter.", "Planetary gravity will become stronger."], 2)])
def test_arc_renders_question_and_answer(name, question, choices, label):
    # arc_easy.yaml: doc_to_text: "Question: {{question}}\nAnswer:", doc_to_choice: "{{choices.text}}",
    # doc_to_target: "{{choices.label.index(answerKey)}}"
    context = f"Question: {question}\nAnswer:"
    assert first_requests(name) == ([(context, " " + choice) for choice in choices], label)


@needs_evaldata
def test_piqa_renders_the_goal_and_both_solutions():
    # piqa.yaml: doc_to_text: "Question: {{goal}}\nAnswer:", doc_to_choice: "{{[sol1, sol2]}}", doc_to_target: label
    context = "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    solution = ("Provide the guinea pig with a cage full of a few inches of bedding made of ripped {} , you will also "
                "need to supply it with a water bottle and a food dish.")
    assert first_requests("piqa") == ([(context, " " + solution.format("paper strips").replace(" ,", ",")),
                                       (context, " " + solution.format("jeans material").replace(" ,", ","))], 0)
    # llm-foundry strips each solution: the original's "replace drawer with bobby pin " loses its last space
    assert first_requests("piqa", 1) == ([("Question: dresser\nAnswer:", " replace drawer with bobby pin"),
                                          ("Question: dresser\nAnswer:", " finish, woodgrain with  bobby pin")], 1)


@needs_evaldata
def test_winogrande_scores_the_rest_of_the_sentence_after_each_filled_blank():
    # preprocess_winogrande.py: doc_to_choice: [doc["sentence"][:idx] + opt for opt in options],
    # doc_to_target: doc["sentence"][idx + 1:].strip(), doc_to_text: the answer's index (multiple inputs)
    assert first_requests("winogrande") == ([("Sarah was a much better surgeon than Maria so Sarah",
                                              " always got the easier cases."),
                                             ("Sarah was a much better surgeon than Maria so Maria",
                                              " always got the easier cases.")], 1)


@needs_evaldata
def test_openbookqa_renders_the_question_stem_alone():
    # openbookqa.yaml: doc_to_text: question_stem, doc_to_choice: "{{choices.text}}",
    # doc_to_target: "{{choices.label.index(answerKey.lstrip())}}"
    stem = ("A person wants to start saving money so that they can afford a nice vacation at the end of the year. After "
            "looking over their budget and expenses, they decide the best way to save money is to")
    assert first_requests("openbookqa") == ([(stem, " make more phone calls"), (stem, " quit eating lunch out"),
                                             (stem, " buy less with monopoly money"), (stem, " have lunch with friends")],
                                            1)


@needs_evaldata
def test_copa_drops_the_premises_period_and_doubles_the_space_before_each_choice():
    # super_glue/copa/utils.py: doc_to_text: doc["premise"].strip()[:-1] + f" {connector}";
    # doc_to_choice: [" " + convert_choice(doc["choice1"]), " " + convert_choice(doc["choice2"])]; then the target
    # delimiter " ": two spaces. llm-foundry's query has a comma before "therefore", which lm-eval's has not.
    context = "The man turned on the faucet therefore"
    assert first_requests("copa") == ([(context, "  the toilet filled with water."),
                                       (context, "  water flowed from the spout.")], 1)


@needs_evaldata
def test_boolq_renders_passage_question_and_answer():
    # super_glue/boolq/default.yaml: doc_to_text: "{{passage}}\nQuestion: {{question}}?\nAnswer:",
    # doc_to_choice: ["no", "yes"], doc_to_target: label
    requests, label = first_requests("boolq")
    context = requests[0][0]
    assert [continuation for _, continuation in requests] == [" no", " yes"] and label == 0
    assert context.startswith("All biomass goes through at least some of these steps: it needs to be grown, collected,")
    assert context.endswith("concluded that producing ethanol from corn uses much less petroleum than producing "
                            "gasoline.\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert "Passage:" not in context  # llm-foundry's prefix, not lm-eval's


@needs_evaldata
def test_lambada_continues_the_text_with_its_last_word():
    # lambada_openai.yaml: output_type: loglikelihood, doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}",
    # doc_to_target: "{{' '+text.split(' ')[-1]}}"
    requests, _ = first_requests("lambada_openai")
    assert len(requests) == 1 and requests[0][1] == " signs"
    assert requests[0][0].endswith("But as I stare at Harlin, his mouth curved in a confident grin, I don't care about")
    assert requests[0][0].startswith("In my palm is a clear stone, and inside it is a small ivory statuette. A guardian "
                                     "angel.\n\n\"Figured if you're going to be out at night")
    # the one item whose last word follows a newline: the word and the newlines are the continuation
    assert first_requests("lambada_openai", 4462)[0][0][1] == " \n\nrecorder"


@needs_evaldata
def test_mmlu_renders_five_dev_questions_with_answers_then_the_question():
    # _default_template_yaml: doc_to_text: "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC.
    # {{choices[2]}}\nD. {{choices[3]}}\nAnswer:", doc_to_choice: ["A", "B", "C", "D"], fewshot_split: dev,
    # fewshot_config: sampler: first_n; mmlu_abstract_algebra.yaml: description: "The following are multiple choice
    # questions (with answers) about abstract algebra.\n\n"; each shot: text, " ", its letter, "\n\n" (fewshot_delimiter)
    true_false = "\nA. True, True\nB. False, False\nC. True, False\nD. False, True\nAnswer:"
    context = (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: B\n\n"
        "Statement 1 | If aH is an element of a factor group, then |aH| divides |a|. Statement 2 | If H and K are "
        f"subgroups of G then HK is a subgroup of G.{true_false} B\n\n"
        "Statement 1 | Every element of a group generates a cyclic subgroup of the group. Statement 2 | The symmetric "
        f"group S_10 has 10 elements.{true_false} C\n\n"
        "Statement 1| Every function from a finite set onto itself must be one to one. Statement 2 | Every subgroup of "
        f"an abelian group is abelian.{true_false} A\n\n"
        "Find the characteristic of the ring 2Z.\nA. 0\nB. 3\nC. 12\nD. 30\nAnswer: A\n\n"
        "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\n"
        "Answer:")
    assert first_requests("mmlu") == ([(context, " A"), (context, " B"), (context, " C"), (context, " D")], 1)


# ---- the original formats give lm-eval's documents, as llm-foundry's rows of the same items do

def zip_of(path, member: str, rows: list):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_original_formats_give_the_items_of_llm_foundrys_rows(tmp_path, monkeypatch):
    """One item of each task in both formats (the originals' fields as their releases have them: ARC's line is
    ARC-Challenge-Test.jsonl's first, as the Hugging Face data set's script reads it)."""
    arc = {"id": "Mercury_7175875", "question": {"stem": "An astronomer observes that a planet rotates faster after a "
           "meteorite impact. Which is the most likely effect of this increase in rotation?", "choices": [
               {"text": "Planetary density will decrease.", "label": "A"},
               {"text": "Planetary years will become longer.", "label": "B"},
               {"text": "Planetary days will become shorter.", "label": "C"},
               {"text": "Planetary gravity will become stronger.", "label": "D"}]}, "answerKey": "C"}
    foundry_arc = {"query": "Question: " + arc["question"]["stem"], "gold": 2,
                   "choices": [c["text"] for c in arc["question"]["choices"]]}
    pairs = {
        "arc_challenge": (zip_of(tmp_path / "ARC-V1-Feb2018.zip", "ARC-V1-Feb2018-2/ARC-Challenge/ARC-Challenge-Test"
                                 ".jsonl", [arc]), foundry_arc),
        "openbookqa": (zip_of(tmp_path / "OpenBookQA-V1-Sep2018.zip", "OpenBookQA-V1-Sep2018/Data/Main/test.jsonl",
                              [{"id": "7-980", "question": {"stem": "The sun is responsible for", "choices": [
                                  {"text": "puppies learning new tricks", "label": "A"},
                                  {"text": "plants sprouting, blooming and wilting", "label": "B"}]},
                                "answerKey": "B"}]),
                       {"query": "The sun is responsible for", "gold": 1,
                        "choices": ["puppies learning new tricks", "plants sprouting, blooming and wilting"]}),
        "winogrande": (zip_of(tmp_path / "winogrande_1.1.zip", "winogrande_1.1/dev.jsonl", [
            {"qID": "1", "sentence": "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
             "option1": "Sarah", "option2": "Maria", "answer": "2"}]),
            {"context_options": ["Sarah was a much better surgeon than Maria so Sarah",
                                 "Sarah was a much better surgeon than Maria so Maria"],
             "continuation": "always got the easier cases.", "gold": 1}),
        "copa": (zip_of(tmp_path / "COPA.zip", "COPA/val.jsonl", [
            {"premise": "The man turned on the faucet.", "choice1": "The toilet filled with water.",
             "choice2": "Water flowed from the spout.", "question": "effect", "label": 1, "idx": 0}]),
            {"query": "The man turned on the faucet, therefore", "gold": 1,
             "choices": ["the toilet filled with water.", "water flowed from the spout."]}),
        "boolq": (zip_of(tmp_path / "BoolQ.zip", "BoolQ/val.jsonl", [
            {"question": "is the sky blue", "passage": "The sky is blue.", "idx": 0, "label": True}]),
            {"query": "Passage: The sky is blue.\nQuestion: is the sky blue?", "choices": ["no", "yes"], "gold": 1}),
        "lambada_openai": (write_jsonl(tmp_path / "lambada_test.jsonl", [{"text": "She said hello\n\nand left"}]),
                           {"context": "She said hello\n\nand", "continuation": "left"}),
    }
    for name, (original, foundry_row) in pairs.items():
        accept(monkeypatch, name, count=1)
        foundry = write_jsonl(tmp_path / f"{name}_foundry.jsonl", [foundry_row])
        assert load_task(name, source=str(original)).items == load_task(name, source=str(foundry)).items, name


def test_piqas_original_file_reads_its_labels_beside_it(tmp_path, monkeypatch):
    """PIQA's valid.jsonl (its first two lines) and valid-labels.lst: llm-foundry's rows differ where they strip a
    solution's spaces."""
    write_jsonl(tmp_path / "valid.jsonl", [
        {"goal": "How do I ready a guinea pig cage for it's new occupants?", "sol1": "Provide paper strips.",
         "sol2": "Provide jeans material."},
        {"goal": "dresser", "sol1": "replace drawer with bobby pin ", "sol2": "finish, woodgrain with  bobby pin "}])
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    accept(monkeypatch, "piqa", tmp_path / "valid.jsonl", count=2)
    items = load_task("piqa", source=str(tmp_path / "valid.jsonl")).items
    assert items == [Item("Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:",
                          ("Provide paper strips.", "Provide jeans material."), 0),
                     Item("Question: dresser\nAnswer:", ("replace drawer with bobby pin ",
                                                         "finish, woodgrain with  bobby pin "), 1)]
    (tmp_path / "valid-labels.lst").write_text("0\n")
    with pytest.raises(TaskError, match=r"valid.jsonl:2: its label \(line 2 of the labels file\) is missing"):
        load_task("piqa", source=str(tmp_path / "valid.jsonl"))


def test_hellaswags_original_rows_are_capitalized_where_llama_cpps_text_is_not(tmp_path, monkeypatch):
    """hellaswag/utils.py's process_docs: preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())."""
    row = {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
           "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                       "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": "3"}
    original = write_jsonl(tmp_path / "hellaswag_val.jsonl", [row])
    (tmp_path / "hellaswag_val_full.txt").write_text(
        "Roof shingle removal: A man is sitting on a roof. he\n3\n" + "\n".join(row["endings"]) + "\n")
    accept(monkeypatch, "hellaswag", original, count=1)
    ours, theirs = (load_task("hellaswag", source=str(tmp_path / name)).items[0]
                    for name in ("hellaswag_val.jsonl", "hellaswag_val_full.txt"))
    assert ours.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert theirs == Item("Roof shingle removal: A man is sitting on a roof. he", ours.choices, 3)


def mmlu_files(folder, rows: dict[str, int], bad: str | None = None):
    for split, count in (("dev", 5), ("test", 3)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        for subject in MMLU_SUBJECTS:
            lines = [f'"{subject} {split} {i}?",a,"b, c",c,d,{"ABCD"[i % 4]}' for i in range(rows.get(split, count))]
            if bad and subject == "anatomy" and split == "test":
                lines[1] = bad
            (folder / split / f"{subject}_{split}.csv").write_text("\n".join(lines) + "\n")


def test_mmlu_reads_a_folder_or_data_tar(tmp_path, monkeypatch):
    accept(monkeypatch, "mmlu", count=57 * 3)
    mmlu_files(tmp_path / "mmlu" / "data", {})
    task = load_task("mmlu", source=str(tmp_path))  # found below the folder: data/dev, data/test
    assert len(task.items) == 171 and task.parts[1] == ("mmlu_anatomy", 3)
    item = task.items[3]  # anatomy's first
    assert item.context.endswith("anatomy dev 4?\nA. a\nB. b, c\nC. c\nD. d\nAnswer: A\n\nanatomy test 0?\nA. a\n"
                                 "B. b, c\nC. c\nD. d\nAnswer:") and item.label == 0
    with tarfile.open(tmp_path / "data.tar", "w") as archive:
        archive.add(tmp_path / "mmlu" / "data", arcname="data")
    assert load_task("mmlu", source=str(tmp_path / "data.tar")).items == task.items


# ---- a corrupt or truncated file: one line naming the file, the line and the field

@pytest.mark.parametrize("name, file, rows, message", [
    ("arc_easy", "arc_easy.jsonl", [{"query": "Question: x", "choices": ["a", "b"], "gold": 0},
                                    {"query": "Question: y", "choices": ["a", "b"]}],
     r"arc_easy.jsonl:2: field 'gold' is missing$"),
    ("arc_easy", "arc_easy.jsonl", [{"query": "Question: y", "choices": ["a", "b"], "gold": 2}] * 2,
     r"arc_easy.jsonl:1: field 'gold' must be an index from 0 to 1 \(got 2\)$"),
    ("arc_easy", "arc_easy.jsonl", [{"query": "Question: y", "choices": ["a", "b"], "gold": 0},
                                    {"query": "y", "choices": ["a", "b"], "gold": 0}],
     r"arc_easy.jsonl:2: field 'query' must be 'Question: \.\.\.' \(got 'y'\)$"),
    ("boolq", "boolq.jsonl", [{"query": "Passage: p\nQuestion: q?", "choices": ["yes", "no"], "gold": 0}] * 2,
     r"boolq.jsonl:1: field 'choices' must be \['no', 'yes'\]"),
    ("winogrande", "winogrande.jsonl", [{"context_options": ["A _ B", "A _ C"], "continuation": "x", "gold": 0}] * 2,
     r"winogrande.jsonl:1: field 'context_options' has a '_' before the blank"),
    ("copa", "copa.jsonl", [{"query": "He slept because", "choices": ["a", "b"], "gold": 0}] * 2,
     r"copa.jsonl:1: field 'query' must end in ', because' or ', therefore' \(got 'He slept because'\)$"),
    ("lambada_openai", "lambada_test.jsonl", [{"text": "one two"}, {"text": ""}],
     r"lambada_test.jsonl:2: field 'text' must be a non-empty string \(got ''\)$"),
])
def test_a_bad_row_is_one_error_naming_the_file_the_line_and_the_field(tmp_path, monkeypatch, name, file, rows,
                                                                        message):
    accept(monkeypatch, name, count=2)
    with pytest.raises(TaskError, match=message) as error:
        load_task(name, source=str(write_jsonl(tmp_path / file, rows)))
    assert "\n" not in str(error.value) and str(tmp_path / file) in str(error.value)


def test_a_truncated_file_is_one_error_with_its_last_line(tmp_path, monkeypatch):
    accept(monkeypatch, "piqa", count=3)
    rows = [{"query": "Question: g\n", "choices": ["a", "b"], "gold": 1}] * 3
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / "piqa.jsonl").write_text(text[:-20])  # cut inside the last line
    with pytest.raises(TaskError, match=r"piqa.jsonl:3: not JSON \("):
        load_task("piqa", source=str(tmp_path / "piqa.jsonl"))
    (tmp_path / "piqa.jsonl").write_text(text.rsplit("{", 1)[0])  # cut at a line's end: two items of three
    with pytest.raises(TaskError, match=r"piqa.jsonl:2: the file ends after 2 items, where PIQA's validation set has 3; "
                                        r"is it truncated\? \(--limit scores fewer\)$"):
        load_task("piqa", source=str(tmp_path / "piqa.jsonl"))


@pytest.mark.parametrize("cut, message", [
    (lambda lines: lines[:-2], r"hellaswag_val_full.txt:10: the file ends inside an item \(each item is 6 lines: "),
    (lambda lines: lines[:7] + ["x"] + lines[8:], r"hellaswag_val_full.txt:8: expected the right ending's index 0-3, "
                                                  r"got 'x'"),
    (lambda lines: lines[:9] + [""] + lines[10:], r"hellaswag_val_full.txt:10: an empty ending"),
])
def test_a_corrupt_or_truncated_llama_cpp_file_names_its_line(tmp_path, monkeypatch, cut, message):
    accept(monkeypatch, "hellaswag", count=2)
    lines = ["Ctx: a man.", "1", "e0", "e1", "e2", "e3"] * 2
    (tmp_path / "hellaswag_val_full.txt").write_text("\n".join(cut(lines)) + "\n")
    with pytest.raises(TaskError, match=message):
        load_task("hellaswag", source=str(tmp_path / "hellaswag_val_full.txt"))


@pytest.mark.parametrize("bad, message", [
    ('"q?",a,b,c,E', r"anatomy_test.csv:2: expected 6 fields \(question, A, B, C, D, answer\), got 5$"),
    ('"q?",a,b,c,d,E', r"anatomy_test.csv:2: field 'answer' \(the 6th\) must be A, B, C or D \(got 'E'\)$"),
])
def test_a_bad_mmlu_row_names_its_file_line_and_field(tmp_path, monkeypatch, bad, message):
    accept(monkeypatch, "mmlu", count=57 * 3)
    mmlu_files(tmp_path, {}, bad)
    with pytest.raises(TaskError, match=message):
        load_task("mmlu", source=str(tmp_path))
    (tmp_path / "dev" / "virology_dev.csv").unlink()
    with pytest.raises(TaskError, match=r"has no dev/virology_dev.csv: MMLU's 57 subjects need their dev and test"):
        load_task("mmlu", source=str(tmp_path))


def test_task_names_and_a_single_file_for_several_tasks(tmp_path):
    assert task_names("suite") == list(BENCHMARKS) and task_names("arc_easy, mmlu") == ["arc_easy", "mmlu"]
    with pytest.raises(TaskError, match=r"^--eval mmlu_x: neither a task \(hellaswag, .*\) nor a JSONL file"):
        task_names("arc_easy,mmlu_x", ("--eval", "--eval-source"))
    with pytest.raises(TaskError, match="a task is named twice"):
        task_names("piqa,piqa")
    write_jsonl(tmp_path / "piqa.jsonl", [{"query": "Question: g\n", "choices": ["a", "b"], "gold": 1}])
    with pytest.raises(TaskError, match=r"--task-source .*piqa.jsonl: names one file, but --task piqa,copa names 2 "
                                        "tasks; name a folder holding their copies"):
        load_tasks("piqa,copa", source=str(tmp_path / "piqa.jsonl"))


# ---- the results JSON: MMLU's groups as lm-eval aggregates them, the suite's summary

def test_mmlu_groups_weigh_subjects_by_size_with_the_pooled_standard_error():
    items = [Item("q", ("A", "B", "C", "D"), 0)] * 6
    task = Task("mmlu", items, parts=(("mmlu_anatomy", 2), ("mmlu_astronomy", 4), ("mmlu_virology", 0)),
                metrics=("acc",), num_fewshot=5)
    lls = (0.0, -1.0, -1.0, -1.0)  # choice 0 picked
    right, wrong = ItemScore(0, 0, lls, (1,) * 4), ItemScore(0, 1, lls, (1,) * 4)
    scores = [right, wrong, right, right, right, wrong]
    out = results_json([(task, scores)], {"model": "m"})
    anatomy, astronomy = metrics(scores[:2], ("acc",)), metrics(scores[2:], ("acc",))
    stem = out["results"]["mmlu_stem"]  # anatomy and astronomy are both STEM
    assert stem["acc,none"] == pytest.approx((0.5 * 2 + 0.75 * 4) / 6) == out["results"]["mmlu"]["acc,none"]
    expected = math.sqrt(((2 - 1) * anatomy["acc_stderr"] ** 2 * 2 + (4 - 1) * astronomy["acc_stderr"] ** 2 * 4)
                         / (6 - 2) / 6)
    assert stem["acc_stderr,none"] == pytest.approx(expected) == pooled_stderr([anatomy["acc_stderr"],
                                                                                astronomy["acc_stderr"]], [2, 4])
    assert out["results"]["mmlu_anatomy"]["alias"] == " - anatomy" and "mmlu_virology" not in out["results"]
    assert out["group_subtasks"] == {"mmlu_stem": ["mmlu_anatomy", "mmlu_astronomy"], "mmlu": ["mmlu_stem"]}
    assert set(out["groups"]) == {"mmlu", "mmlu_stem"} and out["n-shot"]["mmlu_anatomy"] == 5


def test_the_suite_is_the_mean_centered_accuracy_of_its_tasks():
    two = Task("boolq", [Item("c", ("no", "yes"), 1)] * 4, metrics=("acc",))
    lambada = Task("lambada_openai", [Item("c", ("w",), 0)] * 2, LOGLIKELIHOOD, ("perplexity", "acc"))
    scores_two = [ItemScore(i, 1, (0.0, -1.0 if i < 3 else 1.0), (2, 3)) for i in range(4)]  # 1 of 4 right
    scores_lambada = [ItemScore(0, 0, (-2.0,), (1,), True), ItemScore(1, 0, (-4.0,), (1,), True)]
    out = results_json([(two, scores_two), (lambada, scores_lambada)], {}, "suite")
    # boolq: (0.25 - 0.5) / 0.5 = -0.5; lambada_openai: (1.0 - 0) / 1 = 1.0
    assert out["results"]["suite"]["centered_acc,none"] == pytest.approx(0.25)
    assert out["results"]["lambada_openai"]["perplexity,none"] == pytest.approx(math.exp(3.0))
    assert out["group_subtasks"]["suite"] == ["boolq", "lambada_openai"]
    assert out["higher_is_better"]["lambada_openai"] == {"perplexity": False, "acc": True}
