"""The standard tasks, each built as lm-evaluation-harness 0.4's task of that name builds its requests (the task
YAMLs and utils under lm_eval/tasks/ of lm_eval 0.4.13; docs/eval.md quotes them and says where a file's
format makes lm-eval's exact prompt unrecoverable).

A file is read into lm-eval's documents: the rows of the Hugging Face data set its YAML names (dataset_path),
with the fields its templates read (ARC: question, choices.text, choices.label, answerKey; ...). Three kinds of
file give them:
- the original public file (the download default): HellaSwag's, ARC's and OpenBookQA's releases, PIQA's,
  Winogrande's, SuperGLUE's COPA and BoolQ, OpenAI's LAMBADA, MMLU's data.tar;
- llm-foundry's JSONL (the files of the DCLM evaluation and nanochat's CORE), whose rows carry that tool's
  prompt ("Question: ..."), from which lm-eval's fields are taken back where they can be;
- for HellaSwag, the text file llama.cpp's `perplexity --hellaswag` reads (the context already preprocessed,
  not capitalized as lm-eval's process_docs does).
The documents then become Items through lm-eval's templates, written out below with the YAML lines they follow.
A bad row is one TaskError naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import io
import os
import re
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .files import Source
from .items import LOGLIKELIHOOD, Item, TaskError, read_jsonl

# ---- a row's fields, with errors that name the file, the line and the field


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def need(row: object, where: str, key: str, ok: Callable[[object], bool], what: str):
    """row[key] when ok(it); else TaskError "<where>: field '<key>' is missing / must be <what> (got ...)"."""
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected a JSON object with the field '{key}', got {_shown(row)}")
    if key not in row:
        raise TaskError(f"{where}: field '{key}' is missing")
    value = row[key]
    if not ok(value):
        raise TaskError(f"{where}: field '{key}' must be {what} (got {_shown(value)})")
    return value


def text(row, where: str, key: str) -> str:
    return need(row, where, key, lambda v: isinstance(v, str) and v != "", "a non-empty string")


def strings(row, where: str, key: str) -> list[str]:
    return need(row, where, key, lambda v: isinstance(v, list) and len(v) >= 2
                and all(isinstance(s, str) and s for s in v), "a list of two or more non-empty strings")


def index(row, where: str, key: str, count: int) -> int:
    return need(row, where, key, lambda v: type(v) is int and 0 <= v < count, f"an index from 0 to {count - 1}")


def prefixed(value: str, where: str, key: str, prefix: str, suffix: str = "") -> str:
    """value without prefix and suffix, which it must have (llm-foundry's prompt around lm-eval's field)."""
    if not (value.startswith(prefix) and value.endswith(suffix) and len(value) > len(prefix) + len(suffix)):
        raise TaskError(f"{where}: field '{key}' must be {prefix + '...' + suffix!r} (got {_shown(value)})")
    return value[len(prefix):len(value) - len(suffix)]


def letters(count: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(count)]


def jsonl(read_row: Callable[[object, str], dict]) -> Callable[[str, str], list[dict]]:
    """A reader of JSONL text: read_row(row, "<label>:<line>") for each non-blank line."""
    def read(label: str, content: str) -> list[dict]:
        return [read_row(row, f"{label}:{line}") for line, row in read_jsonl(Path(label), content)]
    return read


# ---- HellaSwag (lm_eval/tasks/hellaswag/hellaswag.yaml, utils.py)

def hellaswag_preprocess(text: str) -> str:
    """utils.preprocess: strip, " [title]" -> ". ", drop other [bracketed] tags, "  " -> " "."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_original(row, where: str) -> dict:
    """A row of rowanz/hellaswag's file, checked: the fields process_docs reads."""
    endings = strings(row, where, "endings")
    return {"activity_label": text(row, where, "activity_label"),
            "ctx_a": need(row, where, "ctx_a", lambda v: isinstance(v, str), "a string"),
            "ctx_b": need(row, where, "ctx_b", lambda v: isinstance(v, str), "a string"), "endings": endings,
            "label": need(row, where, "label", lambda v: str(v) in [str(i) for i in range(len(endings))],
                          f"the right ending's index, 0 to {len(endings) - 1}")}


