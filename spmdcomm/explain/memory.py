"""The per-device memory of a compiled program (:class:`DeviceMemory`), a part of ``sc.explain``'s report."""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["DeviceMemory", "device_memory"]


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Per-device memory of a compiled program, from ``Compiled.memory_analysis()``, in bytes.

    Each field is ``None`` where the backend does not report it.

    Attributes:
      argument_bytes: the program's arguments.
      output_bytes: its outputs.
      temp_bytes: its temporaries.
      generated_code_bytes: its generated code.
      alias_bytes: outputs that reuse a donated argument's buffer, so they are counted in both
        ``argument_bytes`` and ``output_bytes``.
    """

    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None
    alias_bytes: int | None

    @property
    def total_bytes(self) -> int | None:
        """Arguments + outputs + temporaries + generated code - aliased (``None`` if any is unknown)."""
        args, outs, temps, code, alias = (
            self.argument_bytes,
            self.output_bytes,
            self.temp_bytes,
            self.generated_code_bytes,
            self.alias_bytes,
        )
        if args is None or outs is None or temps is None or code is None or alias is None:
            return None
        return args + outs + temps + code - alias


def device_memory(compiled: jax.stages.Compiled) -> DeviceMemory:
    """The :class:`DeviceMemory` of ``compiled`` (every field ``None`` where the backend has no analysis)."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):  # backends without the analysis raise one of these
        stats = None

    def get(name: str) -> int | None:
        value = getattr(stats, name, None)
        return None if value is None else int(value)

    return DeviceMemory(
        argument_bytes=get("argument_size_in_bytes"),
        output_bytes=get("output_size_in_bytes"),
        temp_bytes=get("temp_size_in_bytes"),
        generated_code_bytes=get("generated_code_size_in_bytes"),
        alias_bytes=get("alias_size_in_bytes"),
    )
