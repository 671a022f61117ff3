"""Live injection of the vLLM hook into a running server, without a restart.

Python 3.14+: ``sys.remote_exec`` run by the target's own interpreter.  Python 3.11-3.13:
kvtrace's own ptrace injector (inject/ptrace.py) catches the main thread at a system-call
entry, takes the GIL with PyGILState_Ensure, runs one PyRun_SimpleStringFlags that execs a
loader file, and releases the GIL — the sequence memray's gdb attach uses, without gdb,
whose inferior calls break on CPUs with AMX state.  The loader imports the hook
from a directory kvtrace stages for the target (its environment need not have kvtrace),
checks vLLM's version and signatures, and installs or removes the hook; it writes its
verdict to a result file the agent reads.
"""
