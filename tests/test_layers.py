"""Layer rules of docs/design.md, enforced: what each layer may import."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ddpdoctor"

# what no layer below the command line imports: the heavy or interactive dependencies, the CLI
_NOT_BELOW_CLI = {"torch", "textual", "rich", "ddpdoctor.cli"}

# layer -> top-level modules it must never import (directly)
FORBIDDEN = {
    "events": _NOT_BELOW_CLI
    | {"ddpdoctor.sinks", "ddpdoctor.runtime", "ddpdoctor.runlog", "ddpdoctor.analysis", "ddpdoctor.stream"},
    # the stream's sending end is a sink (sinks/tcp.py); the receiving end is the reading side's
    "sinks": _NOT_BELOW_CLI | {"ddpdoctor.stream", "ddpdoctor.runtime", "ddpdoctor.runlog", "ddpdoctor.analysis"},
    "runtime": {"textual", "rich", "ddpdoctor.cli", "ddpdoctor.runlog", "ddpdoctor.stream"},
    # the receiving end; the relay forwards lines its listener received as they came, so it needs
    # no sender either: neither end imports the other
    "stream": _NOT_BELOW_CLI | {"ddpdoctor.sinks", "ddpdoctor.runtime", "ddpdoctor.analysis"},
    "runlog": _NOT_BELOW_CLI | {"ddpdoctor.sinks", "ddpdoctor.runtime", "ddpdoctor.analysis", "ddpdoctor.stream"},
    "analysis": _NOT_BELOW_CLI | {"ddpdoctor.sinks", "ddpdoctor.runtime"},
    "cli": {"textual", "rich"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _forbidden_imports(layer: str) -> list[str]:
    bad = []
    for path in sorted((PKG / layer).rglob("*.py")):
        for name in _imports(path):
            for forbidden in FORBIDDEN[layer]:
                if name == forbidden or name.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer: str) -> None:
    bad = _forbidden_imports(layer)
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_the_stream_sides_meet() -> None:
    planted = [PKG / "sinks" / "_planted_for_test.py", PKG / "stream" / "_planted_for_test.py"]
    planted[0].write_text("from ddpdoctor.stream.listener import StreamListener\n")
    planted[1].write_text("import ddpdoctor.sinks.tcp\n")
    try:
        assert _forbidden_imports("sinks") == ["ddpdoctor/sinks/_planted_for_test.py imports ddpdoctor.stream.listener"]
        assert _forbidden_imports("stream") == ["ddpdoctor/stream/_planted_for_test.py imports ddpdoctor.sinks.tcp"]
    finally:
        for path in planted:
            path.unlink()


def test_the_sinks_and_the_stream_resolve_no_name_lazily() -> None:
    """Each name they export is imported where it is defined: no module ``__getattr__`` hides a cycle."""
    for package in ("sinks", "stream"):
        tree = ast.parse((PKG / package / "__init__.py").read_text())
        assert not [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"], package


def test_the_listener_and_the_relay_do_not_read_run_dirs() -> None:
    """Only ``stream.source`` (the live view's record source) builds on runlog."""
    for name in ("listener.py", "relay.py"):
        assert not {n for n in _imports(PKG / "stream" / name) if n.startswith("ddpdoctor.runlog")}, name


def test_only_the_tui_imports_textual() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in PKG.rglob("*.py")
        if any(n == "textual" or n.startswith("textual.") for n in _imports(p))
    ]
    assert offenders == []


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    return set(out.stdout.split())


def test_import_ddpdoctor_pulls_in_neither_textual_rich_nor_torch() -> None:
    mods = _modules_after("import ddpdoctor")
    assert not {m for m in mods if m.split(".")[0] in {"textual", "rich", "torch"}}


def test_reading_and_reporting_run_without_torch() -> None:
    mods = _modules_after(
        "import ddpdoctor.analysis, ddpdoctor.runlog, ddpdoctor.events, ddpdoctor.cli.main, ddpdoctor.cli.report_cmd"
    )
    assert "torch" not in mods


