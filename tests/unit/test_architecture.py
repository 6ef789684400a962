"""docs/architecture.md keeps to the tree: every room it names exists, every room and root module of llama/ is named,
and no module imports from a room named below its own (the map's table lists the rooms lowest first)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "llama"


def rooms_in_order() -> list[list[str]]:
    """The first table of docs/architecture.md: each row's rooms (`name/` or `name.py`), lowest row first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## The rooms, lowest first", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([\w]+)(?:/|\.py)`", row.split("|")[1]) for row in rows]


def room_of(module: str) -> str:
    """llama.model.gpu_bf16 -> model; llama.config -> config."""
    return module.split(".")[1]


def llama_imports(path: Path) -> set[str]:
    """The llama modules (or packages) a file imports, absolute."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if path.name == "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            target = base + (node.module.split(".") if node.module else [])
            found |= {".".join(target + ([a.name] if not node.module else [])) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llama"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("llama")}
    return {f for f in found if f.count(".") >= 1}


def test_every_room_named_exists_and_every_room_is_named():
    named = [room for row in rooms_in_order() for room in row]
    assert len(named) == len(set(named))
    for room in named:
        assert (LLAMA / room).is_dir() or (LLAMA / f"{room}.py").is_file(), room
    present = {p.name for p in LLAMA.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.stem for p in LLAMA.glob("*.py") if p.name != "__init__.py"}
    assert present == set(named)


def test_no_import_points_up():
    level = {room: i for i, row in enumerate(rooms_in_order()) for room in row}
    upward = []
    for path in LLAMA.rglob("*.py"):
        if path.parent == LLAMA and path.name == "__init__.py":
            continue  # the package's own face re-exports what users import first
        own = room_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for target in llama_imports(path):
            if level[room_of(target)] > level[own]:
                upward.append(f"{path.relative_to(ROOT)} imports {target}")
    assert upward == []
