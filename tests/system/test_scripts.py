"""The scripts' command lines: values that make no sense are usage errors (exit code 2, one line, as
in train_llama.py), so is a model or checkpoint that does not exist, bad inputs end in one line, and
--help works everywhere, even where torch is not installed."""

import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest

from llama.data import starter_pack
from tests.runs import REPO


def script(name: str, folder: str = "scripts"):
    """main() of <folder>/<name>.py."""
    return runpy.run_path(str(REPO / folder / f"{name}.py"))["main"]


@pytest.mark.parametrize("name, extra, message", [
    ("generate", ["--top-p", "nan"], "--top-p: expected a fraction in \\[0, 1\\], got 'nan'"),
    ("generate", ["--top-p", "1.5"], "--top-p: expected a fraction in \\[0, 1\\]"),
    ("generate", ["--temperature", "-1"], "--temperature: expected a finite number >= 0, got '-1'"),
    ("generate", ["-n", "0"], "-n/--max-new-tokens: expected a positive integer, got '0'"),
    ("generate", ["--top-k", "-1"], "--top-k: expected an integer >= 0"),
    ("generate", ["--seed", "-1"], "--seed: expected an integer >= 0"),
    ("export_hf", ["exported", "--max-shard-gb", "nan"], "--max-shard-gb: expected a finite number > 0, got 'nan'"),
    ("export_hf", ["exported", "--max-shard-gb", "0"], "--max-shard-gb: expected a finite number > 0, got '0'"),
    ("plot_log", ["--smooth", "0"], "--smooth: expected a positive integer, got '0'"),
])
def test_bad_values_are_usage_errors(tmp_path, name, extra, message, capsys):
    with pytest.raises(SystemExit) as stop:
        script(name)([str(tmp_path), *extra])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(f"error: argument {message}", err), err


@pytest.mark.parametrize("extra, message", [
    (["--timeout", "0"], "--timeout: expected a finite number > 0, got '0'"),
    (["--timeout", "nan"], "--timeout: expected a finite number > 0, got 'nan'"),
    (["--retries", "-1"], "--retries: expected an integer >= 0, got '-1'"),
])
def test_starter_pack_bad_values_are_usage_errors(tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit) as stop:
        starter_pack.main(["--dest", str(tmp_path), *extra])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().endswith(message)


@pytest.mark.parametrize("name, argv", [("generate", ["nowhere", "--prompt", "x"]), ("generate", ["hf:nowhere"]),
                                        ("export_hf", ["nowhere", "exported"])])
def test_a_model_that_does_not_exist_is_a_usage_error(tmp_path, monkeypatch, name, argv, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        script(name)(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"expected a file or folder that exists, got '{argv[0]}'")
    assert not (tmp_path / "exported").exists()


PROGRAMS = sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("scripts/*.py"), *REPO.glob("data/*.py")]
                  if 'if __name__ == "__main__":' in p.read_text())


