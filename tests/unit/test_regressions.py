"""Planted regressions: each security fix taken out again, in a copy of the package, must make
the tests that guard it fail.  A row names the file, the text the fix wrote, what stood (or
would stand) without it, and the tests; a row whose text is no longer in the file fails too,
so the table follows the code.  The copy is put first on PYTHONPATH for a child pytest."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # a copy of the package and a child test run per row

REPO = Path(__file__).resolve().parents[2]
ROOT = os.geteuid() == 0

# (name, file under kvtrace/, fixed text, regressed text, test ids, needs root)
REGRESSIONS = [
    ("loader runs a changed hook file", "inject/loader.py",
     "if hashlib.sha256(b).hexdigest() != d:", "if False:",
     ["tests/unit/test_stage.py::test_a_changed_staged_file_never_runs"], False),
    ("bootstrap runs a changed loader", "inject/loader.py",
     "if h.sha256(b).hexdigest()==d else None", "if True else None",
     ["tests/unit/test_stage.py::test_a_changed_loader_never_runs"], False),
    ("paths resolved through links", "host/confined.py",
     "_RESOLVE = 0x02 | 0x04 | 0x10", "_RESOLVE = 0x10",
     ["tests/unit/test_stage.py::test_a_link_on_the_way_is_refused"], False),
    ("a directory of another owner trusted", "host/confined.py",
     "    if st.st_uid not in owners:", "    if False:",
     ["tests/unit/test_stage.py::test_the_base_must_be_safe_from_other_users",
      "tests/unit/test_agentflag.py::test_a_flag_directory_another_user_made_is_refused_and_nothing_truncated"], True),
    ("a directory others can write trusted", "host/confined.py",
     "    if loose and (private or not st.st_mode & stat.S_ISVTX):", "    if False:",
     ["tests/unit/test_stage.py::test_the_base_must_be_safe_from_other_users"], True),
    ("the walk follows links", "host/confined.py",
     "                nxt = os.open(part, flags if last else _DIR_FLAGS, dir_fd=cur)",
     "                nxt = os.open(part, (flags if last else _DIR_FLAGS) & ~os.O_NOFOLLOW, dir_fd=cur)",
     ["tests/unit/test_stage.py::test_the_walk_without_openat2_refuses_links_and_dotdot"], False),
    ("staged to a predictable shared name", "inject/stage.py",
     'name = f"kvtrace-{secrets.token_hex(8)}"', 'name = "kvtrace-hook"',
     ["tests/unit/test_stage.py::test_a_new_private_directory_for_each_injection_removed_at_the_end"], False),
    ("a hook module imported in a block or a function left out of the staged files", "inject/stage.py",
     "    for node in ast.walk(tree):\n        if id(node) in typing_only:",
     "    for node in tree.body:\n        if id(node) in typing_only:",
     ["tests/unit/test_stage.py::test_the_staged_files_are_exactly_what_the_hooks_import"], False),
    ("the output directory trusted as given", "dataset/writer.py",
     "        check_out_dir(self.root)\n", "",
     ["tests/unit/test_output_hostile.py::test_an_output_directory_that_is_a_link_is_refused"], False),
    ("a temporary file opened through what lies at its name", "dataset/writer.py",
     """        os.unlink(tmp)
    except FileNotFoundError:
        pass
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)""",
     """        pass
    except FileNotFoundError:
        pass
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)""",
     ["tests/unit/test_output_hostile.py::test_a_link_at_a_temporary_name_is_removed_not_followed"], False),
    ("an output file opened through a link", "dataset/writer.py",
     "os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)",
     "os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)",
     ["tests/unit/test_output_hostile.py::test_a_link_at_an_output_file_is_refused"], False),
    ("KV events taken from any peer that connects", "servers/kvpeer.py",
     "            if procs.owns_inode(inode, since):\n                return\n            break",
     "            return",
     ["tests/privileged/test_kvevents_peers.py::test_a_forged_publisher_is_refused_and_only_the_servers_events_land"],
     True),
    ("KV events read from an ipc socket another process holds", "servers/kvpeer.py",
     "    if not procs.owns_pid(pid, since):", "    if False:",
     ["tests/privileged/test_kvevents_peers.py::test_an_ipc_socket_of_another_process_gets_nothing"], True),
    ("an ipc path followed through a planted link", "servers/kvpeer.py",
     "        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)",
     "        fd = os.open(name, os.O_PATH | os.O_CLOEXEC, dir_fd=dfd)",
     ["tests/privileged/test_kvevents_peers.py::test_a_planted_ipc_symlink_is_never_connected"], True),
    ("the engine's source read through links and FIFOs", "hook/source.py",
     'self.confined = root.startswith("/proc/") if confined is None else confined', "self.confined = False",
     ["tests/unit/test_discover_hostile.py::test_the_agent_side_source_check_refuses_a_fifo_or_link_at_once"], False),
    ("discovery waits on every process in turn", "servers/discover.py",
     """    pool = _Pool(_describe, procs, DEADLINE_S, WORKERS)
    for proc, info, why in pool.results():
        if why is not None:
            unreadable.append(Unreadable(proc.pid, why))
        elif info is not None:
            found.append(info)""",
     """    for proc in procs:
        info = _describe(proc)
        if info is not None:
            found.append(info)""",
     ["tests/unit/test_discover_hostile.py::test_a_process_whose_reads_never_return_is_given_up_and_the_rest_found"],
     False),
    ("directory links followed out of the root by the walk", "host/confined.py",
     "    return _walk_in_root(dirfd, path)", "    return _walk(dirfd, path, _DIR_FLAGS & ~os.O_NOFOLLOW)",
     ["tests/unit/test_discover_hostile.py::test_directory_links_resolve_inside_the_root_only"], False),
]


@pytest.mark.parametrize("row", REGRESSIONS, ids=[r[0] for r in REGRESSIONS])
def test_the_fix_taken_out_fails_its_tests(row, tmp_path):
    name, rel, fixed, regressed, tests, needs_root = row
    if needs_root and not ROOT:
        pytest.skip("its tests need root")
    shutil.copytree(REPO / "kvtrace", tmp_path / "kvtrace", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "kvtrace" / rel
    text = path.read_text()
    assert text.count(fixed) == 1, f"{rel} no longer holds the fix this row names: {fixed!r}"
    path.write_text(text.replace(fixed, regressed))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    # -P and append: the repository goes after PYTHONPATH, so `import kvtrace` finds the copy
    p = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append", *tests],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, f"with the fix taken out the tests did not fail (exit {p.returncode}):\n{p.stdout[-3000:]}"
