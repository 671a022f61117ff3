"""The SGLang hook's checks (kvtrace.hook.sglang.needs) against SGLang 0.5.23's own source: they
pass on it, and each fails, naming the target and what differs, when that source changes; the
hook itself, imported into SGLang's interpreter, refuses the changed SGLang and patches nothing."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvtrace.demo.sglang_server import sglang_python
from kvtrace.hook import support
from kvtrace.hook.sglang import support as sglang_support
from tests import helpers
from tests.sglang.conftest import STUB

REPO = Path(__file__).resolve().parents[2]


def site() -> Path:
    py = sglang_python()
    if not Path(py).exists():
        pytest.skip(f"needs the SGLang venv ({py}; make setup-sglang)")
    out = subprocess.run([py, "-c", "import sglang, os; print(os.path.dirname(os.path.dirname(sglang.__file__)))"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": STUB})
    assert out.returncode == 0, out.stderr[-500:]
    return Path(out.stdout.strip())


CHANGES = [
    ("sglang/srt/managers/scheduler.py", "    def _add_request_to_queue(self, req: Req, is_retracted: bool = False):",
     "    def _add_request_to_queue(self, req: Req, retracted: bool = False):",
     "Scheduler._add_request_to_queue: parameter 'is_retracted' missing"),
    ("sglang/srt/managers/schedule_batch.py", "    def retract_decode(self) -> Tuple[List[Req], float, List[Req]]:",
     "    def retract_decode(self, *, spare: int = 0) -> Tuple[List[Req], float, List[Req]]:",
     "ScheduleBatch.retract_decode: has a keyword-only parameter 'spare'"),
    ("sglang/srt/managers/schedule_batch.py", "self.retraction_count", "self.retractions",   # every one
     "Req: attribute 'retraction_count' missing"),
    ("sglang/srt/managers/scheduler.py", 'setproctitle.setproctitle(f"sglang::scheduler{',
     'setproctitle.setproctitle(f"sglang::sched{', "sglang.srt.managers.scheduler: "),
]


def shadow(src: Path, dst: Path, rel: str, old: str, new: str) -> Path:
    """An SGLang package under dst whose files are links to src's, but for a changed copy of rel."""
    helpers.link_tree(src / "sglang", dst / "sglang")
    text = (src / rel).read_text()
    assert text.count(old) >= 1, f"{rel} no longer holds {old!r}: update this test row"
    (dst / rel).unlink()
    (dst / rel).write_text(text.replace(old, new))
    return dst


def test_the_plan_passes_on_sglang_0_5_23():
    v = sglang_support.check(str(site()))
    assert v["version"] == "0.5.23" and v["supported"] and v["roles"] == {"engine": []}, v["roles"]
    assert v["kind"] == "sglang"
    assert sglang_support.check(str(site().parent))["roles"] == {"engine": ["sglang: no SGLang package here"]}


@pytest.mark.parametrize("change", CHANGES, ids=[c[3].split(":")[0] for c in CHANGES])
def test_the_plan_fails_when_a_target_changes(tmp_path, change):
    rel, old, new, want = change
    root = shadow(site(), tmp_path / "tree", rel, old, new)
    v = sglang_support.check(str(root))
    found = v["roles"]["engine"]
    assert v["kind"] == "sglang" and not v["supported"] and len(found) == 1 and found[0].startswith(want), found
    assert support.reason(v) == found[0]


def test_the_hook_refuses_a_changed_sglang_in_its_interpreter(tmp_path):
    rel, old, new, want = CHANGES[0]
    root = shadow(site(), tmp_path / "tree", rel, old, new)
    code = ("import json, kvtrace.hook.sglang.hook as h; ok = h.install();"
            "print(json.dumps({'ok': ok, 'status': h.status()}, default=str))")
    out = subprocess.run([sglang_python(), "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": f"{root}:{STUB}:{REPO}", "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"] is False and res["status"]["reason"].startswith(f"SGLang 0.5.23 differs: {want}"), res
    assert res["status"]["patched"] == []