def hellaswag_process(doc: dict) -> dict:
    """utils.process_docs on one row:
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        "query": preprocess(doc["activity_label"] + ": " + ctx),
        "choices": [preprocess(ending) for ending in doc["endings"]], "gold": int(doc["label"])"""
    context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": hellaswag_preprocess(doc["activity_label"] + ": " + context),
            "choices": [hellaswag_preprocess(ending) for ending in doc["endings"]], "gold": int(doc["label"])}


def llama_cpp_hellaswag(label: str, content: str) -> list[dict]:
    """llama.cpp's HellaSwag text: six lines an item (the context, the right ending's index 0-3, four endings),
    preprocessed already; the context's second part is not capitalized as lm-eval's process_docs does. Its rows are
    process_docs' (query, choices, gold) and the data set's label, which the YAML's doc_to_target reads."""
    lines = content.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    layout = "each item is 6 lines: the context, the right ending's index 0-3, four endings"
    docs = []
    for first in range(0, len(lines), 6):
        if first + 6 > len(lines):
            raise TaskError(f"{label}:{len(lines)}: the file ends inside an item ({layout}); is it truncated?")
        query, gold, endings = lines[first], lines[first + 1], lines[first + 2:first + 6]
        if gold not in ("0", "1", "2", "3"):
            raise TaskError(f"{label}:{first + 2}: expected the right ending's index 0-3, got {_shown(gold)} "
                            f"({layout})")
        for line, value in enumerate([query, *endings]):
            if not value.strip():
                number = first + 1 + (line and line + 1)
                raise TaskError(f"{label}:{number}: an empty {'context' if line == 0 else 'ending'} ({layout})")
        docs.append({"query": query, "choices": endings, "gold": int(gold), "label": gold})
    return docs


def hellaswag_item(doc: dict) -> Item:
    """doc_to_text: "{{query}}", doc_to_choice: "choices", doc_to_target: "{{label}}" (the processed gold)."""
    return Item(doc["query"], tuple(doc["choices"]), doc["gold"])


# ---- ARC-Easy and ARC-Challenge (lm_eval/tasks/arc/arc_easy.yaml; arc_challenge.yaml includes it)

def ai2_question(row, where: str, stem_key: str) -> dict:
    """A row of AI2's ARC or OpenBookQA release, {"question": {"stem", "choices": [{"text", "label"}]},
    "answerKey"}, as the Hugging Face data set's row: {stem_key, "choices": {"text", "label"}, "answerKey"}."""
    question = need(row, where, "question", lambda v: isinstance(v, dict), "an object with 'stem' and 'choices'")
    choices = need(question, where, "choices", lambda v: isinstance(v, list) and len(v) >= 2,
                   "a list of two or more {'text', 'label'}")
    texts = [text(choice, where, "text") for choice in choices]
    labels = [text(choice, where, "label") for choice in choices]
    answer = need(row, where, "answerKey", lambda v: isinstance(v, str) and v.lstrip() in labels,
                  f"one of the choices' labels {labels}")
    return {stem_key: text(question, where, "stem"), "choices": {"text": texts, "label": labels}, "answerKey": answer}


def foundry_question(row, where: str, stem_key: str, prefix: str) -> dict:
    """A row of llm-foundry's {"query", "choices", "gold"} with the query prefix + lm-eval's field, as the Hugging
    Face data set's row, labelled A, B, ..."""
    choices = strings(row, where, "choices")
    labels = letters(len(choices))
    stem = prefixed(text(row, where, "query"), where, "query", prefix)
    return {stem_key: stem, "choices": {"text": choices, "label": labels},
            "answerKey": labels[index(row, where, "gold", len(choices))]}


def arc_item(doc: dict) -> Item:
    """doc_to_text: "Question: {{question}}\\nAnswer:", doc_to_choice: "{{choices.text}}",
    doc_to_target: "{{choices.label.index(answerKey)}}"."""
    return Item(f"Question: {doc['question']}\nAnswer:", tuple(doc["choices"]["text"]),
                doc["choices"]["label"].index(doc["answerKey"]))


# ---- PIQA (lm_eval/tasks/piqa/piqa.yaml)

