"""A forkserver child's environment is its launcher's at the moment the launcher starts it.

Python's forkserver forks every child from one server process, so a child would inherit the
server's ``os.environ`` (the launcher's when it started its *first* child), where a spawned
child gets the launcher's current one. The test harness's ``forkserver`` seam
(:mod:`.harness`) closes that gap: in the launcher it adds the current environment to the
preparation data multiprocessing pickles for every child, and the forkserver imports this
module first (its preload), so each forked child puts that environment in place before
multiprocessing prepares it (sets its ``sys.path``, working directory and main module).

Importing the module installs both halves in the importing process; each half is inert
where the other is not installed (a key nobody reads, a key nobody wrote).
"""

from __future__ import annotations

import os
from multiprocessing import spawn

#: The key added to multiprocessing's preparation data: a ``{name: value}`` copy of ``os.environ``.
ENVIRON_KEY = "sglang_ascend_offload_environ"

_original_preparation_data = spawn.get_preparation_data
_original_prepare = spawn.prepare


def preparation_data_with_environ(name):
    """The launcher's half: multiprocessing's preparation data plus ``os.environ`` now."""
    data = _original_preparation_data(name)
    data[ENVIRON_KEY] = dict(os.environ)
    return data


def prepare_with_environ(data):
    """The child's half: the launcher's environment in place, then multiprocessing's own preparation."""
    environ = data.get(ENVIRON_KEY)
    if environ is not None:
        apply_environment(environ)
    _original_prepare(data)


def apply_environment(environ) -> None:
    """Make ``os.environ`` equal ``environ``, touching only the names that differ (after
    :func:`_title_memory_found`)."""
    _title_memory_found()
    for name in [name for name in os.environ if name not in environ]:
        del os.environ[name]
    os.environ.update({name: value for name, value in environ.items() if os.environ.get(name) != value})


def _title_memory_found() -> None:
    """SGLang names its processes with ``setproctitle``, which finds the memory it writes the
    title to from the C ``environ`` at its first use: that use must come before the
    environment changes, or every later title is silently dropped."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(setproctitle.getproctitle())


def install() -> None:
    spawn.get_preparation_data = preparation_data_with_environ
    spawn.prepare = prepare_with_environ


install()
