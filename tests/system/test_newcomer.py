"""What a newcomer trips over (issue 49), each as the user meets it: the exit code, one line, no
traceback, no folder left behind, and a cache shared by every directory."""

import re
import runpy
import subprocess
import sys

import pytest

import train_llama
from llama.run import trainer
from llama.data import datasets, starter_pack
from llama.cache import cache_dir
from llama.data.tokenizer import default_tokenizer_path
from llama.run.plan import RECIPES, PlanError, choose_recipe
from tests.runs import BASE, REPO, log_lines, run, signal_at
from tests.sample_files import ranks_file_bytes


def one_error_line(capsys) -> str:
    """stderr of a refused or stopped run: one line besides the notes (the tokenizer's fetch), no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line and not line.startswith("note: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- 1. --resume needs a checkpoint; --resume auto starts anew without one


@pytest.mark.parametrize("prepare, holds", [(lambda folder: None, "does not exist"),
                                            (lambda folder: folder.mkdir(), "is empty"),
                                            (lambda folder: (folder.mkdir(), (folder / "notes.txt").write_text("x")),
                                             "holds notes.txt")])
def test_resume_without_a_checkpoint_is_one_line_naming_the_folder(corpus, tmp_path, capsys, prepare, holds):
    prepare(tmp_path / "empty")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run(*BASE, *corpus, "-x", "2", "-o", "empty", "--resume") == 2
    err = one_error_line(capsys)
    assert err.startswith(f"error: --resume: empty {holds}, and no complete checkpoint to continue from; start a "
                          "new run without --resume, or pass --resume auto"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made


@pytest.mark.slow
def test_resume_auto_starts_anew_then_continues_and_says_which(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "2", "-o", "job", "--resume", "auto") == 0
    assert "--resume auto: job holds no complete checkpoint; starting a new run" in capsys.readouterr().out
    assert run(*BASE, *corpus, "-x", "4", "-o", "job", "--resume", "auto") == 0
    assert "resuming from job/ckpt_00000002 (step 2)" in capsys.readouterr().out
    assert sorted(log_lines(tmp_path / "job")) == [0, 1, 2, 3]


# ---- 2, 7. Ctrl-C anywhere: one line, the exit code, no promise of a checkpoint that does not exist


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["make_plan", "prepare_builtin_corpus"])  # start-up, data preparation
def test_ctrl_c_before_training_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch, capsys, where):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trainer, where, interrupt)
    assert run("-e", "tiny", "-t", "32", "-x", "2", "-s", "0") == 130
    assert one_error_line(capsys) == "interrupted, before any checkpoint was written: nothing to resume"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_when_the_guard_refused_every_checkpoint_offers_no_resume(corpus, tmp_path, monkeypatch, capsys):
    """Stopped at step 2 with the checkpoint guard refusing the weights: no checkpoint, so no --resume."""
    monkeypatch.setattr(trainer.CheckpointGuard, "judge", lambda self, params, loss: (trainer.SKIP, None))
    signal_at(monkeypatch, 1)
    assert run(*BASE, *corpus, "-x", "10", "-o", "out") == 130
    out, err = capsys.readouterr()
    assert "checkpoint None" in out and "--resume" not in err
    assert err.strip().splitlines()[-1] == "no checkpoint was written: nothing to resume"


@pytest.fixture
def checkpoint(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "1", "-v", "0", "-o", "out") == 0
    capsys.readouterr()
    return tmp_path / "out"


def script_main(name: str, **replacements):
    """main() of scripts/<name>.py with some of its globals replaced."""
    main = runpy.run_path(str(REPO / "scripts" / f"{name}.py"))["main"]
    main.__globals__.update(replacements)
    return main


def test_ctrl_c_during_generation_is_one_line(checkpoint, capsys):
    assert script_main("generate", generate=interrupt)([str(checkpoint), "--prompt", "x", "--device", "cpu"]) == 130
    assert one_error_line(capsys) == "interrupted"


def test_ctrl_c_during_export_is_one_line_and_writes_nothing(checkpoint, tmp_path, capsys):
    assert script_main("export_hf", save_hf_folder=interrupt)([str(checkpoint), "exported"]) == 130
    assert one_error_line(capsys) == "interrupted; exported is as it was"
    assert not (tmp_path / "exported").exists()


def test_ctrl_c_during_the_starter_pack_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(starter_pack, "fetch_llama3_tokenizer", interrupt)
    assert starter_pack.main(["--dest", str(tmp_path / "pack")]) == 130
    assert one_error_line(capsys).startswith("interrupted; what was finished is kept in")


@pytest.mark.parametrize("name, argv", [("generate", ["nowhere"]), ("export_hf", ["nowhere", "exported"])])
def test_generate_and_export_exit_2_for_a_users_mistake_as_the_trainer_does(tmp_path, monkeypatch, capsys, name,
                                                                           argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nowhere").mkdir()
    assert script_main(name)([*argv, "--prompt", "x"] if name == "generate" else argv) == 2
    assert one_error_line(capsys) == "error: nowhere holds no complete checkpoint"


# ---- 2. a documented command on a machine without what it needs: one line, what is missing, how to get it

HIDDEN = {"torch": "raise ModuleNotFoundError(\"No module named 'torch'\")\n",
          "pycuda": "raise ModuleNotFoundError(\"No module named 'pycuda'\")\n"}


@pytest.mark.slow
@pytest.mark.parametrize("path, args, needs", [
    ("scripts/bench_step.py", [], "needs torch, which does not import here"),
    ("scripts/bench_step.py", ["--no-torch"], "needs a CUDA GPU through pycuda, and none is usable here"),
    ("scripts/bench_gpu.py", [], "needs torch"),
    ("scripts/bench_matmul.py", [], "needs torch"),
    ("scripts/bench_attention.py", [], "needs torch"),
    ("scripts/bench_doc_mask.py", [], "needs torch"),
    ("scripts/bench_decode.py", [], "needs a CUDA GPU through pycuda"),
    ("scripts/bench_multi_gpu.py", [], "needs pycuda, which does not import here"),
    ("dev/cuda/decode_step.py", [], "needs a CUDA GPU through pycuda"),
])
def test_a_command_without_torch_or_pycuda_says_what_is_missing_in_one_line(tmp_path, path, args, needs):
    for module, text in HIDDEN.items():
        (tmp_path / f"{module}.py").write_text(text)
    result = subprocess.run([sys.executable, str(REPO / path), *args], capture_output=True, text=True,
                            env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {path} {needs}") and "install" in result.stderr, result.stderr


# ---- 3. --help agrees with what the plan runs


def help_entry(text: str, option: str) -> str:
    entry = re.search(rf"\n  {re.escape(option)}[ \n].*?(?=\n  -|\n\n)", text, re.S).group(0)
    return " ".join(entry.split())


@pytest.mark.parametrize("option, kind, values", [("--recompute", 0, ("none", "partial", "full")),
                                                  ("--optimizer", 1, ("adamw", "adamw8bit")),
                                                  ("--optimizer-in-backward", 2, (True,))])
def test_help_names_the_models_that_run_each_recipe_as_the_plan_decides(monkeypatch, capsys, option, kind, values):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        train_llama.main(["--help"])
    entry = help_entry(capsys.readouterr().out, option)
    assert "the CPU reference so far" not in entry
    names = {"cpu": "the CPU reference", "bf16": "bf16", "fp8": "fp8", "fp32": "fp32"}
    for value in values:
        clause = entry.split("Runs on ")[1].split(". default")[0]
        if value is not True:
            clause = next(c for c in clause.split("; ") if c.startswith(f"{value}: "))
        for path in RECIPES:
            recipe = [None, None, None]
            recipe[kind] = value
            try:
                choose_recipe(path, *recipe)
                runs = True
            except PlanError:
                runs = False
            assert (re.search(rf"(^|\W){re.escape(names[path])}(\W|$)", clause) is not None) == runs, (path, clause)


def test_help_of_the_optimizer_in_the_backward_describes_the_mixed_estimate(capsys):
    with pytest.raises(SystemExit):
        train_llama.main(["--help"])
    entry = help_entry(capsys.readouterr().out, "--optimizer-in-backward")
    assert "previous step's norm" not in entry and "this step's norms of the groups done so far" in entry
    assert "this step's norms of the groups done so far, the others' of the last step" in \
        " ".join((REPO / "README.md").read_text().split())


def test_bench_step_help_cites_no_issue_number():
    text = (REPO / "scripts" / "bench_step.py").read_text()
    assert not re.search(r"issue \d+", text.split('"""')[1])