def piqa_original(label: str, content: str, labels: list[str] | None = None) -> list[dict]:
    """PIQA's valid.jsonl ({"goal", "sol1", "sol2"}) with its labels (valid-labels.lst, one 0 or 1 a line), or
    rows that carry their "label"."""
    docs = []
    for number, (line, row) in enumerate(read_jsonl(Path(label), content)):
        where = f"{label}:{line}"
        doc = {"goal": text(row, where, "goal"), "sol1": text(row, where, "sol1"), "sol2": text(row, where, "sol2")}
        if labels is None:
            doc["label"] = index(row, where, "label", 2)
        elif number >= len(labels) or labels[number] not in ("0", "1"):
            raise TaskError(f"{where}: its label (line {number + 1} of the labels file) is "
                            f"{'missing' if number >= len(labels) else _shown(labels[number])}; expected 0 or 1")
        else:
            doc["label"] = int(labels[number])
        docs.append(doc)
    if labels is not None and len(labels) != len(docs):
        raise TaskError(f"{label}: {len(docs)} items but {len(labels)} labels")
    return docs


def foundry_piqa(row, where: str) -> dict:
    """llm-foundry's {"query": "Question: <goal>\\n", "choices": [sol1, sol2] (stripped), "gold"}."""
    sol1, sol2 = need(row, where, "choices", lambda v: isinstance(v, list) and len(v) == 2
                      and all(isinstance(s, str) and s for s in v), "a list of two non-empty strings")
    return {"goal": prefixed(text(row, where, "query"), where, "query", "Question: ", "\n"), "sol1": sol1,
            "sol2": sol2, "label": index(row, where, "gold", 2)}


def piqa_item(doc: dict) -> Item:
    """doc_to_text: "Question: {{goal}}\\nAnswer:", doc_to_choice: "{{[sol1, sol2]}}", doc_to_target: label."""
    return Item(f"Question: {doc['goal']}\nAnswer:", (doc["sol1"], doc["sol2"]), doc["label"])


# ---- Winogrande (lm_eval/tasks/winogrande/default.yaml, preprocess_winogrande.py)

def winogrande_original(row, where: str) -> dict:
    sentence = need(row, where, "sentence", lambda v: isinstance(v, str) and "_" in v, "a sentence with a blank _")
    return {"sentence": sentence, "option1": text(row, where, "option1"), "option2": text(row, where, "option2"),
            "answer": need(row, where, "answer", lambda v: v in ("1", "2"), "'1' or '2'")}


def foundry_winogrande(row, where: str) -> dict:
    """llm-foundry's {"context_options": [the sentence up to the blank with each option], "continuation": what
    follows the blank, stripped, "gold"} as a row of lm-eval's data set: the part the options share becomes the
    sentence before the blank, the rest of each its option (doc_to_choice joins them again)."""
    options = need(row, where, "context_options", lambda v: isinstance(v, list) and len(v) == 2
                   and all(isinstance(s, str) and s for s in v), "a list of two non-empty strings")
    shared = os.path.commonprefix(options)
    if "_" in shared:
        raise TaskError(f"{where}: field 'context_options' has a '_' before the blank, which lm-eval would take "
                        "for the blank")
    return {"sentence": shared + "_ " + text(row, where, "continuation"), "option1": options[0][len(shared):],
            "option2": options[1][len(shared):], "answer": str(index(row, where, "gold", 2) + 1)}


def winogrande_item(doc: dict) -> Item:
    """Partial scoring (lm-eval's multiple inputs: doc_to_text returns the answer's index):
        doc_to_choice: idx = doc["sentence"].index("_"); [doc["sentence"][:idx] + opt for opt in options]
        doc_to_target: doc["sentence"][idx + 1:].strip()
    each choice is a context, followed by the target delimiter and the target."""
    sentence = doc["sentence"]
    blank = sentence.index("_")
    return Item("", (sentence[:blank] + doc["option1"], sentence[:blank] + doc["option2"]),
                {"1": 0, "2": 1}[doc["answer"]], sentence[blank + 1:].strip())


# ---- OpenBookQA (lm_eval/tasks/openbookqa/openbookqa.yaml)

def openbookqa_item(doc: dict) -> Item:
    """doc_to_text: question_stem, doc_to_choice: "{{choices.text}}",
    doc_to_target: "{{choices.label.index(answerKey.lstrip())}}"."""
    return Item(doc["question_stem"], tuple(doc["choices"]["text"]),
                doc["choices"]["label"].index(doc["answerKey"].lstrip()))


# ---- COPA (lm_eval/tasks/super_glue/copa/default.yaml, utils.py)

COPA_CONNECTORS = {"cause": "because", "effect": "therefore"}


