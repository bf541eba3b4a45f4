"""scripts/structure_report.py: the expert-tensor walk finds every function it names in this tree (a
renamed or moved function must be renamed there too), and --replay counts what a commit range touches."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("structure_report", ROOT / "scripts" / "structure_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _modules(pkg: Path) -> dict[str, Path]:
    out = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def test_every_function_on_the_expert_path_is_found_once():
    rep = _report()
    path = rep.expert_path(_modules(ROOT / "trtmoe"), ROOT)
    assert [step for step, _, _ in path] == [s for s, _ in rep.EXPERT_PATH]
    for (step, names), (_, found, files) in zip(rep.EXPERT_PATH, path):
        assert len(found) == len(names), (step, names, found)  # each name defined exactly once
        assert all(any(f.endswith("." + n) for f in found) for n in names), (step, found)
        assert files and all((ROOT / f).is_file() for f in files)
    # the format step reaches the format classes; the engine step the CPU kernels
    assert "trtmoe/quant/formats.py" in path[2][2] and "trtmoe/runtime/qkernels.py" in path[4][2]


def test_replay_counts_the_package_files_and_lines_of_a_commit_range(tmp_path):
    rep = _report()
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (tmp_path / "trtmoe").mkdir()
    (tmp_path / "trtmoe" / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "notes.md").write_text("outside the package\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    (tmp_path / "trtmoe" / "a.py").write_text("x = 1\ny = 3\nz = 4\n")
    (tmp_path / "trtmoe" / "b.py").write_text("b = 0\n")
    (tmp_path / "notes.md").write_text("changed, not counted\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "two"], check=True)
    assert sorted(rep.replay(tmp_path, "HEAD~1..HEAD")) == [("trtmoe/a.py", 2, 1), ("trtmoe/b.py", 1, 0)]