def test_a_negative_value_taken_for_an_option_gets_a_hint(capsys):
    with pytest.raises(SystemExit) as stop:
        train_llama.main(["-l", "-1e-3"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "argument -l/--lr: expected one argument (if -1e-3 is its value, write -l=-1e-3)")


# ---- 4. a refused run leaves no folder


@pytest.mark.parametrize("extra", [["-e", "smal"], ["--dtype", "bf16"], ["-t", "100000"]])  # run() adds --device cpu
def test_a_refused_run_leaves_no_folder(corpus, tmp_path, capsys, extra):
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run(*BASE, *corpus, "-x", "1", *extra, "-o", "runs/d12") == 2
    assert one_error_line(capsys).startswith("error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert run(*BASE, *corpus, "-x", "1", "-e", "smal") == 2  # the default folder, out
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---- 5. one cache for every directory


@pytest.mark.slow
def test_the_tokenizer_and_the_builtin_corpus_are_shared_by_every_directory(tmp_path, monkeypatch, capsys):
    few = datasets.stdlib_sources()[:60]
    monkeypatch.setattr(datasets, "stdlib_sources", lambda: few)
    default_tokenizer_path().parent.mkdir(parents=True)
    default_tokenizer_path().write_bytes(ranks_file_bytes())  # a small Llama 3 format tokenizer, vocab 517
    shards = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        assert run("-e", "tiny", "-t", "32", "-x", "1", "-s", "0", "-v", "0") == 0
        out = capsys.readouterr().out
        assert f"data: the built-in corpus (this Python's standard library sources, {cache_dir() / 'builtin'}" in out
        shards.append({p: p.stat().st_mtime_ns for p in (cache_dir() / "builtin").iterdir()})
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["out"]  # no data/ here
    assert shards[0] == shards[1] and sorted(p.name for p in shards[0]) == ["stdlib_v517_train.bin",
                                                                            "stdlib_v517_val.bin"]


def test_the_cache_moves_with_xdg_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CUDA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "llama-cuda"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "llama-cuda"
    monkeypatch.setenv("LLAMA_CUDA_CACHE", str(tmp_path / "moved"))
    assert default_tokenizer_path() == tmp_path / "moved" / "tokenizer" / "tokenizer.model"


# ---- 7. .gitignore covers what the documented commands make; docs say what s:N is


@pytest.mark.parametrize("path", ["out/main.log", "out_2/main.log", "out_13/ckpt_00000002/DONE", "runs/d12/main.log",
                                  "exported/llama1b/config.json", "Llama-3.2-1B-Instruct/config.json", "data/mine/x.bin"])
def test_gitignore_covers_what_the_documented_commands_create(path):
    result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
    if result.returncode == 128:
        pytest.skip("not a git checkout")
    assert result.returncode == 0, f"{path} is not ignored"


def test_readme_runs_no_example_inside_the_default_run_folder_and_shows_generate_on_the_cpu():
    readme = (REPO / "README.md").read_text()
    assert not re.search(r"-o out/", readme) and not re.search(r"generate\.py out/", readme)
    assert "--device cpu" in readme.split("## Generate")[1].split("##")[0]
    assert "huggingface-cli download meta-llama/Llama-3.2-1B-Instruct" in readme
    assert "s:99" in (REPO / "docs" / "runs.md").read_text()
