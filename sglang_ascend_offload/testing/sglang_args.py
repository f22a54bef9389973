"""Stand-ins for SGLang's resolved server arguments in component tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def server_args_stub(**overrides: Any) -> SimpleNamespace:
    """Every server argument the plugin reads (``compat.SERVER_ARGS``) at SGLang's own
    default, with ``overrides`` applied. An override that names no SGLang server
    argument is an error (a typo would otherwise test nothing)."""
    from sglang.srt.server_args import ServerArgs

    from ..sglang_plugin import compat

    fields = ServerArgs.__struct_fields__
    defaults = dict(zip(fields[len(fields) - len(ServerArgs.__struct_defaults__) :], ServerArgs.__struct_defaults__))
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"not SGLang server arguments: {unknown}")
    values = {name: defaults.get(name) for name in compat.SERVER_ARGS}
    values.update(overrides)
    return SimpleNamespace(**values)
