"""The store owner's read channel: a server's main process reads the embedded store
through the process that holds it (the embedded engine admits one process per store).

:class:`ReadService` answers :class:`~dmi_sglang.domain.ports.RecordReader` calls on an
IPC socket, on its own thread of the owner; :class:`RemoteReader` is the reader the other
process uses. See :mod:`._reads`.
"""

from dmi_sglang.adapters.owner._reads import (
    READ_TIMEOUT_S,
    ReadService,
    RemoteReader,
    check_address,
)

__all__ = ["READ_TIMEOUT_S", "ReadService", "RemoteReader", "check_address"]
