"""The native extension's source: one translation unit made of ``bindings.cpp`` and its headers.

``native_cache.source_text`` puts every header ``bindings.cpp`` includes into the text it builds,
once each, from a ``#line`` that names the file: the build's name hashes every file, and the
compiler's messages name the header and line they are about. No torch build here: the compile
check runs the system's C++ compiler on a few lines.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ddpdoctor import native_cache

_LINE = re.compile(r'^#line 1 "ddpdoctor/runtime/native/([^"]+)"$', re.MULTILINE)


def _copy_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The source folder copied under ``tmp_path``, and ``native_cache`` reading it from there."""
    folder = tmp_path / "native"
    shutil.copytree(native_cache.SOURCE_DIR, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(native_cache, "SOURCE_DIR", folder)
    monkeypatch.setattr(native_cache, "SOURCE", folder / native_cache.SOURCE.name)
    return folder


def test_every_file_of_the_folder_is_in_the_text_once() -> None:
    text = native_cache.source_text()
    opened = _LINE.findall(text)
    on_disk = sorted(p.name for p in native_cache.SOURCE_DIR.iterdir() if p.suffix in (".h", ".cpp"))
    assert sorted(opened) == on_disk  # each file once: none left out, none twice
    assert opened[0] == "bindings.cpp"
    assert "#pragma once" not in text  # (the expansion includes each file once itself)
    assert not re.search(r'^\s*#\s*include\s+"', text, re.MULTILINE)  # every local include expanded


def test_a_change_in_any_header_is_another_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = native_cache.source_text()
    folder = _copy_source(tmp_path, monkeypatch)
    tag = native_cache.torch_tag("2.13.0", None)
    assert native_cache.source_text() == before  # the names in the text do not depend on where it lies
    names = {native_cache.extension_name(before, tag)}
    for header in sorted(folder.glob("*.h")):
        original = header.read_text()
        header.write_text(original + "// another line\n")
        names.add(native_cache.extension_name(native_cache.source_text(), tag))
        header.write_text(original)
    assert len(names) == 1 + len(list(folder.glob("*.h")))


def test_a_header_included_twice_is_expanded_once_and_lines_follow_their_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "native"
    folder.mkdir()
    (folder / "a.h").write_text('#pragma once\n#include "b.h"\nint a();\n')
    (folder / "b.h").write_text("#pragma once\nint b();\n")
    (folder / "bindings.cpp").write_text('#include "a.h"\n#include "b.h"\n#include <vector>\nint main();\n')
    monkeypatch.setattr(native_cache, "SOURCE_DIR", folder)
    monkeypatch.setattr(native_cache, "SOURCE", folder / "bindings.cpp")
    monkeypatch.delenv(native_cache.FAULT_ENV, raising=False)
    lines = native_cache.source_text().splitlines()
    lines = lines[1:] if lines[0].startswith("#define") else lines  # (the divisor's define, where torch has it)
    assert lines == [
        '#line 1 "ddpdoctor/runtime/native/bindings.cpp"',
        '#line 1 "ddpdoctor/runtime/native/a.h"',
        "",
        '#line 1 "ddpdoctor/runtime/native/b.h"',
        "",
        "int b();",
        '#line 3 "ddpdoctor/runtime/native/a.h"',
        "int a();",
        '#line 2 "ddpdoctor/runtime/native/bindings.cpp"',
        "",  # b.h again: nothing
        "#include <vector>",
        "int main();",
    ]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_a_compile_error_names_the_header_and_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _copy_source(tmp_path, monkeypatch)
    for path in folder.iterdir():
        path.unlink()
    (folder / "good.h").write_text("#pragma once\n\ninline int good() { return 1; }\n")
    (folder / "broken.h").write_text('#pragma once\n#include "good.h"\n\nint broken() { return undeclared_name; }\n')
    (folder / "bindings.cpp").write_text('#include "good.h"\n#include "broken.h"\nint main() { return good(); }\n')
    source = tmp_path / "main.cpp"
    source.write_text(native_cache.source_text())
    out = subprocess.run(
        ["g++", "-fsyntax-only", "-x", "c++", str(source)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert "ddpdoctor/runtime/native/broken.h:4:" in out.stderr, out.stderr
    assert "undeclared_name" in out.stderr