def test_tinyshakespeare_script_on_latin1_text_is_one_line(tmp_path, capsys):
    (tmp_path / "input.txt").write_bytes("Ça va, Roméo?\n".encode("latin-1"))
    assert script("tinyshakespeare", "data")(["--input", str(tmp_path / "input.txt"), "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {tmp_path / 'input.txt'} is not UTF-8 text (byte 0xc7 at offset 0); convert it "
                       f"first, e.g. iconv -f latin1 -t utf-8 {tmp_path / 'input.txt'}")
    assert not list(tmp_path.glob("*.bin"))


@pytest.mark.slow
@pytest.mark.parametrize("path", PROGRAMS)
def test_help_works_without_torch(path, tmp_path):
    """Each script's --help, with torch hidden (an import of it fails as where it is not installed)."""
    (tmp_path / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, str(REPO / path), "--help"], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


def test_memory_plan_lists_the_buffers_and_names_what_would_fit(capsys):
    memory_plan = script("memory_plan")
    assert memory_plan(["llama3.1-8b", "-b", "1", "-t", "2048", "--memory", "79"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "llama3.1-8b, B=1 T=2048: bf16 on 1 GPU, per GPU | recompute partial | adamw"
    assert re.fullmatch(r"  adamw moments +59\.8 GiB", out[4]) and re.fullmatch(r"  total \(at least\) +142\.0 GiB", out[-2])
    # the least change from the run's own recipe: never --recompute none, which keeps more (issue 63 item 16)
    assert out[-1] == "79 GiB (79.0 GiB): does not fit; --optimizer adamw8bit --optimizer-in-backward would fit"
    assert memory_plan(["llama3.1-8b", "-b", "1", "-t", "2048", "--gpus", "8", "--memory", "79"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "79 GiB (79.0 GiB): fits"
    pair = ["llama3.1-8b", "-b", "1", "-t", "8192", "--gpus", "2", "--zero", "3", "--recompute", "full", "--memory", "79"]
    assert memory_plan(pair) == 1  # 8B on two 80 GB H100s: with 8-bit moments (ZeRO shards whole blocks)
    assert capsys.readouterr().out.splitlines()[-1] == "79 GiB (79.0 GiB): does not fit; --optimizer adamw8bit would fit"
    assert memory_plan([*pair, "--optimizer", "adamw8bit"]) == 0
    total, verdict = capsys.readouterr().out.splitlines()[-2:]
    assert re.fullmatch(r"  total \(at least\) +59\.2 GiB", total) and verdict == "79 GiB (79.0 GiB): fits"
    assert memory_plan(["small", "-b", "16", "-t", "64", "--device", "cpu", "--recompute", "full", "--optimizer",
                        "adamw8bit", "--memory", "4"]) == 0
    out = capsys.readouterr().out
    assert "the numpy reference | recompute full | adamw8bit" in out and "activations (recompute full) x 4 layers" in out
    assert memory_plan(["small", "-b", "16", "-t", "64", "--device", "cpu", "--optimizer-in-backward", "--memory",
                        "4"]) == 0
    assert "fp32 gradients (a group at a time)" in capsys.readouterr().out


def test_memory_plan_accounts_for_the_adapters_on_the_cpu(capsys):
    """--lora: the base without gradient and moments, the adapters with them; the advice leaves out what --lora
    refuses (the optimizer in the backward)."""
    memory_plan = script("memory_plan")
    assert memory_plan(["small", "-b", "1", "-t", "64", "--device", "cpu", "--lora", "16", "--qlora", "--memory",
                        "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("| adamw | lora r16 on 7 linears, base nf4")
    names = [line.split("  ")[1] for line in out[1:-2]]
    assert names[:5] == ["fp32 base (NF4 round trip, frozen)", "fp32 adapters", "fp32 adapter gradients", "decay mask",
                         "adapter adamw moments"]
    assert memory_plan(["small", "-b", "64", "-t", "512", "--device", "cpu", "--lora", "16", "--memory", "4"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == ("4 GiB (4.0 GiB): does not fit; -b 3 would fit (-d keeps the "
                                                         "tokens per step)")


@pytest.mark.parametrize("extra, message", [
    (["--qlora"], "--qlora, --lora-alpha, --lora-dropout and --lora-targets go with --lora RANK"),
    (["--device", "cpu", "--lora", "8", "--optimizer-in-backward"], "--optimizer-in-backward with --lora"),
    (["--dtype", "fp32", "--recompute", "full"], "--recompute full: the fp32 GPU model runs none"),
    (["-t", "5000"], "-t 5000 exceeds the model's max_seq_len"),
    (["--device", "cpu", "--gpus", "2"], "--gpus needs --device cuda"),
    (["--gpus", "2", "--optimizer-in-backward"], "--optimizer-in-backward runs on one GPU"),
    (["--dtype", "fp32", "--optimizer-in-backward"], "--optimizer-in-backward: the fp32 GPU model updates after"),
    (["--zero", "2"], "--zero 2 shards over several GPUs"),
    (["--gpus", "2", "--zero", "3", "--dtype", "fp8"], "--zero 3 with --dtype fp8"),
    (["--device", "cpu", "--zero", "2"], "--zero 2 shards over several GPUs"),
])
def test_memory_plan_refuses_what_no_run_can_be_in_one_line(extra, message, capsys):
    assert script("memory_plan")(["d12", "-b", "8", "-t", "1024", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err, err


def test_compare_runs_compares_memory_recipes_on_the_cpu(corpus, tmp_path):
    """Full recompute changes no bit of the losses, 8-bit moments change a few."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_runs.py"), "recipe", "plain", "full",
                             "adamw8bit", "--device", "cpu", "-o", str(tmp_path / "cmp"), "--", "-e", "tiny", "-b", "2",
                             "-t", "16", "-x", "60", "-l", "3e-3", *corpus], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "LLAMA_PACKAGE_INDEX": "http://127.0.0.1:9/",
                                 "LLAMA_CUDA_CACHE": os.environ["LLAMA_CUDA_CACHE"]})  # offline: byte-level tokens
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("seed 0: mean"))  # then maybe "wrote"
    means = dict(re.findall(r"recipe ([\w-]+) ([\d.]+)", line))
    assert means["plain"] == means["full"] and means["adamw8bit"] != means["plain"], line
    assert re.search(r"largest \|difference\| from recipe plain: 0\.0[01]\d\d nats$", line), line


def test_compare_runs_compares_fp8_scalings_with_the_twin_on_the_cpu(corpus, tmp_path):
    """--dtype fp8 on the CPU with each scaling of its casts: two runs, two trajectories."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_runs.py"), "fp8-scaling", "row", "tensor",
                             "--device", "cpu", "-o", str(tmp_path / "cmp"), "--", "-e", "tiny", "-b", "2", "-t", "16",
                             "-x", "20", *corpus], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "LLAMA_PACKAGE_INDEX": "http://127.0.0.1:9/",
                                 "LLAMA_CUDA_CACHE": os.environ["LLAMA_CUDA_CACHE"]})  # offline: byte-level tokens
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("seed 0: mean"))
    means = dict(re.findall(r"fp8-scaling (\w+) ([\d.]+)", line))
    assert set(means) == {"row", "tensor"} and means["row"] != means["tensor"], line
    assert (tmp_path / "cmp" / "fp8-scaling_tensor" / "main.log").exists()


def test_bench_step_rows_give_mfu_from_the_plans_peak_and_dashes_for_what_did_not_run():
    table_row = script("bench_step").__globals__["table_row"]
    run = {"B": 4, "T": 4096, "ours_ms": 2000.0, "torch_ms": None, "ours_bytes": 113.2e9, "torch_bytes": None,
           "flops_per_step": 0.39 * 989e12 * 2.0, "peak_flops": 989e12}
    cells = table_row("llama3.1-8b B4 T4096", run).split()
    assert cells[3:] == ["2000.0", "-", "8,192", "-", "-", "0.39", "113.2", "-", "-"], cells
    assert table_row("x", run | {"peak_flops": None}).split()[6] == "-"  # no datasheet peak: no MFU


def test_compare_runs_averages_the_differences_over_seeds(corpus, tmp_path):
    """Each seed trains both ways from its own initialization and data order; full recompute differs by
    nothing from any seed."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_runs.py"), "recipe", "plain", "full",
                             "--seeds", "0", "1", "--device", "cpu", "-o", str(tmp_path / "cmp"), "--", "-e", "tiny",
                             "-b", "2", "-t", "16", "-x", "55", *corpus], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "LLAMA_PACKAGE_INDEX": "http://127.0.0.1:9/",
                                 "LLAMA_CUDA_CACHE": os.environ["LLAMA_CUDA_CACHE"]})  # offline: byte-level tokens
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "mean" in line]
    plain = [float(re.search(r"recipe plain ([\d.]+)", line).group(1)) for line in lines if line.startswith("seed")]
    assert len(plain) == 2 and plain[0] != plain[1]  # two trajectories
    assert lines[-1] == "over 2 seeds, the mean difference from recipe plain: recipe full +0.0000 (each +0.0000 +0.0000)"
    assert (tmp_path / "cmp" / "seed1" / "recipe_full" / "main.log").exists()


@pytest.mark.parametrize("args, message", [(["recipe", "plain", "fancy"], "recipe takes plain, partial, full"),
                                           (["dtype", "fp32", "bf16", "--device", "cpu"],
                                            "--device cpu: bf16 needs a GPU (the CPU runs fp32 and fp8)"),
                                           (["gpus", "1", "2", "--device", "cpu"],
                                            "--device cpu: comparing GPU counts needs GPUs"),
                                           (["fp8-scaling", "row", "column"], "fp8-scaling takes row, tensor")])
def test_compare_runs_refuses_what_it_cannot_compare(args, message):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_runs.py"), *args], capture_output=True,
                            text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_plot_log_smooths_the_train_loss_as_a_trailing_mean():
    trailing_mean = runpy.run_path(str(REPO / "scripts" / "plot_log.py"))["trailing_mean"]
    values = [4.0, 2.0, 6.0, 1.0, 3.0]
    assert trailing_mean(values, 1) == values
    assert trailing_mean(values, 3) == pytest.approx([4.0, 3.0, 4.0, 3.0, 10 / 3])
    assert trailing_mean(values, 9) == pytest.approx([4.0, 3.0, 4.0, 13 / 4, 16 / 5])


def device_script(tmp_path, name: str, args=(), tools=("dirname", "basename"), fakes=(), modules=None, env=()):
    """scripts/<name> run by bash with a PATH of only `tools` (from this PATH, python3 as this interpreter) and
    `fakes` (commands that print their name), and modules: None, or {module: source} put first on PYTHONPATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a script that runs this interpreter by its own path: a link to a virtual environment's python would lose the
    # environment, which Python finds beside the path it was started by (issue 63 item 8)
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for fake in fakes:
        (bin_dir / fake).write_text(f"#!/bin/sh\necho fake {fake}\n")
        (bin_dir / fake).chmod(0o755)
    shadow = tmp_path / "shadow"
    for module, source in (modules or {}).items():
        path = shadow / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return subprocess.run([shutil.which("bash"), str(REPO / "scripts" / name), *args], capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "PYTHONPATH": f"{shadow}:{REPO}", "OUT": str(tmp_path / "out"),
                               **dict(env)})


@pytest.mark.parametrize("name, fakes, missing", [("gpu_check.sh", (), "nvidia-smi not found on PATH"),
                                                  ("multi_gpu_check.sh", (), "nvidia-smi not found on PATH"),
                                                  ("eval_curve.sh", (), "nvidia-smi not found on PATH"),
                                                  ("check_sass.sh", ("nvcc",), "cuobjdump not found on PATH"),
                                                  ("check_sass.sh", (), "nvcc cuobjdump not found on PATH")])
def test_device_scripts_without_their_tools_say_what_is_missing_in_one_line(tmp_path, name, fakes, missing):
    result = device_script(tmp_path, name, fakes=fakes)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{name}: {missing}: "), result.stderr


NO_PYCUDA = {"pycuda.__init__": "raise ImportError('no pycuda here')\n"}


@pytest.mark.parametrize("name", ["gpu_check.sh", "multi_gpu_check.sh", "eval_curve.sh"])
def test_gpu_scripts_without_pycuda_say_how_to_install_the_carried_wheels(tmp_path, name):
    result = device_script(tmp_path, name, fakes=("nvidia-smi",), modules=NO_PYCUDA)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"{name}: python3 cannot import pycuda.driver: install pycuda from the wheels")
    assert "--no-index --no-deps --target /tmp/site .whl/*.whl" in result.stderr


def test_gpu_check_without_transformers_says_how_to_install_it(tmp_path):
    modules = {"pycuda.__init__": "", "pycuda.driver": "", "torch.__init__": "",
               "transformers.__init__": "raise ImportError('no transformers here')\n"}
    result = device_script(tmp_path, "gpu_check.sh", fakes=("nvidia-smi",), modules=modules)
    assert result.returncode == 1 and result.stderr == (
        "gpu_check.sh: python3 cannot import transformers: python3 -m pip install torch transformers\n")


# packages that import (so that gpu_check.sh runs) but drive no GPU: the GPU tests skip, bench_gpu.py says so and fails
STAND_INS = {"pycuda.__init__": "", "pycuda.driver": "", "torch.__init__": "", "transformers.__init__": ""}


@pytest.mark.slow
@pytest.mark.parametrize("pytest_args, skip_bench, pytest_says, expected", [
    (["tests/unit/test_config.py", "-k", "no_such_test"], "1", "deselected", 5),  # pytest's status: no test ran
    (["tests/unit/test_config.py::test_d12_preset"], "0", "1 passed", 2),  # bench_gpu.py: no usable GPU, exit 2
])
def test_gpu_check_passes_on_a_failing_step(tmp_path, pytest_args, skip_bench, pytest_says, expected):
    result = device_script(tmp_path, "gpu_check.sh", pytest_args, tools=("dirname", "basename", "mkdir", "tee"),
                           fakes=("nvidia-smi",), modules=STAND_INS, env={"SKIP_BENCH": skip_bench})
    assert result.returncode == expected, result.stdout + result.stderr
    assert result.stdout.startswith("fake nvidia-smi\n")
    assert pytest_says in (tmp_path / "out" / "pytest.log").read_text()
    bench_log = tmp_path / "out" / "bench.log"
    assert "error: scripts/bench_gpu.py needs a CUDA GPU" in bench_log.read_text() if skip_bench == "0" else not bench_log.exists()


def test_bench_startup_without_the_llama3_tokenizer_says_so_before_any_run(tmp_path):
    """Issue 63 item 9: the 8B rows ended in a traceback once the d12 rows were done."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_startup.py"), "--no-torch"],
                            capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "LLAMA_CUDA_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        f"error: llama3.1-8b needs the Llama 3 tokenizer, which is not at {tmp_path / 'cache/tokenizer/tokenizer.model'} "
        "and could not be fetched: get it with python3 scripts/download_starter_pack.py, or time the others alone "
        "(--models d12)")
    assert "Traceback" not in result.stderr


def test_plot_log_takes_a_run_folder_as_every_other_script_does(tmp_path, monkeypatch, capsys):
    """Issue 63 item 17: `plot_log.py out` was refused (Is a directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "main.log").write_text("s:0 trl:5.0\ns:1 trl:4.0\ns:1 tel:4.5\n")
    plot_log = runpy.run_path(str(REPO / "scripts" / "plot_log.py"))["main"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot_log(["out"]) == 2  # the logs are read before matplotlib is needed
        assert capsys.readouterr().err == 'error: plotting needs matplotlib: pip install -e ".[plot]"\n'
    else:
        assert plot_log(["out"]) == 0 and (tmp_path / "out" / "main.png").exists()
    (tmp_path / "empty").mkdir()
    assert plot_log(["empty"]) == 2
    assert capsys.readouterr().err == "error: cannot read empty/main.log: No such file or directory\n"