READING_SIDE = (
    "ddpdoctor.stream",
    "ddpdoctor.runlog",
    "ddpdoctor.analysis.report",
    "ddpdoctor.analysis.diagnose",
    "textual",
    "rich",
)


def _reading_side(mods: set[str]) -> set[str]:
    return {m for m in mods if any(m == r or m.startswith(r + ".") for r in READING_SIDE)}


def test_the_runtime_loads_none_of_the_reading_side() -> None:
    assert _reading_side(_modules_after("import ddpdoctor.runtime")) == set()


INSTRUMENT_ONE_RANK = """
import os, socket, tempfile
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
import ddpdoctor
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with ddpdoctor.instrument(model, run_dir=tempfile.mkdtemp(), endpoint=f"127.0.0.1:{port + 1}"):
    for _ in range(4):  # sampled checks run at steps 0, 1 and 3
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
"""


def test_an_instrumented_training_loads_none_of_the_reading_side() -> None:
    mods = _modules_after(INSTRUMENT_ONE_RANK)
    assert "ddpdoctor.runtime.monitor" in mods and "ddpdoctor.sinks.tcp" in mods  # it did instrument and stream
    assert _reading_side(mods) == set()


def test_tui_installs_under_a_namespaced_name() -> None:
    mods = _modules_after("import ddpdoctor_tui")
    assert "ddpdoctor_tui" in mods and "tui" not in mods


# -- one spelling of each contract (events.layout, events.wire) ---------------------------------

LAYOUT_NAMES = {
    "DDPDOCTOR_RUN_DIR",
    "DDPDOCTOR_ENDPOINT",
    "DDPDOCTOR_TOKEN",
    "DDPDOCTOR_HANG_TIMEOUT",
    "attempt-",
    "rank-",
    ".jsonl",
    ".ddp",
    "ddpdoctor-runs",
}
CONTRACT_HOMES = {PKG / "events" / "layout.py", PKG / "events" / "wire.py"}
CONTRACT_FUNCTIONS = {"parse_endpoint", "parse_listen", "parse_name", "rank_file_name", "encode_hello", "new_run_name"}
CONTRACT_CONSTANTS = {
    "PROTOCOL",
    "TOKEN_ENV",
    "ENDPOINT_ENV",
    "RUN_DIR_ENV",
    "HANG_TIMEOUT_ENV",
    "ATTEMPT_PREFIX",
    "DEFAULT_ROOT",
}


def _code_files() -> list[Path]:
    return sorted([*PKG.rglob("*.py"), *(ROOT / "tui").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])


def _second_spellings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            if text in LAYOUT_NAMES or re.match(r"rank-\d", text) or text.endswith(".jsonl") or text.startswith(".ddp"):
                found.append(f"{where}: the name {text!r} (use ddpdoctor.events.layout)")
        elif isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant) and k.value == "ddpdoctor" for k in node.keys
        ):
            found.append(f"{where}: a control line built by hand (use ddpdoctor.events.wire)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in CONTRACT_FUNCTIONS:
            found.append(f"{where}: def {node.name} (the contract's own function is in events)")
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in CONTRACT_CONSTANTS for t in node.targets
        ):
            found.append(f"{where}: a contract constant assigned again")
    return found


def test_every_contract_has_one_spelling_in_events() -> None:
    """Run-dir names, environment variables and the wire protocol are spelled in events only."""
    bad = [hit for path in _code_files() if path not in CONTRACT_HOMES for hit in _second_spellings(path)]
    assert not bad, "\n".join(bad)


def test_the_contract_check_sees_a_second_spelling() -> None:
    planted = PKG / "events" / "_planted_for_test.py"
    planted.write_text(
        'PROTOCOL = 1\nname = f"rank-{3:05d}.jsonl"\nENV = "DDPDOCTOR_TOKEN"\n'
        'hello = {"ddpdoctor": "hello"}\ndef parse_endpoint(text): ...\n'
    )
    try:
        # PROTOCOL, "rank-" and ".jsonl", the token variable, the hand-built hello, the parser
        assert len(_second_spellings(planted)) == 6
    finally:
        planted.unlink()