def copa_original(row, where: str) -> dict:
    return {"premise": text(row, where, "premise"), "choice1": text(row, where, "choice1"),
            "choice2": text(row, where, "choice2"),
            "question": need(row, where, "question", lambda v: v in COPA_CONNECTORS, "'cause' or 'effect'"),
            "label": index(row, where, "label", 2)}


def foundry_copa(row, where: str) -> dict:
    """llm-foundry's {"query": "<premise without its period>, because|therefore", "choices" (first letters
    lowercased), "gold"} as SuperGLUE's row; the premise's last character, which doc_to_text drops, comes back
    as a period."""
    query = text(row, where, "query")
    stem, _, connector = query.rpartition(", ")
    question = {word: name for name, word in COPA_CONNECTORS.items()}.get(connector)
    if not stem or question is None:
        raise TaskError(f"{where}: field 'query' must end in ', because' or ', therefore' (got {_shown(query)})")
    choice1, choice2 = need(row, where, "choices", lambda v: isinstance(v, list) and len(v) == 2
                            and all(isinstance(s, str) and s for s in v), "a list of two non-empty strings")
    return {"premise": stem + ".", "choice1": choice1, "choice2": choice2, "question": question,
            "label": index(row, where, "gold", 2)}


def copa_item(doc: dict) -> Item:
    """utils.doc_to_text: doc["premise"].strip()[:-1] + f" {connector}";
    utils.doc_to_choice: [" " + convert_choice(doc["choice1"]), " " + convert_choice(doc["choice2"])], where
    convert_choice lowercases the first character: each continuation is the delimiter " " then " " + choice."""
    def convert(choice: str) -> str:
        return choice[0].lower() + choice[1:]
    return Item(doc["premise"].strip()[:-1] + " " + COPA_CONNECTORS[doc["question"]],
                (" " + convert(doc["choice1"]), " " + convert(doc["choice2"])), doc["label"])


# ---- BoolQ (lm_eval/tasks/super_glue/boolq/default.yaml)

def boolq_original(row, where: str) -> dict:
    """SuperGLUE's BoolQ row, {"question", "passage", "label": true/false}."""
    label = need(row, where, "label", lambda v: isinstance(v, bool) or v in (0, 1), "true or false")
    return {"question": text(row, where, "question"), "passage": text(row, where, "passage"), "label": int(label)}


def foundry_boolq(row, where: str) -> dict:
    """llm-foundry's {"query": "Passage: <passage>\\nQuestion: <question>?", "choices": ["no", "yes"], "gold"}."""
    query = prefixed(text(row, where, "query"), where, "query", "Passage: ", "?")
    passage, separator, question = query.rpartition("\nQuestion: ")
    if not separator or not passage or not question:
        raise TaskError(f"{where}: field 'query' must be 'Passage: ...\\nQuestion: ...?' (got {_shown(query)})")
    need(row, where, "choices", lambda v: v == ["no", "yes"], "['no', 'yes']")
    return {"question": question, "passage": passage, "label": index(row, where, "gold", 2)}


