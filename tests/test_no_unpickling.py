"""Nothing in the code unpickles without restriction (issue 25): every torch.load passes
weights_only=True, no pickle.load/loads/Unpickler, numpy loads refuse pickles, and the one
unpickler there is (DCP metadata) is the restricted subclass in moe/train/safe_dcp.py."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREE = ["moe", "pipeline", "bench", "scripts", "containers"]
RESTRICTED_UNPICKLER = REPO / "moe/train/safe_dcp.py"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _problems(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "torch.load":
                flag = _keyword(node, "weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    found.append(f"{where}: torch.load without weights_only=True")
            elif name in ("pickle.load", "pickle.loads", "dill.load", "cloudpickle.load", "joblib.load", "marshal.loads"):
                found.append(f"{where}: {name}")
            elif name in ("np.load", "numpy.load"):
                flag = _keyword(node, "allow_pickle")
                if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                    found.append(f"{where}: {name} with allow_pickle")
        elif isinstance(node, ast.ClassDef) and path != RESTRICTED_UNPICKLER:
            if any(_dotted(b).endswith("Unpickler") for b in node.bases):
                found.append(f"{where}: an Unpickler subclass outside safe_dcp.py")
        elif isinstance(node, ast.Attribute) and node.attr == "Unpickler" and path != RESTRICTED_UNPICKLER:
            found.append(f"{where}: pickle.Unpickler")
    return found


def test_no_code_path_unpickles_without_restriction():
    files = [f for top in TREE for f in sorted((REPO / top).rglob("*.py"))]
    assert len(files) > 100
    problems = [p for f in files for p in _problems(f)]
    assert not problems, "\n".join(problems)


def test_the_scanner_sees_what_it_refuses(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import pickle, torch, numpy as np\n"
        "torch.load('x')\ntorch.load('x', weights_only=False)\npickle.loads(b'')\n"
        "np.load('x', allow_pickle=True)\nclass U(pickle.Unpickler):\n    pass\n"
        "torch.load('x', weights_only=True)\nnp.load('x')\n"
    )
    lines = sorted(int(p.split(":")[1]) for p in _problems(bad))
    assert lines == [2, 3, 4, 5, 6, 6], lines
