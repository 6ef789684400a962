"""kernels_for(plan)'s table against the launchers in llama/ops: the kernel modules each GPU model reaches through
the launchers it calls (read from the source, so that a launcher's new module fails here until the table has it),
and the GEMM and GEMV entry points by the launchers' names. tests/gpu/test_kernel_build.py checks a real step."""

import ast
import functools
import inspect
import re
from dataclasses import replace
from pathlib import Path

import pytest

from llama.runtime import kernel_build
from llama.runtime.kernel_build import (DECODER_MODULES, DOC_MASK_MODULE, GEMM_MMA_MODULE, LORA_MODULES, PATH_MODULES,
                                        SPLITK_REDUCE, entries_of, kernel_dir, kernels_for, unit_of)
from llama.ops.gemm import GEMM_VERSIONS
from llama.params import LoraSpec
from llama.run.plan import ATTENTION, ATTENTION_HOPPER, GemmChooser, Plan

LLAMA = Path(kernel_build.__file__).parents[1]


def string_constants(tree: ast.AST) -> dict[str, str]:
    """The names bound to a string literal in a module: its top-level constants and its functions' parameter
    defaults (a launcher's module parameter), e.g. {"MODULE": "gemm_wgmma", "module": "gemm_wgmma"}."""
    found = {t.id: node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
             for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            arguments = node.args.args[len(node.args.args) - len(node.args.defaults):] + node.args.kwonlyargs
            defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            for argument, default in zip(arguments, defaults):
                value = found.get(default.id) if isinstance(default, ast.Name) else getattr(default, "value", None)
                if isinstance(value, str):
                    found[argument.arg] = value
    return found


@functools.cache
def launcher_graph() -> dict[str, tuple[set, set]]:
    """Every top-level definition in llama/ops: (the modules its kernel() calls name, the names it refers to)."""
    graph = {}
    for path in (LLAMA / "ops").glob("*.py"):
        tree = ast.parse(path.read_text())
        constants = string_constants(tree)
        for node in tree.body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            modules, refs = set(), set()
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "kernel":
                    module = inner.args[0]  # a literal or a name bound to one (the attention build's: the plan's)
                    if isinstance(module, (ast.Constant, ast.Name)):
                        modules.add(module.value if isinstance(module, ast.Constant) else constants[module.id])
                refs.add(getattr(inner, "id", None) or getattr(inner, "attr", None))
            for name in names:
                graph[name] = (graph.get(name, (set(), set()))[0] | modules, graph.get(name, (set(), set()))[1] | refs)
    return graph


def model_files(model: str) -> list[str]:
    """A GPU model's file in llama/model and those of llama/model it imports, transitively."""
    files, pending = [], [model]
    while pending:
        name = pending.pop()
        if name not in files:
            files.append(name)
            pending += [f"model/{node.module}.py" for node in ast.walk(ast.parse((LLAMA / name).read_text()))
                        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module]
    return files


def reached_modules(*callers: str) -> set[str]:
    """The kernel modules the launchers that these llama/ files call (as ops.<name>) load, transitively."""
    graph = launcher_graph()
    pending = [node.attr for caller in callers for node in ast.walk(ast.parse((LLAMA / caller).read_text()))
               if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "ops"]
    seen, modules = set(), set()
    while pending:
        name = pending.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        modules |= graph[name][0]
        pending.extend(graph[name][1])
    return modules


def plan(dtype: str, hopper: bool = True, dynamic: bool = False) -> Plan:
    """A GPU plan of this dtype, as make_plan makes it on Hopper (or an older GPU), on one GPU (or several)."""
    attention = (ATTENTION_HOPPER if hopper else ATTENTION)[0]
    return Plan("cuda", dtype, "GPU", GemmChooser(hopper, dynamic=dynamic), attention,
                fp8_gemm=GemmChooser(hopper, fp8=True) if dtype == "fp8" else None)


def test_each_paths_modules_are_those_its_model_launches():
    # the bf16 and fp8 paths; each model launches the document mask's module only with it (kernels_for's plan)
    bf16_model = reached_modules(*model_files("model/gpu_bf16.py"), "parallel/zero.py") - {DOC_MASK_MODULE}
    assert bf16_model == set(PATH_MODULES["bf16"]) | set(PATH_MODULES["fp8"]) | {GEMM_MMA_MODULE, "gemm_wgmma"} | set(
        LORA_MODULES["qlora"])
    assert set(PATH_MODULES["fp8"]) - set(PATH_MODULES["bf16"]) == {"fp8"}
    assert reached_modules(*model_files("model/gpu_fp32.py")) - {DOC_MASK_MODULE} == set(PATH_MODULES["fp32"])
    decoder = reached_modules(*model_files("model/gpu_decoder.py"))
    assert set(DECODER_MODULES) | {"gemv"} <= decoder <= set(PATH_MODULES["bf16"]) | set(DECODER_MODULES) | {
        "gemv", GEMM_MMA_MODULE, "gemm_wgmma"}


@pytest.mark.parametrize("hopper, dynamic, fp8", [(True, False, False), (True, True, False), (True, False, True),
                                                  (False, False, False)])
def test_a_choosers_versions_are_its_named_ones(hopper, dynamic, fp8):
    chooser = GemmChooser(hopper, fp8=fp8, dynamic=dynamic)
    shapes = [(m, n, k) for m in (64, 4096, 65536) for n in (768, 4096, 16384, 128256) for k in (768, 4096, 8192)]
    assert {chooser(*shape) for shape in shapes} == set(chooser.name.split("/"))


def test_gemm_units_are_the_versions_entry_points():
    for version, launcher in GEMM_VERSIONS.items():  # each launcher names its entry points gemm_<version>_...
        assert version == "mma" or re.search(rf'"gemm_{version}[_"]', inspect.getsource(launcher.launch))
    names = wgmma_entries(plan("bf16"))
    assert names == {f"gemm_wgmma5_{layout}" for layout in ("nt", "nn", "tn")} | {
        f"gemm_wgmma6_{layout}_128x{bn}" for layout in ("nt", "nn", "tn") for bn in (128, 256)}
    assert wgmma_entries(plan("bf16", dynamic=True)) == {name.replace("wgmma5", "wgmma8").replace("wgmma6", "wgmma7")
                                                         for name in names}
    assert wgmma_entries(plan("fp8")) - names == {"gemm_wgmma6_fp8_128x128", "gemm_wgmma6_fp8_128x256"}
    assert not wgmma_entries(plan("bf16", hopper=False))
    for gpu_plan, code in ((plan("bf16"), "sm_90a"), (plan("bf16", hopper=False), "sm_80")):  # every version may split K
        assert unit_of(kernel_dir() / "gemm_mma.cu", code, SPLITK_REDUCE) in kernels_for(gpu_plan, code)
    older = {u.entry for u in kernels_for(plan("bf16", hopper=False), "sm_80") if u.source.stem == GEMM_MMA_MODULE}
    assert older == set(entries_of(kernel_dir() / "gemm_mma.cu")) or older == {None}  # version 1: all of gemm_mma.cu


def wgmma_entries(gpu_plan: Plan) -> set[str]:
    return {u.entry for u in kernels_for(gpu_plan, "sm_90a") if u.source.stem == "gemm_wgmma"}


def test_the_decoders_gemv_units_are_its_launchers_b8_entry_points():
    launched = {node.args[0].value for node in ast.walk(ast.parse((LLAMA / "ops" / "gemv.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_launch"}
    units = kernels_for(plan("bf16"), "sm_90a", decoder=True)
    assert {u.entry for u in units if u.source.stem == "gemv"} == {f"{name}_b8" for name in launched}
    assert {f"{name}_b8" for name in launched} <= set(entries_of(kernel_dir() / "gemv.cu"))


def test_every_plan_unit_exists_and_the_cpu_plan_needs_none():
    for dtype in ("bf16", "fp8", "fp32"):
        for unit in kernels_for(plan(dtype), "sm_90a", decoder=True):
            assert unit.source.exists() and (unit.entry is None) == (not entries_of(unit.source))
    assert kernels_for(Plan("cpu", "fp32", "CPU"), "sm_90a") == []
    fp32 = {u.source.stem for u in kernels_for(plan("fp32"), "sm_90a")}
    assert fp32 == set(PATH_MODULES["fp32"])  # no GEMM or attention builds beside the exact path's own
    for dtype in ("bf16", "fp32"):  # the document mask's module with the mask only
        masked = {u.source.stem for u in kernels_for(replace(plan(dtype), doc_mask_bos=1), "sm_90a")}
        adapted = {u.source.stem for u in kernels_for(replace(plan(dtype), lora=LoraSpec(8), qlora=True), "sm_90a")}
        assert adapted - {u.source.stem for u in kernels_for(plan(dtype), "sm_90a")} == {"lora", "nf4"}
        assert masked - {u.source.stem for u in kernels_for(plan(dtype), "sm_90a")} == {DOC_MASK_MODULE}


def test_the_attention_units_are_the_model_head_dims_entry_points():
    launcher = (LLAMA / "ops" / "flash_attention.py").read_text()  # its kernels' names, less the head dim
    launched = set(re.findall(r'"(flash_attention_(?:forward|backward)\w*?)(?:_d\{D\})?"', launcher))
    hopper_file = kernel_dir() / f"{ATTENTION_HOPPER[0].module}.cu"
    every = {u.entry for u in kernels_for(plan("bf16"), "sm_90a") if u.source == hopper_file}
    assert every == set(entries_of(hopper_file)) and len(every) == 7  # no head dim named: all of them
    for head_dim in (64, 128):
        units = kernels_for(plan("bf16"), "sm_90a", decoder=True, head_dim=head_dim)
        entries = {u.entry for u in units if u.source == hopper_file}
        assert entries == {"flash_attention_backward_delta"} | {
            f"{name}_d{head_dim}" for name in launched - {"flash_attention_backward_delta"}}
    older = kernels_for(plan("bf16", hopper=False), "sm_80", head_dim=64)
    assert [u.entry for u in older if u.source.stem == "flash_attention"] == [None]  # a file built whole stays whole