def boolq_item(doc: dict) -> Item:
    """doc_to_text: "{{passage}}\\nQuestion: {{question}}?\\nAnswer:", doc_to_choice: ["no", "yes"],
    doc_to_target: label."""
    return Item(f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", ("no", "yes"), doc["label"])


# ---- LAMBADA, OpenAI's version (lm_eval/tasks/lambada/lambada_openai.yaml)

def lambada_original(row, where: str) -> dict:
    value = text(row, where, "text")
    if " " not in value:
        raise TaskError(f"{where}: field 'text' must hold a space before its last word (got {_shown(value)})")
    return {"text": value}


def foundry_lambada(row, where: str) -> dict:
    """llm-foundry's {"context": all but the last word, "continuation": the last word}, joined by the space
    lm-eval splits at."""
    return {"text": text(row, where, "context") + " " + text(row, where, "continuation")}


def lambada_item(doc: dict) -> Item:
    """output_type: loglikelihood, doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}",
    doc_to_target: "{{' '+text.split(' ')[-1]}}": the request (context, " " + last word)."""
    words = doc["text"].split(" ")
    return Item(" ".join(words[:-1]), (words[-1],), 0)


# ---- MMLU (lm_eval/tasks/mmlu/default/_default_template_yaml, mmlu_<subject>.yaml, _mmlu.yaml)

MMLU_SHOTS = 5
MMLU_CATEGORIES = {  # lm_eval/tasks/mmlu/_generate_configs.py's SUBJECTS, the groups of _mmlu.yaml
    "stem": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
            "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
            "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
            "high_school_mathematics high_school_physics high_school_statistics machine_learning",
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
             "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology",
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics "
                       "high_school_macroeconomics high_school_microeconomics high_school_psychology "
                       "human_sexuality professional_psychology public_relations security_studies sociology "
                       "us_foreign_policy",
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
                  "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy "
                  "prehistory professional_law world_religions",
}
MMLU_SUBJECTS = sorted(s for subjects in MMLU_CATEGORIES.values() for s in subjects.split())
MMLU_FIELDS = "question, A, B, C, D, answer"


def mmlu_rows(label: str, content: str, subject: str) -> list[dict]:
    """A subject's CSV (no header; question, the four choices, the answer's letter) as cais/mmlu's rows
    {question, subject, choices, answer} (read with Python's csv module as the data set's script did)."""
    docs = []
    reader = csv.reader(io.StringIO(content, newline=""))
    try:
        for fields in reader:
            where = f"{label}:{reader.line_num}"
            if len(fields) != 6:
                raise TaskError(f"{where}: expected 6 fields ({MMLU_FIELDS}), got {len(fields)}")
            if fields[5] not in ("A", "B", "C", "D"):
                raise TaskError(f"{where}: field 'answer' (the 6th) must be A, B, C or D (got {_shown(fields[5])})")
            if not fields[0].strip():
                raise TaskError(f"{where}: field 'question' (the 1st) is empty")
            docs.append({"question": fields[0], "subject": subject, "choices": fields[1:5],
                         "answer": "ABCD".index(fields[5])})
    except csv.Error as e:
        raise TaskError(f"{label}:{reader.line_num}: not CSV ({e})") from None
    return docs


def mmlu_text(doc: dict) -> str:
    """doc_to_text: "{{question.strip()}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}\\nD.
    {{choices[3]}}\\nAnswer:"."""
    a, b, c, d = doc["choices"]
    return f"{doc['question'].strip()}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"


def mmlu_description(subject: str) -> str:
    """mmlu_<subject>.yaml's description (_generate_configs.py: "The following are multiple choice questions
    (with answers) about {' '.join(subject.split('_'))}.\\n\\n")."""
    return f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"


def mmlu_items(docs: list[dict], shots: dict[str, list[dict]]) -> list[Item]:
    """5-shot as lm-eval 0.4's fewshot_context lays it out: the description, then for each of the first five
    dev rows of the subject (fewshot_config: sampler: first_n) its text, the target delimiter " ", its answer's
    letter (doc_to_choice: ["A", "B", "C", "D"]) and the fewshot delimiter "\\n\\n", then the row's text."""
    prefixes = {subject: mmlu_description(subject) + "".join(
        mmlu_text(shot) + " " + "ABCD"[shot["answer"]] + "\n\n" for shot in rows[:MMLU_SHOTS])
        for subject, rows in shots.items()}
    return [Item(prefixes[doc["subject"]] + mmlu_text(doc), ("A", "B", "C", "D"), doc["answer"]) for doc in docs]


# ---- the tasks

@dataclass(frozen=True)
class Format:
    """A kind of file a task reads. names: what a copy is called (a file name, or a path ending, looked for in a
    --task-source folder); member: the file read inside a .zip (None: the file itself); keys: the JSON fields
    that tell a row of it (a .txt or .tar file is told by its suffix); processed: its rows are already what
    lm-eval's process_docs makes."""
    name: str
    names: tuple[str, ...]
    read: Callable[[str, str], list[dict]]
    keys: frozenset = frozenset()
    member: str | None = None
    processed: bool = False


@dataclass(frozen=True)
class Benchmark:
    """A task: lm-eval's name for it, what its set is (title), its original files (the first is the one read;
    the others lie beside it), the formats it reads, the item counts its set has, how a document becomes an
    Item, and what lm-eval reports of it. yaml: its task file under lm_eval/tasks/."""
    name: str
    title: str
    sources: tuple[Source, ...]
    formats: tuple[Format, ...]
    counts: tuple[int, ...]
    to_item: Callable[[dict], Item] | None
    yaml: str
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    kind: str = "multiple_choice"
    log_key: str = ""
    num_fewshot: int = 0
    process: Callable[[dict], dict] | None = None  # lm-eval's process_docs on one row (a raw row's format only)


@dataclass
class Documents:
    """What a file gave: lm-eval's documents (and MMLU's few-shot rows by subject), which format, from where."""
    docs: list[dict]
    format: Format
    path: Path
    shots: dict[str, list[dict]] = field(default_factory=dict)


AI2 = "https://s3-us-west-2.amazonaws.com/ai2-website/data/"
SUPERGLUE = "https://dl.fbaipublicfiles.com/glue/superglue/data/v2/"
ARC_ZIP = Source(AI2 + "ARC-V1-Feb2018.zip", "arc/ARC-V1-Feb2018.zip")


def arc(name: str, config: str, count: int, foundry_name: str) -> Benchmark:
    return Benchmark(
        name, f"{config}'s test set", (ARC_ZIP,),
        (Format("original", ("ARC-V1-Feb2018.zip", f"{config}-Test.jsonl"),
                jsonl(lambda row, where: ai2_question(row, where, "question")), frozenset({"question", "answerKey"}),
                member=f"{config}/{config}-Test.jsonl"),
         Format("llm-foundry", (f"{foundry_name}.jsonl",),
                jsonl(lambda row, where: foundry_question(row, where, "question", "Question: ")),
                frozenset({"query", "choices", "gold"}))),
        (count,), arc_item, f"arc/{name}.yaml")


BENCHMARKS = {b.name: b for b in [
    Benchmark("hellaswag", "HellaSwag's validation set",
              # rowanz/hellaswag's file, as llm.c's dev/data/hellaswag.py downloads it; pinned by the git blob id
              # of data/hellaswag_val.jsonl in that repository's tree
              (Source("https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl",
                      "hellaswag/hellaswag_val.jsonl", "0f5ee25d72216f12317d5d8a7b92deafa423d81e"),),
              (Format("original", ("hellaswag_val.jsonl",), jsonl(hellaswag_original), frozenset({"ctx_a", "endings"})),
               Format("llama.cpp", ("hellaswag_val_full.txt",), llama_cpp_hellaswag, processed=True)),
              (10_042,), hellaswag_item, "hellaswag/hellaswag.yaml", log_key="hella", process=hellaswag_process),
    arc("arc_easy", "ARC-Easy", 2_376, "arc_easy"),
    arc("arc_challenge", "ARC-Challenge", 1_172, "arc_challenge"),
    Benchmark("piqa", "PIQA's validation set",
              # ybisk/ybisk.github.io (yonatanbisk.com) serves PIQA's files; git blob ids read in its tree at
              # commit 21edab43
              (Source("https://raw.githubusercontent.com/ybisk/ybisk.github.io/master/piqa/data/valid.jsonl",
                      "piqa/valid.jsonl", "da35972044f4a35e0053ff09a97ed7926ed3b8b4"),
               Source("https://raw.githubusercontent.com/ybisk/ybisk.github.io/master/piqa/data/valid-labels.lst",
                      "piqa/valid-labels.lst", "2cec30af5415a24647d70417db4df35c202c6c34")),
              (Format("original", ("valid.jsonl",), piqa_original, frozenset({"goal", "sol1", "sol2"})),
               Format("llm-foundry", ("piqa.jsonl",), jsonl(foundry_piqa), frozenset({"query", "choices", "gold"}))),
              (1_838,), piqa_item, "piqa/piqa.yaml"),
    Benchmark("winogrande", "Winogrande's (xl) validation set",
              (Source("https://storage.googleapis.com/ai2-mosaic/public/winogrande/winogrande_1.1.zip",
                      "winogrande/winogrande_1.1.zip"),),
              (Format("original", ("winogrande_1.1.zip", "winogrande_1.1/dev.jsonl"), jsonl(winogrande_original),
                      frozenset({"sentence", "option1", "option2"}), member="winogrande_1.1/dev.jsonl"),
               Format("llm-foundry", ("winogrande.jsonl",), jsonl(foundry_winogrande),
                      frozenset({"context_options", "continuation"}))),
              (1_267,), winogrande_item, "winogrande/default.yaml", metrics=("acc",)),
    Benchmark("openbookqa", "OpenBookQA's test set",
              (Source(AI2 + "OpenBookQA-V1-Sep2018.zip", "openbookqa/OpenBookQA-V1-Sep2018.zip"),),
              (Format("original", ("OpenBookQA-V1-Sep2018.zip", "Data/Main/test.jsonl"),
                      jsonl(lambda row, where: ai2_question(row, where, "question_stem")),
                      frozenset({"question", "answerKey"}), member="Data/Main/test.jsonl"),
               Format("llm-foundry", ("openbook_qa.jsonl", "openbookqa.jsonl"),
                      jsonl(lambda row, where: foundry_question(row, where, "question_stem", "")),
                      frozenset({"query", "choices", "gold"}))),
              (500,), openbookqa_item, "openbookqa/openbookqa.yaml"),
    Benchmark("copa", "COPA's validation set (SuperGLUE)",
              (Source(SUPERGLUE + "COPA.zip", "copa/COPA.zip"),),
              (Format("original", ("COPA.zip", "COPA/val.jsonl"), jsonl(copa_original), frozenset({"premise"}),
                      member="COPA/val.jsonl"),
               Format("llm-foundry", ("copa.jsonl",), jsonl(foundry_copa), frozenset({"query", "choices", "gold"}))),
              (100,), copa_item, "super_glue/copa/default.yaml", metrics=("acc",)),
    Benchmark("boolq", "BoolQ's validation set (SuperGLUE)",
              (Source(SUPERGLUE + "BoolQ.zip", "boolq/BoolQ.zip"),),
              (Format("original", ("BoolQ.zip", "BoolQ/val.jsonl"), jsonl(boolq_original),
                      frozenset({"passage", "question", "label"}), member="BoolQ/val.jsonl"),
               Format("llm-foundry", ("boolq.jsonl",), jsonl(foundry_boolq), frozenset({"query", "choices", "gold"}))),
              (3_270,), boolq_item, "super_glue/boolq/default.yaml", metrics=("acc",)),
    Benchmark("lambada_openai", "LAMBADA's test set (OpenAI's version)",
              (Source("https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl",
                      "lambada_openai/lambada_test.jsonl"),),
              (Format("original", ("lambada_test.jsonl",), jsonl(lambada_original), frozenset({"text"})),
               Format("llm-foundry", ("lambada_openai.jsonl",), jsonl(foundry_lambada),
                      frozenset({"context", "continuation"}))),
              (5_153,), lambada_item, "lambada/lambada_openai.yaml",
              metrics=("perplexity", "acc"), kind=LOGLIKELIHOOD, log_key="lambada"),
    Benchmark("mmlu", "MMLU's test set, 57 subjects",
              (Source("https://people.eecs.berkeley.edu/~hendrycks/data.tar", "mmlu/data.tar"),),
              # 14,042: the release cais/mmlu (lm-eval's) holds; 14,079: the early one in hendrycks/test's data/
              (Format("original", ("data.tar", f"dev/{MMLU_SUBJECTS[0]}_dev.csv"), None),),
              (14_042, 14_079), None, "mmlu/default/_mmlu.yaml", metrics=("acc",), num_fewshot=MMLU_SHOTS),
]}


# ---- reading a task's file

def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def zip_member(path: Path, member: str) -> tuple[str, str]:
    """(label, text) of the archive's file whose path ends in `member`."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n == member or n.endswith("/" + member)]
            if not names:
                raise TaskError(f"{path} holds no {member}: is it the right archive?")
            return f"{path}:{names[0]}", archive.read(names[0]).decode("utf-8")
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def format_of(benchmark: Benchmark, path: Path) -> tuple[Format, str, str]:
    """(the file's format, a label for errors, its text) by its suffix or its first row's fields."""
    if path.suffix == ".zip":
        for fmt in benchmark.formats:
            if fmt.member:
                label, content = zip_member(path, fmt.member)
                return fmt, label, content
    content = read_text(path)
    if path.suffix == ".txt":
        for fmt in benchmark.formats:
            if fmt.name == "llama.cpp":
                return fmt, str(path), content
    rows = read_jsonl(path, content.split("\n", 1)[0]) if content.strip() else []
    first = rows[0][1] if rows else None
    for fmt in benchmark.formats:
        if fmt.keys and isinstance(first, dict) and fmt.keys <= first.keys():
            return fmt, str(path), content
    kinds = "; ".join(f"{fmt.name}: {', '.join(sorted(fmt.keys)) or fmt.names[0]}" for fmt in benchmark.formats)
    raise TaskError(f"{path}:1: not a file of {benchmark.name} (its formats and their fields: {kinds})")


def read_documents(benchmark: Benchmark, path: Path) -> Documents:
    """lm-eval's documents of the task from its file (MMLU: data.tar or a folder with dev/ and test/)."""
    if benchmark.name == "mmlu":
        return read_mmlu(benchmark, path)
    fmt, label, content = format_of(benchmark, path)
    if benchmark.name == "piqa" and fmt.name == "original":
        docs = piqa_original(label, content, piqa_labels(path))
    else:
        docs = fmt.read(label, content)
    check_count(benchmark, docs, last_line(label, content))
    return Documents(docs, fmt, path)


def piqa_labels(path: Path) -> list[str] | None:
    """valid-labels.lst beside PIQA's valid.jsonl (None: the rows must carry their label)."""
    beside = path.with_name(path.name.replace(".jsonl", "-labels.lst"))
    return read_text(beside).split() if beside.is_file() else None


def check_count(benchmark: Benchmark, docs: list, where: str) -> None:
    """A file of another size than its set's is an error (a truncated file may end on a line boundary)."""
    if len(docs) not in benchmark.counts:
        expected = " or ".join(f"{c:,}" for c in benchmark.counts)
        raise TaskError(f"{where}: the file ends after {len(docs):,} items, where {benchmark.title} has {expected}; "
                        "is it truncated? (--limit scores fewer)")


def last_line(label: str, content: str) -> str:
    """"<label>:<the last line's number>", where a file's item count is found wrong."""
    lines = content.count("\n") + (not content.endswith("\n"))
    return f"{label}:{lines}"


def read_mmlu(benchmark: Benchmark, path: Path) -> Documents:
    """MMLU from data.tar (data/dev/<subject>_dev.csv, data/test/<subject>_test.csv) or a folder holding dev/ and
    test/ (or data/dev and data/test): each subject's test rows, and its dev rows for the few shots."""
    files = {}
    if path.is_file():
        try:
            with tarfile.open(path) as archive:
                for member in archive.getmembers():
                    parts = member.name.split("/")
                    if member.isfile() and len(parts) >= 2 and parts[-2] in ("dev", "test"):
                        files[parts[-2], parts[-1]] = (f"{path}:{member.name}",
                                                       archive.extractfile(member).read().decode("utf-8"))
        except (OSError, tarfile.TarError, UnicodeDecodeError) as e:
            raise TaskError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    else:
        root = path / "data" if (path / "data" / "dev").is_dir() else path
        for split in ("dev", "test"):
            for csv_path in sorted((root / split).glob(f"*_{split}.csv")):
                files[split, csv_path.name] = (str(csv_path), read_text(csv_path))
    for subject in MMLU_SUBJECTS:
        for split in ("dev", "test"):
            if (split, f"{subject}_{split}.csv") not in files:
                raise TaskError(f"{path} has no {split}/{subject}_{split}.csv: MMLU's 57 subjects need their dev and "
                                "test files (data.tar, or a folder with dev/ and test/)")
    docs, shots = [], {}
    for subject in MMLU_SUBJECTS:
        shots[subject] = mmlu_rows(*files["dev", f"{subject}_dev.csv"], subject)
        if len(shots[subject]) < MMLU_SHOTS:
            label = files["dev", f"{subject}_dev.csv"][0]
            raise TaskError(f"{label}: {len(shots[subject])} rows; the 5-shot prompt needs {MMLU_SHOTS}")
        label, content = files["test", f"{subject}_test.csv"]
        docs += mmlu_rows(label, content, subject)
    check_count(benchmark, docs, f"{path} (its test files)")
    return Documents(docs, benchmark.formats[0], path, shots)


def benchmark_items(benchmark: Benchmark, documents: Documents) -> list[Item]:
    """The task's items from its documents (process_docs first where the file's rows are lm-eval's raw ones)."""
    if benchmark.name == "mmlu":
        return mmlu_items(documents.docs, documents.shots)
    process = benchmark.process if benchmark.process is not None and not documents.format.processed else None
    return [benchmark.to_item(process(doc) if process else doc) for doc in documents.docs]
